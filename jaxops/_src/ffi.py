"""Loads the compiled extensions and registers their FFI handlers with XLA, once."""
import functools
from collections.abc import Iterable

import jax


def check_targets(module: str, registered: Iterable[str], expected: Iterable[str]) -> None:
    """Raises ImportError naming every expected target the extension `module` did not register.

    Both extensions must register every target of the one list the C++ side declares
    (jaxops/registry.h: kTargets); a missing one would otherwise surface only when an op first
    lowers on that platform, as XLA's "No registered implementation for FFI custom call".
    """
    missing = sorted(set(expected) - set(registered))
    if missing:
        raise ImportError(
            f"jaxops.{module} does not register the FFI target(s) {', '.join(missing)}: the "
            "extension is out of date or its build left out an op family; rebuild jaxops "
            "(pip install -e .)")


def _register(module, platform: str) -> None:
    registrations = module.registrations()
    check_targets(module.__name__.rpartition(".")[2], registrations, module.expected_targets())
    for name, capsule in registrations.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


@functools.cache
def available_platforms() -> tuple[str, ...]:
    """Platforms whose handlers are registered: 'cpu' always, 'cuda' when _cuda was built."""
    from jaxops import _cpu

    _register(_cpu, "cpu")
    platforms = ["cpu"]
    try:
        from jaxops import _cuda
    except ImportError:  # built without a CUDA compiler
        return tuple(platforms)
    _register(_cuda, "CUDA")
    platforms.append("cuda")
    return tuple(platforms)
