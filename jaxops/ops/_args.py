"""Argument checks shared by op modules: static int inputs and op-named errors."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def static_ints(value, what: str) -> tuple[int, ...]:
    """A 1-D sequence of ints known at trace time (tuple, list, numpy or concrete jax array)
    as a tuple. ORT passes these as int64 tensors, but in JAX they decide output shapes:
    TypeError for a traced value or anything else."""
    try:
        ints = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{what} must be static (a tuple, list, numpy or concrete jax array of "
                        "ints); got a traced value: it decides output shapes in JAX") from None
    if ints.ndim != 1 or (ints.size and not np.issubdtype(ints.dtype, np.integer)):
        raise TypeError(f"{what} must be a 1-D sequence of ints, got {value!r}")
    return tuple(int(i) for i in ints)


def check_float(x, what: str):
    if np.dtype(x.dtype) not in FLOATS:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_flag(flag, what: str):
    """ORT's bool flags: one element (shape [] or [1])."""
    if flag.dtype != jnp.bool_:
        raise TypeError(f"{what} must be bool, got {flag.dtype}")
    if flag.size != 1:
        raise ValueError(f"{what} must hold one element, got shape {flag.shape}")


@contextlib.contextmanager
def named(op: str):
    """Prefixes a TypeError/ValueError raised by the checks inside with `jaxops.ops.<op>:`."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise type(e)(f"jaxops.ops.{op}: {e}") from None
