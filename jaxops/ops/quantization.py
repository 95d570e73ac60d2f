"""Quantization-aware training (com.microsoft): FakeQuant. Its gradient op FakeQuantGrad lives
with the elementwise gradients (jaxops.ops.activation) and is FakeQuant's backward here.

XLA code, not an FFI kernel: elementwise, so XLA fuses it with its neighbours; jit, vmap (any
in_axes) and sharding need no extra rules. `JAXOPS_DISABLE` does not apply.
"""
import functools

import jax
import jax.numpy as jnp

from jaxops.ops import _validate as v
from jaxops.ops.activation import fake_quant_grad


def _fake_quant(x, scale, zero_point, quant_min, quant_max):
    t = v.compute_dtype(x.dtype)
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


def fake_quant(input_tensor, scale, zero_point, *, quant_min=0, quant_max=255):
    """ORT FakeQuant (per tensor): q = nearbyint(input_tensor / scale) + zero_point (rounding
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
    (ORT gives them none)."""
    op = "fake_quant"
    x, scale, zp = (jnp.asarray(a) for a in (input_tensor, scale, zero_point))
    v.floats(op, input_tensor=x, scale=scale, zero_point=zp)
    for label, a in (("scale", scale), ("zero_point", zp)):
        if a.size != 1 or a.ndim > 1:
            v.fail(op, ValueError, f"{label} must be a scalar or a 1-element 1-D tensor, "
                                   f"got shape {a.shape}")
    lo, hi = v.integer(op, "quant_min", quant_min), v.integer(op, "quant_max", quant_max)
    if lo > hi:
        v.fail(op, ValueError, f"quant_min ({lo}) must not exceed quant_max ({hi})")
    return _fake_quant_ste(x, scale, zp, lo, hi)


__all__ = ["fake_quant"]

ORT_OPS = {("com.microsoft", "FakeQuant"): fake_quant}
