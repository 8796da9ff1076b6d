"""The bottom layer, imported by every other: :mod:`.config` (``DominoConfig`` and its flags),
:mod:`.settings` (the setting names ``p2``, ``p2-k2``, ``sp-s2``), :mod:`.recorder` (the
opt-in event recorder) and :mod:`.version` (the tested Megatron-Core range). None imports
torch at import time but the recorder; none imports another folder of the package.
"""
