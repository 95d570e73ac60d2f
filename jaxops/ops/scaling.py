"""Mixed precision, scaling and finiteness: MixedPrecisionScale, IsFinite, IsAllFinite,
ReduceAllL2, Scale, ScaledSum, BatchScale, All (com.microsoft).

All are XLA code: each is elementwise (fuses with its neighbours, which an FFI call would
prevent) or a reduction per tensor that XLA fuses into one loop per input plus a tiny combine.
A multi-tensor kernel would save launches only (no bytes) for the list reductions
(ReduceAllL2, IsAllFinite); where they sit in an optimizer step the fused optimizer kernels
are what matter. Reduced precision computes in f32.
"""
import jax.numpy as jnp

from jaxops._src import rules
from jaxops._src.spec import REQUIRED, Matrix, define
from jaxops.reference import scaling as ref

_MS = "com.microsoft"
# ONNX TensorProto element types MixedPrecisionScale's `to` may name
_TO = {1: jnp.float32, 10: jnp.float16, 11: jnp.float64, 16: jnp.bfloat16}

__all__ = ["mixed_precision_scale", "is_finite", "is_all_finite", "reduce_all_l2", "scale",
           "scaled_sum", "batch_scale", "all"]


def _need(xs):
    if not xs:
        raise ValueError("needs at least one input")


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _one_element(rng, dtype, low=0.5, high=2.0):
    return jnp.asarray([rng.uniform(low, high)], dtype)


# ---- MixedPrecisionScale ------------------------------------------------------------------

def _mps_check(S, *X, to, fuse_outputs):
    _need(X)
    if S.size != 1:
        raise ValueError(f"S must hold one element, got shape {S.shape}")
    if to not in _TO:
        raise ValueError(f"to must be one of {sorted(_TO)}, got {to}")


mixed_precision_scale = define(
    "mixed_precision_scale", ort=(_MS, "MixedPrecisionScale"), inputs=("S: float", "*X: float"),
    outputs=("*Y",), attrs={"to": REQUIRED, "fuse_outputs": 0}, check=_mps_check,
    reference=lambda S, *X, to, fuse_outputs: ref.mixed_precision_scale(
        S, *X, to=_TO[to], fuse_outputs=fuse_outputs),
    doc="""ORT MixedPrecisionScale: Y_i = cast(X_i * S, to), `to` an ONNX element type (1 float,
    10 float16, 11 double, 16 bfloat16). fuse_outputs=1 returns one flat output (all Y_i
    raveled and concatenated). Returns a tuple.""",
    # to=11 (double): the f64 gradient checks stay in f64
    matrix=Matrix(lambda rng, shape, dtype: (_one_element(rng, dtype), _normal(rng, shape, dtype),
                                             _normal(rng, shape, dtype)),
                  attrs={"to": 11}, grad=(0, 1, 2)))


# ---- IsFinite, IsAllFinite, All -----------------------------------------------------------

is_finite = define(
    "is_finite", ort=(_MS, "IsFinite"), inputs=("X: float",), outputs=("Y",),
    reference=ref.is_finite,
    doc="""ORT IsFinite: elementwise isfinite (False for inf and nan).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype).at[0].set(jnp.inf),)))


def _is_all_finite_check(*inputs, isinf_only, isnan_only):
    _need(inputs)
    if isinf_only and isnan_only:
        raise ValueError("isinf_only and isnan_only exclude each other")


def _maybe_inf(rng, shape, dtype):
    """Random values, with an inf row half the time (examples of a batch differ)."""
    x = _normal(rng, shape, dtype)
    return x.at[0].set(jnp.inf) if rng.uniform() < 0.5 else x


is_all_finite = define(
    "is_all_finite", ort=(_MS, "IsAllFinite"), inputs=("*input: float",), outputs=("output",),
    attrs={"isinf_only": 0, "isnan_only": 0}, check=_is_all_finite_check,
    reference=ref.is_all_finite,
    doc="""ORT IsAllFinite: a bool scalar, True when no element of any input is inf or nan
    (isinf_only: only inf counts; isnan_only: only nan counts).""",
    matrix=Matrix(lambda rng, shape, dtype: (_maybe_inf(rng, shape, dtype),
                                             _normal(rng, shape, dtype)),
                  shard=False, skip="the output is one bool for all inputs: nothing to shard"))

all = define(  # noqa: A001 - ORT's op name
    "all", ort=(_MS, "All"), inputs=("X: bool",), outputs=("Y",), reference=ref.all_,
    doc="""ORT All: logical AND of every element of a bool tensor, a bool scalar.""",
    matrix=Matrix(lambda rng, shape, dtype: (jnp.asarray(rng.uniform(size=shape) < 0.97),),
                  shard=False, skip="the output is one bool: nothing to shard"))


# ---- ReduceAllL2 --------------------------------------------------------------------------

reduce_all_l2 = define(
    "reduce_all_l2", ort=(_MS, "ReduceAllL2"), inputs=("*X: float",), outputs=("Y",),
    check=lambda *X: _need(X), reference=ref.reduce_all_l2,
    doc="""ORT ReduceAllL2: sqrt(sum of x^2 over every element of every input), a scalar of the
    first input's dtype, accumulated in f32 (f64 when any input is f64).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             _normal(rng, shape[:1], dtype)),
                  grad=(0, 1), shard=False,
                  skip="the output is one scalar for all inputs: nothing to shard "
                       "(tests/test_scaling.py checks a sharded input's value)"))


# ---- Scale, ScaledSum, BatchScale ---------------------------------------------------------

def _scale_check(input, scale, *, scale_down):  # noqa: A002 - ORT's input name
    if scale.size != 1:
        raise ValueError(f"scale must hold one element, got shape {scale.shape}")
    if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
        raise TypeError(f"scale must be a float or int, got {scale.dtype}")


scale = define(
    "scale", ort=(_MS, "Scale"), inputs=("input: float", "scale: array"), outputs=("output",),
    attrs={"scale_down": 0}, check=_scale_check,
    reference=lambda x, s, *, scale_down: ref.scale(x, s, scale_down=scale_down),
    doc="""ORT Scale: input * scale, or input / scale with scale_down=1 (scale, one element of
    any float or int dtype, is cast to input's dtype first).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype), _one_element(rng, dtype)),
                  attrs={"scale_down": 1}, grad=(0, 1)))


def _scaled_sum_check(input0, input1, input2, *, scale_0, scale_1, scale_2):
    xs = {k: x for k, x in (("input0", input0), ("input1", input1), ("input2", input2))
          if x is not None}
    rules.same_dtype(**xs)
    rules.same_shape(**xs)


scaled_sum = define(
    "scaled_sum", ort=(_MS, "ScaledSum"), inputs=("input0: float", "input1: float", "input2?: float"),
    outputs=("output",), attrs={"scale_0": REQUIRED, "scale_1": REQUIRED, "scale_2": 1.0},
    check=_scaled_sum_check, reference=ref.scaled_sum,
    doc="""ORT ScaledSum: scale_0*input0 + scale_1*input1 (+ scale_2*input2), inputs of one
    shape and dtype.""",
    matrix=Matrix(lambda rng, shape, dtype: tuple(_normal(rng, shape, dtype) for _ in range(3)),
                  attrs={"scale_0": 0.5, "scale_1": -2.0, "scale_2": 3.0}, grad=(0, 1, 2)))

batch_scale = define(
    "batch_scale", ort=(_MS, "BatchScale"), inputs=("input: float",),
    outputs=("output_0", "output_1", "output_2"),
    attrs={"scale_0": REQUIRED, "scale_1": REQUIRED, "scale_2": None},
    reference=ref.batch_scale,
    doc="""ORT BatchScale: (input*scale_0, input*scale_1[, input*scale_2]).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),),
                  attrs={"scale_0": 0.5, "scale_1": 3.0, "scale_2": -1.0}, grad=(0,)))
