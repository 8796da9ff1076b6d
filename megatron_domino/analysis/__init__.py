"""What a recorded schedule means, for ``--domino-report`` and the lab.

* :mod:`.spans`: recorder events paired into collective spans (in flight, exposed, overlapped
  by which compute);
* :mod:`.report`: the ``--domino-report`` text and JSON totals;
* :mod:`.criteria`: how many collectives a step must have, and what each must overlap.
"""
