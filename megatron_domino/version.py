"""The one place that decides which Megatron-Core releases megatron-domino runs on.

Domino re-sequences the submodule calls of Megatron-Core's ``TransformerLayer`` and takes
over the collectives of its tensor-parallel linears, so it depends on the call structure of
those classes. That structure changed between releases (e.g. the positional arguments of
``linear_with_grad_accumulation_and_async_allreduce`` between 0.16 and 0.19), so we refuse to
run on a release we have not tested instead of producing wrong gradients silently.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

#: Inclusive lower and exclusive upper bound of the tested Megatron-Core releases.
TESTED_MEGATRON_CORE = (Version("0.16.1"), Version("0.17"))


class UnsupportedMegatronVersion(RuntimeError):
    """Raised when the installed Megatron-Core is outside :data:`TESTED_MEGATRON_CORE`."""


def installed_megatron_core_version() -> Version:
    """Version of the installed ``megatron-core`` distribution."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError as err:
        raise UnsupportedMegatronVersion(
            "megatron-core is not installed; install the tested release with "
            f"`pip install 'megatron-core>={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}'`."
        ) from err


def check_megatron_core_version(found: Version | None = None) -> Version:
    """Raise :class:`UnsupportedMegatronVersion` unless the found release is tested.

    Args:
        found: the version to check; defaults to the installed one (tests pass others).
    Returns:
        The accepted version.
    """
    found = installed_megatron_core_version() if found is None else found
    low, high = TESTED_MEGATRON_CORE
    if not (low <= found < high):
        raise UnsupportedMegatronVersion(
            f"megatron-core {found} is installed, but megatron-domino is tested only with "
            f">={low},<{high}. Install a tested release "
            f"(`pip install 'megatron-core>={low},<{high}'`) or use a megatron-domino release "
            "that lists yours."
        )
    return found
