"""Loads the compiled extensions and registers their FFI handlers with XLA, once."""
import functools

import jax


@functools.cache
def available_platforms() -> tuple[str, ...]:
    """Platforms whose handlers are registered: 'cpu' always, 'cuda' when _cuda was built."""
    from jaxops import _cpu

    for name, capsule in _cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    platforms = ["cpu"]
    try:
        from jaxops import _cuda
    except ImportError:  # built without a CUDA compiler
        return tuple(platforms)
    for name, capsule in _cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    platforms.append("cuda")
    return tuple(platforms)
