"""The Megatron-Core release these patches were written against, checked before any is applied.

Every patch in ``coat_patches`` replaces or wraps a named function or attribute of
megatron-core (``megatron.core`` and the ``megatron.training`` it ships from 0.17). Those names and
the code around them move between releases, so a patch written for one release can silently do
the wrong thing on another. Each patch therefore calls ``require_megatron_core`` first and refuses
to apply to anything but the release it was tested with.
"""

from __future__ import annotations

SUPPORTED_MEGATRON = (0, 19)


def megatron_core_version() -> tuple[int, int, int]:
    """The installed megatron-core version as (major, minor, patch)."""
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def require_megatron_core(what: str) -> None:
    """Raise naming ``what`` (the patch) if the installed megatron-core is not 0.19.x."""
    found = megatron_core_version()
    if found[:2] != SUPPORTED_MEGATRON:
        major, minor = SUPPORTED_MEGATRON
        raise RuntimeError(
            f"{what} was written for megatron-core {major}.{minor}.x, but megatron-core "
            f"{'.'.join(map(str, found))} is installed; install it with "
            f"pip install 'megatron-core>={major}.{minor},<{major}.{minor + 1}', or port {what} "
            f"to the new release's call sites"
        )
