"""The test tiers (``unit/``, ``ranks/``, ``runs/``, ``gpu/``: tests/README.md) share the helper
modules of this folder (``tiny_models``, ``multiproc``, ``launch``, the stand-ins), imported by
their plain names; spawned ranks inherit this path with the rest of ``sys.path``.

The lab (``lab/``, beside the package and not installed) is imported from this checkout: its
root goes first on ``sys.path`` and on ``PYTHONPATH``, which the subprocesses the tests start
(torchrun, ``python -m lab.gpu_check``, the recipes) inherit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent)
CHECKOUT = str(Path(HELPERS).parent)
for folder in (CHECKOUT, HELPERS):  # HELPERS ends up first
    if folder not in sys.path:
        sys.path.insert(0, folder)
if CHECKOUT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [CHECKOUT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )

import pytest  # noqa: E402 - the helpers' folder goes on the path first
from te_cpu import installed_te_version, te_version_line  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Print which Transformer Engine the TE tests run (its own Python over the CPU backend),
    also under ``-q`` (which hides pytest's header): once, from the controlling process."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(te_version_line())


def pytest_collection_modifyitems(items: list) -> None:
    """Files with the most ``slow`` tests (the training launches) first, each file's tests
    kept together and in order: ``make test``'s two workers (``--dist loadfile``) take files
    in this order, so the long ones start at once instead of ending the run alone.

    The ``te`` tests are skipped, with the reason, where no Transformer Engine was installed
    for them (``make`` installs it); under CI (``CI=true``, which ``.ci/run`` sets) that is an
    error instead, so that a broken TE install cannot turn them into skips and pass."""
    if installed_te_version() is None:
        if os.environ.get("CI") == "true" and any(item.get_closest_marker("te") for item in items):
            raise pytest.UsageError(
                f"CI=true, but the te tests cannot run: {te_version_line()}. Install it (make "
                "install), or point MEGATRON_DOMINO_TE_HOME at a folder with TE's Python."
            )
        missing = pytest.mark.skip(reason=te_version_line())
        for item in items:
            if item.get_closest_marker("te") is not None:
                item.add_marker(missing)
    slow: dict = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {path: n for n, path in enumerate(slow)}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))
