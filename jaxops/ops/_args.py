"""Argument checks shared by op modules: static int inputs and op-named errors."""
import contextlib
import functools
import inspect

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


# ---------------------------------------------------------------------------------------------
# Host int64 inputs when x64 is off (JAX's default)
#
# jnp.asarray narrows a numpy int64/uint64 array or scalar to 32 bits without a word when x64
# is off: label 2**32 + 1 becomes 1. Every public op is wrapped once (jaxops/ops/__init__.py,
# jaxops/nn/__init__.py) by `refuse_narrowed_ints`, which refuses such a value whose numbers do
# not fit 32 bits, naming the op and the argument. Static inputs (shapes, axes, slice bounds,
# ranks: read on the host as Python ints, so exact) are exempt: a function lists them with
# `static_inputs`.


def static_inputs(*names):
    """Marks the parameters an op reads on the host as Python ints (never narrowed)."""
    def mark(fn):
        fn.static_inputs = frozenset(names)
        return fn
    return mark


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


def check_host_ints(op: str, label: str, value):
    """ValueError if x64 is off and `value` (or an array in a list/tuple of them) is a host
    int64/uint64 value that JAX would narrow to a different number."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_host_ints(op, f"{label}[{i}]", v)
        return
    bad = _narrowed(value)
    if bad is not None:
        narrow = "int32" if value.dtype.kind == "i" else "uint32"
        raise ValueError(f"{op}: {label} ({value.dtype}) holds {bad}, outside {narrow}'s range; "
                         f"with x64 off JAX would narrow it to {narrow} silently: enable "
                         f"jax_enable_x64 or pass values that fit")


def refuse_narrowed_ints(fn, name: str):
    """`fn` (named `name` in errors) with its inputs checked by check_host_ints first: its
    positional parameters, passed by position or keyword, except its static_inputs.
    Keyword-only parameters are attributes and not checked."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    static = getattr(fn, "static_inputs", frozenset())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    inputs = frozenset(positional) - static

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not x64_enabled():
            for k, value in enumerate(args):
                param = positional[k] if k < len(positional) else rest
                if param not in static:
                    label = param if k < len(positional) else f"{rest}[{k - len(positional)}]"
                    check_host_ints(name, label, value)
            for label, value in kwargs.items():
                if label in inputs:
                    check_host_ints(name, label, value)
        return fn(*args, **kwargs)
    # The op's defaults stay readable where callers look for them (they do not apply to
    # `checked`'s own *args/**kwargs; fn applies them).
    checked.__defaults__ = getattr(fn, "__defaults__", None)
    checked.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    return checked
