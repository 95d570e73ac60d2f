"""Quantization-aware training (com.microsoft): FakeQuant. Its gradient op FakeQuantGrad lives
with the elementwise gradients (jaxops.ops.activation) and is FakeQuant's backward here.

XLA code, not an FFI kernel: elementwise, so XLA fuses it with its neighbours; jit, vmap (any
in_axes) and sharding need no extra rules. Its spec has no kernel: `JAXOPS_DISABLE` changes
nothing.
"""
import functools
import operator

import jax
import jax.numpy as jnp

from jaxops._src import rules
from jaxops._src.spec import Matrix, define
from jaxops.ops.activation import fake_quant_grad


def _fake_quant(x, scale, zero_point, quant_min, quant_max):
    t = rules.compute_dtype(x.dtype)
    s, zp = scale.reshape(()).astype(t), zero_point.reshape(()).astype(t)
    q = jnp.round(x.astype(t) / s) + zp  # jnp.round: half to even, as nearbyint
    lo, hi = jnp.asarray(quant_min, t), jnp.asarray(quant_max, t)
    mask = (q >= lo) & (q <= hi)  # False for NaN
    clamped = jnp.where(q > hi, hi, jnp.where(q >= lo, q, lo))  # NaN -> quant_min, as fmaxf
    return ((clamped - zp) * s).astype(x.dtype), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fake_quant_ste(x, scale, zero_point, quant_min, quant_max):
    return _fake_quant(x, scale, zero_point, quant_min, quant_max)


def _fwd(x, scale, zero_point, quant_min, quant_max):
    out, mask = _fake_quant(x, scale, zero_point, quant_min, quant_max)
    return (out, mask), (mask, jnp.zeros_like(scale), jnp.zeros_like(zero_point))


def _bwd(quant_min, quant_max, saved, cotangents):
    mask, d_scale, d_zero_point = saved
    d_out, _ = cotangents  # the bool mask output has no cotangent to pass on
    return fake_quant_grad(d_out, mask), d_scale, d_zero_point


_fake_quant_ste.defvjp(_fwd, _bwd)


def _check(input_tensor, scale, zero_point, *, quant_min, quant_max):
    rules.same_dtype(input_tensor=input_tensor, scale=scale, zero_point=zero_point)
    for label, a in (("scale", scale), ("zero_point", zero_point)):
        if a.size != 1 or a.ndim > 1:
            raise ValueError(f"{label} must be a scalar or a 1-element 1-D tensor, "
                             f"got shape {a.shape}")
    lo, hi = rules.integer("quant_min", quant_min), rules.integer("quant_max", quant_max)
    if lo > hi:
        raise ValueError(f"quant_min ({lo}) must not exceed quant_max ({hi})")


def _reference(input_tensor, scale, zero_point, *, quant_min, quant_max):
    return _fake_quant_ste(input_tensor, scale, zero_point, operator.index(quant_min),
                           operator.index(quant_max))


def _inputs(rng, shape, dtype):
    """x, a power-of-two scale (exact quotients: XLA:CPU divides through a reciprocal, which
    could move a near-tie between jit and eager) and an integral zero_point, both [1]."""
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    scale = jnp.asarray([rng.choice([0.125, 0.25, 0.5])], dtype)
    return x, scale, jnp.asarray([float(rng.integers(-3, 4))], dtype)


fake_quant = define(
    "fake_quant", ort=("com.microsoft", "FakeQuant"),
    inputs=("input_tensor: float", "scale: float", "zero_point: float"),
    outputs=("fake_quantized_tensor", "quantization_mask"),
    attrs={"quant_min": 0, "quant_max": 255}, check=_check, reference=_reference,
    doc="""ORT FakeQuant (per tensor): q = nearbyint(input_tensor / scale) + zero_point (rounding
    half to even before adding zero_point); returns (fake_quantized, quantization_mask) with
        fake_quantized = (clamp(q, quant_min, quant_max) - zero_point) * scale,
        quantization_mask = quant_min <= q <= quant_max.
    scale and zero_point hold one element each (shape [] or [1]). Computed in the input's
    float type as ORT's CUDA kernel does (ORT registers float32; float16/bfloat16 compute in
    float32, float64 in float64). NaN gives quant_min's value with mask False, +-inf the nearer
    bound's with mask False. This is ORT's CUDA kernel; ORT 1.19.2's CPU kernel (the oracle)
    agrees for finite inputs and an integral zero_point, but truncates a fractional zero_point
    to an integer and maps +-inf (any |q| >= 2^63) to quant_min. A zero scale is not checked
    (ORT's CPU kernel raises; its CUDA kernel does not): it gives inf/NaN. XLA:CPU divides
    through a reciprocal, which may be an ulp off the correctly rounded x / scale, so a value
    within an ulp of a rounding tie may round the other way than ORT's kernels round it.

    Differentiable through the straight-through estimator, as ORT's gradient: d input_tensor =
    FakeQuantGrad(d fake_quantized, quantization_mask); scale and zero_point get zero gradients
    (ORT gives them none).""",
    # the forward is a staircase: its straight-through gradient is no finite difference of it
    # (tests/test_fake_quant.py checks the gradient map itself to order 2)
    matrix=Matrix(_inputs, attrs={"quant_min": -10, "quant_max": 10}))

__all__ = ["fake_quant"]
