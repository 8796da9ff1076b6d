"""The version guard judges the Megatron-Core that is imported, not the installed wheel; the
package declares the tested ranges, and ``make`` pins the tested release."""

import itertools
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from megatron.core import utils as megatron_utils
from megatron.core.extensions import transformer_engine as megatron_te
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_domino.base.config import DominoUnsupportedError
from megatron_domino.base.version import (
    ALLOW_UNTESTED_ENV,
    ALLOW_UNTESTED_TE_ENV,
    PINNED_MEGATRON_CORE,
    TE_MIN_VERSION,
    TESTED_MEGATRON_CORE,
    TESTED_TRANSFORMER_ENGINE,
    UnsupportedMegatronVersion,
    UntestedTransformerEngineWarning,
    check_megatron_core_version,
    check_transformer_engine_version,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_imported_release_is_accepted():
    # Megatron's package_info appends the commit of a git tree it sits in (`+<sha>`), which
    # includes a .venv inside this checkout: the release is the public part.
    assert check_megatron_core_version().public == PINNED_MEGATRON_CORE
    assert Version(PINNED_MEGATRON_CORE) in TESTED_MEGATRON_CORE


@pytest.mark.parametrize("found", ["0.19.1", "0.19.1+5be9626", "0.19.2"])
def test_tested_releases_pass(found):
    assert check_megatron_core_version(Version(found)) == Version(found)


@pytest.mark.parametrize("found", ["0.16.1", "0.18.2", "0.19.0", "0.20.0", "0.20.0rc0"])
def test_other_releases_are_refused_with_the_fix(found):
    with pytest.raises(UnsupportedMegatronVersion) as err:
        check_megatron_core_version(Version(found))
    message = str(err.value)
    assert f"megatron-core {found} is not a release" in message
    assert f"pip install megatron-core=={PINNED_MEGATRON_CORE}" in message
    assert "53915d8" in message  # where 0.16 users find the last release that ran on it


def _check_with_checkout(
    tmp_path, version: str, calls: int = 1, **env: str
) -> subprocess.CompletedProcess:
    """Run the guard ``calls`` times (as the entry point, the flag check and ``apply_domino``
    each do) with a Megatron-LM-checkout-style ``megatron/core`` first on the path."""
    core = tmp_path / "Megatron-LM" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(f"__version__ = {version!r}\n")
    code = textwrap.dedent(
        """
        import sys
        from megatron_domino.base.version import check_megatron_core_version
        for _ in range(int(sys.argv[1])):
            print(check_megatron_core_version())
        """
    )
    env_path = str(tmp_path / "Megatron-LM")
    return subprocess.run(
        [sys.executable, "-c", code, str(calls)],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_checkout_on_pythonpath_is_judged_by_its_own_version(tmp_path):
    # The installed wheel is 0.19.2 either way; only the imported code's version counts.
    refused = _check_with_checkout(tmp_path / "a", "0.20.0")
    assert refused.returncode != 0
    assert "megatron-core 0.20.0 (imported from" in refused.stderr
    assert str(tmp_path / "a" / "Megatron-LM" / "megatron" / "core") in refused.stderr
    accepted = _check_with_checkout(tmp_path / "b", "0.19.1")
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stdout.strip() == "0.19.1"


def test_a_newer_checkout_runs_with_the_explicit_opt_in_and_one_warning(tmp_path):
    """Megatron-LM ``main`` (0.20.0) is refused by policy; the opt-in runs it with one loud
    warning per process naming the version found and the last tested release."""
    refused = _check_with_checkout(tmp_path / "a", "0.20.0")
    assert refused.returncode != 0 and f"set {ALLOW_UNTESTED_ENV}=1" in refused.stderr
    allowed = _check_with_checkout(tmp_path / "b", "0.20.0", calls=3, **{ALLOW_UNTESTED_ENV: "1"})
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.split() == ["0.20.0"] * 3
    assert allowed.stderr.count("UntestedMegatronCoreWarning") == 1, allowed.stderr
    assert "megatron-core 0.20.0 (imported from" in allowed.stderr
    assert f"the last tested release is {PINNED_MEGATRON_CORE}" in allowed.stderr


@pytest.mark.parametrize("found", ["0.20.0rc0", "0.21.3"])
def test_the_opt_in_covers_newer_releases_only(monkeypatch, found):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=f"megatron-core {found} is untested"):
        assert check_megatron_core_version(Version(found)) == Version(found)
    # Older releases are known not to match Domino's calls: still refused, with no opt-in offered.
    with pytest.raises(UnsupportedMegatronVersion) as err:
        check_megatron_core_version(Version("0.18.2"))
    assert ALLOW_UNTESTED_ENV not in str(err.value)


@pytest.mark.parametrize("value", ["true", "yes", " 1"])
def test_an_unclear_opt_in_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, value)
    with pytest.raises(UnsupportedMegatronVersion, match=f"{ALLOW_UNTESTED_ENV}=.*set it to 1"):
        check_megatron_core_version(Version("0.20.0"))
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(UnsupportedMegatronVersion, match="is not a release"):
        check_megatron_core_version(Version("0.20.0"))


def _requirements() -> dict[str, Requirement]:
    """pyproject.toml's requirements by name: the dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [
        *project["dependencies"],
        *itertools.chain(*project["optional-dependencies"].values()),
    ]
    return {Requirement(line).name: Requirement(line) for line in listed}


def test_the_package_declares_the_tested_ranges_and_make_pins_the_release():
    # pip install megatron-domino keeps a user's 0.19.1 (an exact pin would replace it).
    requirements = _requirements()
    assert requirements["megatron-core"].specifier == TESTED_MEGATRON_CORE
    transformer_engine = requirements["transformer-engine"].specifier
    assert transformer_engine == TESTED_TRANSFORMER_ENGINE
    (floor,) = (Version(s.version) for s in transformer_engine if s.operator == ">=")
    assert floor == TE_MIN_VERSION
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line]
    assert pins == [f"megatron-core=={PINNED_MEGATRON_CORE}"]
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize(
    ("found", "accepted"),
    [("1.13.0", False), ("2.17.1", False), ("2.18.0", True), ("2.18.0+8f3c2a1", True),
     ("2.20.0.dev0", True), ("2.20.2", True), ("2.21.0", False), ("3.0.0", False)],
)  # fmt: skip
def test_transformer_engine_outside_the_tested_range_is_refused(monkeypatch, found, accepted):
    """The TE floor is the release whose saved tensors and caches Domino models (v2.18); the
    ceiling is the last release the TE tests ran (2.20), refused above it (a faked 2.21.0)."""
    monkeypatch.setattr(megatron_te, "HAVE_TE", True)
    monkeypatch.setattr(megatron_utils, "get_te_version", lambda: Version(found))
    monkeypatch.delenv(ALLOW_UNTESTED_TE_ENV, raising=False)
    assert Version("2.18.0") == TE_MIN_VERSION
    if accepted:
        check_transformer_engine_version()
        return
    message = (
        f"found {re.escape(found)}" if Version(found) < TE_MIN_VERSION else f"{found} is newer"
    )
    with pytest.raises(DominoUnsupportedError, match=message):
        check_transformer_engine_version()


def test_a_newer_transformer_engine_runs_with_one_warning_when_asked(monkeypatch):
    monkeypatch.setattr(megatron_te, "HAVE_TE", True)
    monkeypatch.setattr(megatron_utils, "get_te_version", lambda: Version("2.21.0"))
    monkeypatch.setenv(ALLOW_UNTESTED_TE_ENV, "1")
    with pytest.warns(UntestedTransformerEngineWarning, match="2.21.0 is untested"):
        check_transformer_engine_version()
    monkeypatch.setenv(ALLOW_UNTESTED_TE_ENV, "yes")
    with pytest.raises(UnsupportedMegatronVersion, match="set it to 1"):
        check_transformer_engine_version()


def test_make_installs_the_te_release_the_suite_names():
    """``make``'s default TE (``TE ?= x``) is the one the TE tests look for without
    ``MEGATRON_DOMINO_TE_HOME`` (``te_cpu.SUITE_TE_VERSION``), and inside the tested range."""
    from te_cpu import SUITE_TE_VERSION

    (default,) = re.findall(r"^TE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert default == SUITE_TE_VERSION
    assert Version(default) in TESTED_TRANSFORMER_ENGINE
