"""The test tiers (``unit/``, ``ranks/``, ``runs/``, ``gpu/``: tests/README.md) share the helper
modules of this folder (``tiny_models``, ``multiproc``, ``launch``, the stand-ins), imported by
their plain names; spawned ranks inherit this path with the rest of ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
