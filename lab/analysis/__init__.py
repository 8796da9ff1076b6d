"""What only the lab and the tests ask of a run: Domino against stock on the same weights and
batch (:mod:`.errors`, :mod:`.equivalence`), host time against device time
(:mod:`.host_time`), what would stop a CUDA graph capture (:mod:`.capture_safety`) and TP
collective bytes per op (:mod:`.collective_bytes`)."""
