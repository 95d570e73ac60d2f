"""The argument rules ops share. Each raises TypeError or ValueError with a plain message;
the op's public function (jaxops/_src/spec.py) prefixes it with the op's name, as `named`
does for checks that run elsewhere (an Op's shape rule at trace time)."""
import contextlib
import functools
import inspect
import operator

import jax
import jax.numpy as jnp
import numpy as np

FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
FLOAT_WORDS = "float16, bfloat16, float32 or float64"
INDEX = (np.dtype(np.int32), np.dtype(np.int64))


def named(op: str):
    """Prefixes a TypeError/ValueError raised inside with `jaxops.ops.<op>:` (once)."""
    return named_as(f"jaxops.ops.{op}")


@contextlib.contextmanager
def named_as(label: str):
    try:
        yield
    except (TypeError, ValueError) as e:
        if str(e).startswith("jaxops."):
            raise
        raise type(e)(f"{label}: {e}") from None


def floats(**arrays):
    """Every named array is a float array, all of one dtype; returns that dtype."""
    for label, x in arrays.items():
        if np.dtype(x.dtype) not in FLOATS:
            raise TypeError(f"{label} must be {FLOAT_WORDS}, got {x.dtype}")
    return same_dtype(**arrays)


def same_dtype(**arrays):
    dtypes = {label: np.dtype(x.dtype) for label, x in arrays.items() if x is not None}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{' and '.join(dtypes)} must share one dtype, got "
                        f"{', '.join(str(d) for d in dtypes.values())}")
    return next(iter(dtypes.values()), None)


def same_shape(**arrays):
    shapes = {label: tuple(x.shape) for label, x in arrays.items() if x is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{' and '.join(shapes)} must share one shape, got "
                         f"{', '.join(str(s) for s in shapes.values())}")


def integer(label, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{label} must be an int, got {value!r}") from None


def number(label, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            hasattr(value, "dtype") and jnp.ndim(value) == 0):
        raise TypeError(f"{label} must be a number, got {value!r}")
    return value


def axis(value, rank, label="axis") -> int:
    """An axis in [-rank, rank), returned in [0, rank)."""
    value = integer(label, value)
    if not -rank <= value < rank:
        raise ValueError(f"{label} {value} is out of range for rank {rank}")
    return value % rank if rank else 0


def flag(label, x):
    """ORT's bool flags: one element (shape [] or [1])."""
    if x.dtype != jnp.bool_:
        raise TypeError(f"{label} must be bool, got {x.dtype}")
    if x.size != 1:
        raise ValueError(f"{label} must hold one element, got shape {x.shape}")


def outputs(wanted, n):
    """The `outputs` keyword of ops whose ORT outputs are optional: one bool per output."""
    if (not isinstance(wanted, (tuple, list)) or len(wanted) != n
            or not all(isinstance(o, (bool, int)) for o in wanted)):
        raise TypeError(f"outputs must be {n} bools (one per ORT output), got {wanted!r}")
    return tuple(bool(o) for o in wanted)


def compute_dtype(dtype):
    """f16/bf16 are computed in f32 and rounded once at the end, as ORT's kernels do."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def static_ints(value, label: str) -> tuple[int, ...]:
    """A 1-D sequence of ints known at trace time (tuple, list, numpy or concrete jax array)
    as a tuple. ORT passes these as int64 tensors; in JAX they decide output shapes, so a
    traced value is a TypeError."""
    try:
        ints = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{label} must be static (a tuple, list, numpy or concrete jax array of "
                        "ints); got a traced value: it decides output shapes in JAX") from None
    if ints.dtype == object or ints.ndim != 1 or (
            ints.size and not np.issubdtype(ints.dtype, np.integer)):
        raise TypeError(f"{label} must be a 1-D sequence of ints, got {value!r}")
    return tuple(int(i) for i in ints)


# Host int64 inputs while x64 is off (JAX's default): jnp.asarray narrows a numpy int64 or
# uint64 value to 32 bits without a word (label 2**32 + 1 becomes 1), so such a value whose
# numbers do not fit is refused, naming the op and the input.

def x64_enabled() -> bool:
    return jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)


def _narrowed(value):
    """The first number of a host int64/uint64 value that 32 bits would change, else None."""
    if not isinstance(value, (np.ndarray, np.generic)) or value.dtype.kind not in "iu" \
            or value.dtype.itemsize <= 4 or value.size == 0:
        return None
    info = np.iinfo(np.int32 if value.dtype.kind == "i" else np.uint32)
    lo, hi = value.min(), value.max()
    return int(lo) if lo < info.min else int(hi) if hi > info.max else None


def check_host_ints(label: str, value):
    """ValueError if x64 is off and `value` (or an array in a list/tuple of them) is a host
    int64/uint64 value that JAX would narrow to a different number."""
    if x64_enabled():
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_host_ints(f"{label}[{i}]", v)
        return
    bad = _narrowed(value)
    if bad is not None:
        narrow = "int32" if value.dtype.kind == "i" else "uint32"
        raise ValueError(f"{label} ({value.dtype}) holds {bad}, outside {narrow}'s range; "
                         f"with x64 off JAX would narrow it to {narrow} silently: enable "
                         f"jax_enable_x64 or pass values that fit")


def refuse_narrowed_ints(fn, name: str):
    """`fn` (a jaxops.nn function, named `name` in errors) with check_host_ints run on its
    positional parameters first, except those listed in `fn.static_inputs` (read on the host
    as Python ints). Ops get the same check from their spec."""
    params = list(inspect.signature(fn).parameters.values())
    static = getattr(fn, "static_inputs", frozenset())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    inputs = frozenset(positional) - static

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        with named_as(name):
            for label, value in zip(positional, args):
                if label in inputs:
                    check_host_ints(label, value)
            for label, value in kwargs.items():
                if label in inputs:
                    check_host_ints(label, value)
        return fn(*args, **kwargs)
    return checked
