"""Mixed precision, scaling and finiteness: MixedPrecisionScale, IsFinite, IsAllFinite,
ReduceAllL2, Scale, ScaledSum, BatchScale, All (com.microsoft).

All are XLA code: each is elementwise (fuses with its neighbours, which an FFI call would
prevent) or a reduction per tensor that XLA fuses into one loop per input plus a tiny combine.
A multi-tensor kernel would save launches only (no bytes) for the list reductions
(ReduceAllL2, IsAllFinite); where they sit in an optimizer step the fused optimizer kernels
are what matter. Reduced precision computes in f32.
"""
import jax.numpy as jnp

from jaxops.reference import scaling as ref

_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
# ONNX TensorProto element types MixedPrecisionScale's `to` may name
_TO = {1: jnp.float32, 10: jnp.float16, 11: jnp.float64, 16: jnp.bfloat16}

__all__ = ["mixed_precision_scale", "is_finite", "is_all_finite", "reduce_all_l2", "scale",
           "scaled_sum", "batch_scale", "all"]


def _fail(name, error, msg):
    raise error(f"jaxops.ops.{name}: {msg}")


def _floats(name, xs, label="inputs"):
    xs = [jnp.asarray(x) for x in xs]
    for x in xs:
        if x.dtype not in _FLOATS:
            _fail(name, TypeError, f"{label} must be float16, bfloat16, float32 or float64, "
                                   f"got {x.dtype}")
    return xs


def _need(name, xs):
    if not xs:
        _fail(name, ValueError, "needs at least one input")


def mixed_precision_scale(S, *X, to, fuse_outputs=0):
    """ORT MixedPrecisionScale: Y_i = cast(X_i * S, to), `to` an ONNX element type (1 float,
    10 float16, 11 double, 16 bfloat16). fuse_outputs=1 returns one flat output (all Y_i
    raveled and concatenated). Returns a tuple."""
    _need("mixed_precision_scale", X)
    X = _floats("mixed_precision_scale", X, "X")
    (S,) = _floats("mixed_precision_scale", [S], "S")
    if S.size != 1:
        _fail("mixed_precision_scale", ValueError, f"S must hold one element, got {S.shape}")
    if to not in _TO:
        _fail("mixed_precision_scale", ValueError, f"to must be one of {sorted(_TO)}, got {to}")
    return ref.mixed_precision_scale(S, *X, to=_TO[to], fuse_outputs=fuse_outputs)


def is_finite(X):
    """ORT IsFinite: elementwise isfinite (False for inf and nan)."""
    (X,) = _floats("is_finite", [X], "X")
    return ref.is_finite(X)


def is_all_finite(*inputs, isinf_only=0, isnan_only=0):
    """ORT IsAllFinite: a bool scalar, True when no element of any input is inf or nan
    (isinf_only: only inf counts; isnan_only: only nan counts)."""
    _need("is_all_finite", inputs)
    if isinf_only and isnan_only:
        _fail("is_all_finite", ValueError, "isinf_only and isnan_only exclude each other")
    return ref.is_all_finite(*_floats("is_all_finite", inputs), isinf_only=isinf_only,
                             isnan_only=isnan_only)


def reduce_all_l2(*X):
    """ORT ReduceAllL2: sqrt(sum of x^2 over every element of every input), a scalar of the
    first input's dtype, accumulated in f32 (f64 when any input is f64)."""
    _need("reduce_all_l2", X)
    return ref.reduce_all_l2(*_floats("reduce_all_l2", X, "X"))


def scale(input, scale, scale_down=0):  # noqa: A002 - ORT's input name
    """ORT Scale: input * scale, or input / scale with scale_down=1 (scale, one element of any
    float or int dtype, is cast to input's dtype first)."""
    (x,) = _floats("scale", [input], "input")
    s = jnp.asarray(scale)
    if s.size != 1:
        _fail("scale", ValueError, f"scale must hold one element, got shape {s.shape}")
    if not (jnp.issubdtype(s.dtype, jnp.floating) or jnp.issubdtype(s.dtype, jnp.integer)):
        _fail("scale", TypeError, f"scale must be a float or int, got {s.dtype}")
    return ref.scale(x, s, scale_down=scale_down)


def scaled_sum(input0, input1, input2=None, *, scale_0, scale_1, scale_2=1.0):
    """ORT ScaledSum: scale_0*input0 + scale_1*input1 (+ scale_2*input2), inputs of one shape
    and dtype."""
    xs = _floats("scaled_sum", [x for x in (input0, input1, input2) if x is not None])
    if len({(x.shape, x.dtype) for x in xs}) > 1:
        _fail("scaled_sum", ValueError, "inputs must share one shape and dtype, got "
                                        f"{[(x.shape, str(x.dtype)) for x in xs]}")
    return ref.scaled_sum(*xs, scale_0=scale_0, scale_1=scale_1, scale_2=scale_2)


def batch_scale(input, *, scale_0, scale_1, scale_2=None):  # noqa: A002 - ORT's input name
    """ORT BatchScale: (input*scale_0, input*scale_1[, input*scale_2])."""
    (x,) = _floats("batch_scale", [input], "input")
    return ref.batch_scale(x, scale_0=scale_0, scale_1=scale_1, scale_2=scale_2)


def all(X):  # noqa: A001 - ORT's op name
    """ORT All: logical AND of every element of a bool tensor, a bool scalar."""
    X = jnp.asarray(X)
    if X.dtype != jnp.bool_:
        _fail("all", TypeError, f"X must be bool, got {X.dtype}")
    return ref.all_(X)


_MS = "com.microsoft"
ORT_OPS = {
    (_MS, "MixedPrecisionScale"): mixed_precision_scale,
    (_MS, "IsFinite"): is_finite,
    (_MS, "IsAllFinite"): is_all_finite,
    (_MS, "ReduceAllL2"): reduce_all_l2,
    (_MS, "Scale"): scale,
    (_MS, "ScaledSum"): scaled_sum,
    (_MS, "BatchScale"): batch_scale,
    (_MS, "All"): all,
}
