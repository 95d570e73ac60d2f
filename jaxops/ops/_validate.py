"""Input checks shared by the XLA-coded op families (activation, dropout, conv): each raises
TypeError/ValueError naming the op, at call time and at trace time alike."""
import operator

import jax.numpy as jnp

FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def fail(op, error, message):
    raise error(f"jaxops.ops.{op}: {message}")


def floats(op, **arrays):
    """Every named array is a float array of one dtype; returns that dtype."""
    dtypes = {}
    for label, x in arrays.items():
        if x.dtype not in FLOATS:
            fail(op, TypeError, f"{label} must be float16, bfloat16, float32 or float64, "
                                f"got {x.dtype}")
        dtypes[label] = x.dtype
    if len(set(dtypes.values())) > 1:
        fail(op, TypeError, f"{' and '.join(dtypes)} must share one dtype, got "
                            f"{', '.join(str(d) for d in dtypes.values())}")
    return next(iter(dtypes.values()))


def same_shape(op, **arrays):
    shapes = {label: tuple(x.shape) for label, x in arrays.items()}
    if len(set(shapes.values())) > 1:
        fail(op, ValueError, f"{' and '.join(shapes)} must share one shape, got "
                             f"{', '.join(str(s) for s in shapes.values())}")


def boolean(op, label, x):
    if x.dtype != jnp.bool_:
        fail(op, TypeError, f"{label} must be bool, got {x.dtype}")


def integer(op, label, value):
    try:
        return operator.index(value)
    except TypeError:
        fail(op, TypeError, f"{label} must be an int, got {value!r}")


def number(op, label, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            hasattr(value, "dtype") and jnp.ndim(value) == 0):
        fail(op, TypeError, f"{label} must be a number, got {value!r}")
    return value


def compute_dtype(dtype):
    """f16/bf16 are computed in f32 and rounded once at the end, as ORT's kernels do."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def outputs(op, wanted, n):
    """The `outputs` keyword of ops whose ORT outputs are optional: one bool per output."""
    if (not isinstance(wanted, (tuple, list)) or len(wanted) != n
            or not all(isinstance(o, (bool, int)) for o in wanted)):
        fail(op, TypeError, f"outputs must be {n} bools (one per ORT output), got {wanted!r}")
    return tuple(bool(o) for o in wanted)
