"""What a recorded schedule or a comparison with stock Megatron-Core means.

* :mod:`.spans`: recorder events paired into collective spans (in flight, exposed, overlapped
  by which compute);
* :mod:`.report`: the ``--domino-report`` text and JSON totals;
* :mod:`.criteria`: how many collectives a step must have, and what each must overlap;
* :mod:`.errors`, :mod:`.equivalence`: Domino against stock on the same weights and batch.
"""
