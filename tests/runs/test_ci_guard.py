"""Under CI a tier that cannot run fails instead of skipping: with ``CI=true`` (``.ci/run``
exports it) and no Transformer Engine Python where the TE tests look for it, the suite stops
at collection, naming the folder and the fix; without ``CI`` the TE tests are skipped with
that reason (a developer's machine without ``make install``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: A file of ``te`` tests: the guard needs only their collection.
TE_FILE = TESTS / "ranks" / "test_te_amax_group.py"


def _collect(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name != "CI"}
    environment.update(MEGATRON_DOMINO_TE_HOME=str(tmp_path / "no-te"), **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", str(TE_FILE)],
        capture_output=True, text=True, env=environment, cwd=TESTS.parent, timeout=120,
    )  # fmt: skip


def test_ci_stops_when_the_te_tests_cannot_run(tmp_path):
    stopped = _collect(tmp_path, CI="true")
    assert stopped.returncode != 0
    assert (
        f"CI=true, but the te tests cannot run: transformer-engine: none in {tmp_path / 'no-te'}"
        in (stopped.stdout + stopped.stderr)
    )


def test_outside_ci_they_are_collected_to_be_skipped(tmp_path):
    collected = _collect(tmp_path)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "2 tests collected" in collected.stdout
