"""Elementwise activation gradients (com.microsoft): ReluGrad, SigmoidGrad, TanhGrad,
GeluGrad, FastGeluGrad, QuickGeluGrad, LeakyReluGrad, BiasGeluGrad_dX, BiasFastGeluGrad_dX,
FakeQuantGrad, DivGrad; and SinGrad (ONNX domain, ORT-private) with its cosine counterpart.

These are plain XLA code, not FFI kernels: XLA fuses an elementwise gradient into the
surrounding backward pass, and a kernel would be a fusion barrier (bench/activation.py times
a jitted MLP backward both ways). Being jnp code, every op supports jit, vmap (any in_axes),
gradients of any order and sharding (elementwise: no communication) with no extra rules.
Because the ops *are* their XLA lowering, `JAXOPS_DISABLE` does not apply to them; the
independent definitions in `jaxops.reference.activation` (autodiff of the forward ops) are
the test oracle.

Which input is which follows ORT's gradient builders: ReluGrad, GeluGrad, FastGeluGrad,
QuickGeluGrad, SinGrad and the Bias* ops take the forward INPUT X; SigmoidGrad, TanhGrad and
LeakyReluGrad take the forward OUTPUT Y. f16/bf16 are computed in f32 and rounded once.
"""
import math

import jax
import jax.numpy as jnp
from jax.scipy.special import erf

from jaxops.ops import _validate as v

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_FAST_GELU_GAMMA = 0.044715


def _unary(op, dY, other, other_name):
    dY, other = jnp.asarray(dY), jnp.asarray(other)
    dtype = v.floats(op, dY=dY, **{other_name: other})
    v.same_shape(op, dY=dY, **{other_name: other})
    t = v.compute_dtype(dtype)
    return dY.astype(t), other.astype(t), dtype


def _gelu_slope(x):
    # d/dx [x * Phi(x)] = Phi(x) + x * phi(x)
    cdf = 0.5 * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def _fast_gelu_slope(x):
    # t = tanh(u), u = a (x + g x^3); slope = 0.5 (1 + t) + 0.5 (1 - t^2) a x (1 + 3 g x^2).
    # Written with s = 0.5 (1 + t) = sigmoid(2u) and 0.5 (1 - t) = sigmoid(-2u), so that
    # neither 1 + t nor 1 - t^2 cancels: ~1 ulp of the result where the tanh form lost ~30.
    x2 = x * x
    u2 = 2.0 * _SQRT_2_OVER_PI * x * (1.0 + _FAST_GELU_GAMMA * x2)
    s, s_neg = jax.nn.sigmoid(u2), jax.nn.sigmoid(-u2)
    return s + 2.0 * s * s_neg * (_SQRT_2_OVER_PI * x * (1.0 + 3.0 * _FAST_GELU_GAMMA * x2))


def relu_grad(dY, X):
    """ORT ReluGrad: dX = dY where X > 0, else 0 (strictly greater: 0 at X == 0).

    X is the Relu INPUT, as ORT's gradient builder passes it."""
    dY, X = jnp.asarray(dY), jnp.asarray(X)
    v.floats("relu_grad", dY=dY, X=X)
    v.same_shape("relu_grad", dY=dY, X=X)
    return jnp.where(X > 0, dY, jnp.zeros((), dY.dtype))


def sigmoid_grad(dY, Y):
    """ORT SigmoidGrad: dX = dY * Y * (1 - Y), Y the Sigmoid OUTPUT."""
    dy, y, dtype = _unary("sigmoid_grad", dY, Y, "Y")
    return (dy * y * (1.0 - y)).astype(dtype)


def tanh_grad(dY, Y):
    """ORT TanhGrad: dX = dY * (1 - Y^2), Y the Tanh OUTPUT."""
    dy, y, dtype = _unary("tanh_grad", dY, Y, "Y")
    return (dy * (1.0 - y * y)).astype(dtype)


def gelu_grad(dY, X):
    """ORT GeluGrad (exact erf Gelu): dX = dY * (Phi(X) + X * phi(X)), X the Gelu INPUT."""
    dy, x, dtype = _unary("gelu_grad", dY, X, "X")
    return (dy * _gelu_slope(x)).astype(dtype)


def fast_gelu_grad(dY, X):
    """ORT FastGeluGrad (tanh approximation, FastGelu without bias), X the FastGelu INPUT:
    t = tanh(a (X + 0.044715 X^3)), a = sqrt(2/pi);
    dX = dY * 0.5 * (1 + t + (1 - t^2) (a X + 3 * 0.044715 a X^3))."""
    dy, x, dtype = _unary("fast_gelu_grad", dY, X, "X")
    return (dy * _fast_gelu_slope(x)).astype(dtype)


def quick_gelu_grad(dY, X, alpha=1.702):
    """ORT QuickGeluGrad: s = sigmoid(alpha X); dX = dY * s * (1 + alpha X (1 - s))."""
    v.number("quick_gelu_grad", "alpha", alpha)
    dy, x, dtype = _unary("quick_gelu_grad", dY, X, "X")
    ax = x * jnp.asarray(alpha, x.dtype)
    s = 1.0 / (1.0 + jnp.exp(-ax))
    return (dy * s * (1.0 + ax * (1.0 - s))).astype(dtype)


def leaky_relu_grad(dY, Y, alpha=0.01):
    """ORT LeakyReluGrad: dX = dY where Y > 0, else alpha * dY (Y the LeakyRelu OUTPUT, of X's
    sign; at Y == 0 the slope is alpha, as ORT computes it)."""
    v.number("leaky_relu_grad", "alpha", alpha)
    dy, y, dtype = _unary("leaky_relu_grad", dY, Y, "Y")
    return jnp.where(y > 0, dy, dy * jnp.asarray(alpha, dy.dtype)).astype(dtype)


def sin_grad(dY, X):
    """ORT SinGrad (ONNX domain, since 9): dX = dY * cos(X), X the Sin INPUT."""
    dy, x, dtype = _unary("sin_grad", dY, X, "X")
    return (dy * jnp.cos(x)).astype(dtype)


def cos_grad(dY, X):
    """dX = -dY * sin(X), X the Cos INPUT. ORT has no CosGrad node (its gradient builder
    writes Sin, Mul and Neg), so this is not in ORT_OPS."""
    dy, x, dtype = _unary("cos_grad", dY, X, "X")
    return (-dy * jnp.sin(x)).astype(dtype)


def _biased(op, dY, X, B):
    dY, X, B = jnp.asarray(dY), jnp.asarray(X), jnp.asarray(B)
    dtype = v.floats(op, dY=dY, X=X, B=B)
    v.same_shape(op, dY=dY, X=X)
    if X.ndim == 0 or B.shape != X.shape[-1:]:
        v.fail(op, ValueError, f"B must be 1-D with X's last dim, got B {B.shape} for X {X.shape}")
    t = v.compute_dtype(dtype)
    return dY.astype(t), X.astype(t) + B.astype(t), dtype


def bias_gelu_grad_dx(dY, X, B):
    """ORT BiasGeluGrad_dX: GeluGrad(dY, X + B), B a bias over X's last dim. (The builder takes
    the bias gradient as an ONNX ReduceSum of this dX over the leading dims.)"""
    dy, xb, dtype = _biased("bias_gelu_grad_dx", dY, X, B)
    return (dy * _gelu_slope(xb)).astype(dtype)


def bias_fast_gelu_grad_dx(dY, X, B):
    """ORT BiasFastGeluGrad_dX: FastGeluGrad(dY, X + B), B a bias over X's last dim."""
    dy, xb, dtype = _biased("bias_fast_gelu_grad_dx", dY, X, B)
    return (dy * _fast_gelu_slope(xb)).astype(dtype)


def fake_quant_grad(dY, gradient_mask):
    """ORT FakeQuantGrad (straight-through estimator): dX = dY where gradient_mask, else 0.
    gradient_mask is FakeQuant's bool `mask` output. (ORT registers float32 only; the other
    float dtypes are accepted here too.)"""
    dY, mask = jnp.asarray(dY), jnp.asarray(gradient_mask)
    v.floats("fake_quant_grad", dY=dY)
    v.boolean("fake_quant_grad", "gradient_mask", mask)
    v.same_shape("fake_quant_grad", dY=dY, gradient_mask=mask)
    return jnp.where(mask, dY, jnp.zeros((), dY.dtype))


def _sum_to(x, shape):
    """Sums x over the axes numpy broadcasting added or stretched to reach x.shape from
    `shape` (ORT's BroadcastGradientArgs + ReduceSum + Reshape)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes, keepdims=False).reshape(shape) if axes else x.reshape(shape)


def div_grad(dY, A, B, *, outputs=(True, True)):
    """ORT DivGrad, the gradient of C = A / B with numpy broadcasting:
    dA = sum_to(dY / B, A.shape), dB = sum_to(-dY * A / (B * B), B.shape), each summed over
    the axes broadcasting added to or stretched in that input.

    Both outputs are optional in ORT; `outputs` (one bool per output, ORT order) says which
    are wanted, and an unwanted one comes back as None and is never computed. (ORT's gradient
    builder emits DivGrad only when both A and B need gradients.) ORT has no CPU kernel for
    DivGrad; it inlines this same function body.
    """
    op = "div_grad"
    dY, A, B = jnp.asarray(dY), jnp.asarray(A), jnp.asarray(B)
    dtype = v.floats(op, dY=dY, A=A, B=B)
    want_a, want_b = v.outputs(op, outputs, 2)
    try:
        full = jnp.broadcast_shapes(A.shape, B.shape)
    except ValueError:
        v.fail(op, ValueError, f"A {A.shape} and B {B.shape} do not broadcast")
    if tuple(dY.shape) != tuple(full):
        v.fail(op, ValueError, f"dY must have the broadcast shape {tuple(full)}, got {dY.shape}")
    t = v.compute_dtype(dtype)
    dy, a, b = dY.astype(t), A.astype(t), B.astype(t)
    dA = _sum_to(dy / b, A.shape).astype(dtype) if want_a else None
    dB = _sum_to(-dy * a / (b * b), B.shape).astype(dtype) if want_b else None
    return dA, dB


__all__ = ["bias_fast_gelu_grad_dx", "bias_gelu_grad_dx", "cos_grad", "div_grad",
           "fake_quant_grad", "fast_gelu_grad", "gelu_grad", "leaky_relu_grad", "quick_gelu_grad",
           "relu_grad", "sigmoid_grad", "sin_grad", "tanh_grad"]

_MS = "com.microsoft"
ORT_OPS = {
    (_MS, "ReluGrad"): relu_grad,
    (_MS, "SigmoidGrad"): sigmoid_grad,
    (_MS, "TanhGrad"): tanh_grad,
    (_MS, "GeluGrad"): gelu_grad,
    (_MS, "FastGeluGrad"): fast_gelu_grad,
    (_MS, "QuickGeluGrad"): quick_gelu_grad,
    (_MS, "LeakyReluGrad"): leaky_relu_grad,
    (_MS, "BiasGeluGrad_dX"): bias_gelu_grad_dx,
    (_MS, "BiasFastGeluGrad_dX"): bias_fast_gelu_grad_dx,
    (_MS, "FakeQuantGrad"): fake_quant_grad,
    (_MS, "DivGrad"): div_grad,
    ("", "SinGrad"): sin_grad,  # ONNX domain, ORT-private (since 9)
}
