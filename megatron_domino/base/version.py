"""The one place that decides which Megatron-Core (and Transformer Engine) releases Domino
runs on.

Domino re-sequences the submodule calls of Megatron-Core's ``TransformerLayer`` and takes
over the collectives of its tensor-parallel linears, so it depends on the call structure of
those classes. That structure changes between releases (e.g. the positional arguments of
``linear_with_grad_accumulation_and_async_allreduce`` between 0.16 and 0.19), so we refuse to
run on a release we have not tested instead of producing wrong gradients silently.

The version judged is the one of the ``megatron.core`` that Python imports
(``megatron.core.package_info.__version__``), not the installed ``megatron-core``
distribution's metadata: Megatron-LM users put a checkout on ``PYTHONPATH``, and then the
code that runs is the checkout's, whatever wheel is installed beside it.

Transformer Engine is checked only where its layers are used (:func:`check_transformer_engine_version`).
"""

from __future__ import annotations

import os
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The Megatron-Core releases megatron-domino is tested with: 0.19.2 (the wheel the test suite
#: installs) and 0.19.1 (Megatron-LM's ``core_r0.19.0`` branch on ``PYTHONPATH``). A local
#: version label (``0.19.1+ab12cd3``, what a git checkout reports) is accepted.
TESTED_MEGATRON_CORE = SpecifierSet(">=0.19.1,<0.20")

#: The release ``make`` installs and the suite runs against (pinned in ``constraints.txt``;
#: ``pyproject.toml`` declares :data:`TESTED_MEGATRON_CORE`).
PINNED_MEGATRON_CORE = "0.19.2"

#: The last megatron-domino commit that supported megatron-core 0.16.x on Python 3.11.
LAST_COMMIT_FOR_MEGATRON_CORE_0_16 = "53915d8"


#: The Transformer Engine release whose contract Domino models, and the oldest it accepts:
#: what TE saves for backward (FP8 weights as plain uint8 data/transpose), how
#: ``is_first_microbatch`` caches FP8 weights, ``get_dummy_wgrad``'s shared placeholder, the
#: SP gather of the norm output and the per-call ``parallel_mode``/``sequence_parallel`` and
#: mask types, all read from TE v2.18's source (unchanged at 2.20's development head; the
#: project's notes, ``../shared/docs/te-contract.md`` beside the checkout). Older TE saves and
#: caches differently (1.x saves FP8 weights as ``Float8Tensor``), which the saved-shard pack
#: hook and the FP8 weight-cache handling were not written against.
TE_MIN_VERSION = Version("2.18.0")
#: The Transformer Engine releases Domino's TE tests passed on, TE's own Python over the CPU
#: backend of its extension (``tests/te_cpu``): 2.18.0 in ``make test``, 2.20.2 in ``make
#: test-te TE=2.20.2`` (2026-12-03). ``pyproject.toml``'s ``gpu`` extra declares this range
#: (``tests/runs/test_version.py`` keeps them equal); kernels, cuDNN attention and NCCL are a
#: GPU's to decide (from a checkout, ``make gpu-check``).
TESTED_TRANSFORMER_ENGINE = SpecifierSet(f">={TE_MIN_VERSION},<2.21")


#: Set to 1 to run on a Megatron-Core newer than :data:`TESTED_MEGATRON_CORE` anyway (e.g. a
#: Megatron-LM ``main`` checkout before its release), with one warning instead of the refusal.
#: Explicit on purpose: a changed call structure can make Domino compute wrong gradients
#: without an error, so nobody should get there by accident. Older releases stay refused:
#: they are known not to match (0.16's linear arguments, for one).
ALLOW_UNTESTED_ENV = "MEGATRON_DOMINO_ALLOW_UNTESTED_MEGATRON"


#: Set to 1 to run on a Transformer Engine newer than :data:`TESTED_TRANSFORMER_ENGINE`
#: anyway, with one warning instead of the refusal: as explicit as
#: :data:`ALLOW_UNTESTED_ENV`, for the same reason (Domino reads TE's private quantizer slots
#: and FP8 weight cache, which a newer TE may lay out differently).
ALLOW_UNTESTED_TE_ENV = "MEGATRON_DOMINO_ALLOW_UNTESTED_TE"


class UnsupportedMegatronVersion(RuntimeError):
    """Raised when the imported Megatron-Core is outside :data:`TESTED_MEGATRON_CORE`."""


class UntestedMegatronCoreWarning(UserWarning):
    """Issued (once per process) when :data:`ALLOW_UNTESTED_ENV` lets an untested, newer
    Megatron-Core run."""


class UntestedTransformerEngineWarning(UserWarning):
    """Issued (once per process) when :data:`ALLOW_UNTESTED_TE_ENV` lets an untested, newer
    Transformer Engine run."""


def imported_megatron_core_version() -> Version:
    """Version of the ``megatron.core`` package Python imports (a checkout's or a wheel's)."""
    try:
        from megatron.core import package_info
    except ImportError as err:
        raise UnsupportedMegatronVersion(
            "megatron.core does not import; install the tested release with "
            f"`pip install megatron-core=={PINNED_MEGATRON_CORE}` (Python >= 3.12)."
        ) from err
    try:
        return Version(package_info.__version__)
    except InvalidVersion as err:
        raise UnsupportedMegatronVersion(
            f"megatron.core at {package_info.__file__} reports version "
            f"{package_info.__version__!r}, which is not a version number."
        ) from err


def _where() -> str:
    from megatron.core import package_info

    return package_info.__file__.removesuffix("/package_info.py")


def check_megatron_core_version(found: Version | None = None) -> Version:
    """Raise :class:`UnsupportedMegatronVersion` unless the Megatron-Core that runs is tested,
    or is newer and :data:`ALLOW_UNTESTED_ENV` is 1 (then warn, once per process).

    Args:
        found: the version to check; defaults to the imported ``megatron.core``'s own.
    Returns:
        The accepted version.
    """
    where = "" if found is not None else f" (imported from {_where()})"
    found = imported_megatron_core_version() if found is None else found
    public = Version(found.public)
    if public in TESTED_MEGATRON_CORE:
        return found
    # Newer: at or past the range's upper bound, pre-releases of it included (0.20.0rc0).
    newer = all(
        public.release >= Version(s.version).release
        for s in TESTED_MEGATRON_CORE
        if s.operator == "<"
    )
    if newer and _untested_allowed():
        warnings.warn(
            f"megatron-core {found}{where} is untested with megatron-domino (the last tested "
            f"release is {PINNED_MEGATRON_CORE}, range {TESTED_MEGATRON_CORE}); running anyway "
            f"because {ALLOW_UNTESTED_ENV}=1. Domino re-sequences Megatron-Core's layer "
            "internals: compare its losses with a run without --domino before trusting it.",
            UntestedMegatronCoreWarning,
            stacklevel=1,  # this line's location: Python's default filter shows it once
        )
        return found
    opt_in = (
        f" To run this newer release anyway, untested, set {ALLOW_UNTESTED_ENV}=1." if newer else ""
    )
    raise UnsupportedMegatronVersion(
        f"megatron-core {found}{where} is not a release megatron-domino is tested with "
        f"({TESTED_MEGATRON_CORE}). Install the tested release "
        f"(`pip install megatron-core=={PINNED_MEGATRON_CORE}`), or put a Megatron-LM "
        "checkout of branch core_r0.19.0 first on PYTHONPATH. For megatron-core 0.16.x use "
        f"megatron-domino at commit {LAST_COMMIT_FOR_MEGATRON_CORE_0_16}.{opt_in}"
    )


def _untested_allowed(variable: str = ALLOW_UNTESTED_ENV, what: str = "Megatron-Core") -> bool:
    """Whether ``variable`` opts in: ``1`` yes; unset, empty or ``0`` no; anything else is
    refused, so that a typo (``true``, ``yes``) is not read either way."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise UnsupportedMegatronVersion(
            f"{variable}={value!r}: set it to 1 to run an untested {what}, or unset it."
        )
    return value == "1"


def check_transformer_engine_version() -> None:
    """Raise unless the installed Transformer Engine is in :data:`TESTED_TRANSFORMER_ENGINE`,
    or is newer and :data:`ALLOW_UNTESTED_TE_ENV` is 1 (then warn, once per process).

    Without TE nothing is checked: Megatron's TE layers cannot be built then. (Megatron-Core
    0.19's ``get_te_version`` reports ``0.0.0`` when TE does not import, hence ``HAVE_TE``.)

    Called at flag time (:func:`megatron_domino.training.megatron_lm.check_args`, with
    ``--transformer-impl transformer_engine``) and again when Domino is applied to a model with
    TE layers.

    Raises:
        DominoUnsupportedError: a TE outside the tested range, with the version found and the
            fix.
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.utils import get_te_version

    from megatron_domino.base.config import DominoUnsupportedError

    if not HAVE_TE:
        return
    found = get_te_version()
    if found < TE_MIN_VERSION:
        raise DominoUnsupportedError(
            f"Domino needs Transformer Engine >= {TE_MIN_VERSION}, the release whose saved "
            f"tensors, FP8 weight cache and placeholder gradients it models; found {found}. "
            f"Install it (`pip install 'transformer-engine[pytorch]>={TE_MIN_VERSION}'`, or "
            "megatron-domino's gpu extra), or use --transformer-impl local."
        )
    if Version(found.public) in TESTED_TRANSFORMER_ENGINE:
        return
    if _untested_allowed(ALLOW_UNTESTED_TE_ENV, "Transformer Engine"):
        warnings.warn(
            f"Transformer Engine {found} is untested with megatron-domino (tested: "
            f"{TESTED_TRANSFORMER_ENGINE}); running anyway because {ALLOW_UNTESTED_TE_ENV}=1. "
            "Domino reads TE's private quantizer slots and FP8 weight cache: compare the losses "
            "with a run without --domino before trusting it.",
            UntestedTransformerEngineWarning,
            stacklevel=1,  # this line's location: Python's default filter shows it once
        )
        return
    raise DominoUnsupportedError(
        f"Transformer Engine {found} is newer than the releases megatron-domino is tested with "
        f"({TESTED_TRANSFORMER_ENGINE}). Domino reads TE's private quantizer slots and FP8 "
        "weight cache, which a newer TE may lay out differently (wrong gradients, no error). "
        f"Install a tested release (`pip install 'transformer-engine[pytorch]{TESTED_TRANSFORMER_ENGINE}'`), "
        f"or set {ALLOW_UNTESTED_TE_ENV}=1 to run it anyway with one warning."
    )
