"""Elementwise activation gradients (com.microsoft): ReluGrad, SigmoidGrad, TanhGrad,
GeluGrad, FastGeluGrad, QuickGeluGrad, LeakyReluGrad, BiasGeluGrad_dX, BiasFastGeluGrad_dX,
FakeQuantGrad, DivGrad; and SinGrad (ONNX domain, ORT-private) with its cosine counterpart.

These are plain XLA code, not FFI kernels: XLA fuses an elementwise gradient into the
surrounding backward pass, and a kernel would be a fusion barrier (bench/activation.py times
a jitted MLP backward both ways). Being jnp code, every op supports jit, vmap (any in_axes),
gradients of any order and sharding (elementwise: no communication) with no extra rules.
Because the ops *are* their XLA lowering, their specs have no kernel and `JAXOPS_DISABLE`
changes nothing; the independent definitions in `jaxops.reference.activation` (autodiff of
the forward ops) are the test oracle.

Which input is which follows ORT's gradient builders: ReluGrad, GeluGrad, FastGeluGrad,
QuickGeluGrad, SinGrad and the Bias* ops take the forward INPUT X; SigmoidGrad, TanhGrad and
LeakyReluGrad take the forward OUTPUT Y. f16/bf16 are computed in f32 and rounded once.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import erf

from jaxops._src import rules
from jaxops._src.spec import Matrix, define

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_FAST_GELU_GAMMA = 0.044715
_MS = "com.microsoft"


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


# ---- the (dY, X-or-Y) ops

def _check_pair(other):
    """dY and the forward input/output `other` share one dtype and shape; attributes are
    numbers."""
    def check(dY, x, **attrs):
        rules.same_dtype(dY=dY, **{other: x})
        rules.same_shape(dY=dY, **{other: x})
        for label, value in attrs.items():
            rules.number(label, value)
    return check


def _pointwise(slope):
    """slope(dY, x, **attrs), computed in f32 (f64 for f64) and rounded once."""
    def run(dY, x, **attrs):
        t = rules.compute_dtype(dY.dtype)
        return slope(dY.astype(t), x.astype(t), **attrs).astype(dY.dtype)
    return run


def _normal(rng, shape, dtype, scale=2.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _pair(forward=None):
    """Matrix inputs: dY and X (or the forward output Y = forward(X)). |X| >= 0.05 keeps
    finite differences off the relu-family kink at 0 (check_grads once straddled it: 4713
    against 0.37 for leaky_relu_grad, seed 4229017023)."""
    def make(rng, shape, dtype):
        x = rng.standard_normal(shape) * 2
        x = np.where(x < 0, -1, 1) * np.maximum(np.abs(x), 0.05)
        return _normal(rng, shape, dtype), jnp.asarray(forward(x) if forward else x, dtype)
    return make


def _unary(name, op_type, other, slope, doc, *, attrs=None, forward=None, matrix_attrs=None,
           domain=_MS, exact=False):
    """exact: slope only selects dY's elements, so it runs in dY's own dtype."""
    return define(
        name, ort=op_type and (domain, op_type), inputs=("dY: float", f"{other}: float"),
        outputs=("dX",), attrs=attrs, check=_check_pair(other),
        reference=slope if exact else _pointwise(slope),
        doc=doc, matrix=Matrix(_pair(forward), attrs=matrix_attrs or {}, grad=(0, 1)))


def _relu_slope(dy, x):
    return jnp.where(x > 0, dy, jnp.zeros((), dy.dtype))


def _quick_gelu_slope(dy, x, *, alpha):
    ax = x * jnp.asarray(alpha, x.dtype)
    s = 1.0 / (1.0 + jnp.exp(-ax))
    return dy * s * (1.0 + ax * (1.0 - s))


def _leaky_relu_slope(dy, y, *, alpha):
    return jnp.where(y > 0, dy, dy * jnp.asarray(alpha, dy.dtype))


relu_grad = _unary(
    "relu_grad", "ReluGrad", "X", _relu_slope,
    """ORT ReluGrad: dX = dY where X > 0, else 0 (strictly greater: 0 at X == 0).

    X is the Relu INPUT, as ORT's gradient builder passes it.""", exact=True)
sigmoid_grad = _unary(
    "sigmoid_grad", "SigmoidGrad", "Y", lambda dy, y: dy * y * (1.0 - y),
    """ORT SigmoidGrad: dX = dY * Y * (1 - Y), Y the Sigmoid OUTPUT.""",
    forward=lambda x: 1 / (1 + np.exp(-x)))
tanh_grad = _unary(
    "tanh_grad", "TanhGrad", "Y", lambda dy, y: dy * (1.0 - y * y),
    """ORT TanhGrad: dX = dY * (1 - Y^2), Y the Tanh OUTPUT.""", forward=np.tanh)
gelu_grad = _unary(
    "gelu_grad", "GeluGrad", "X", lambda dy, x: dy * _gelu_slope(x),
    """ORT GeluGrad (exact erf Gelu): dX = dY * (Phi(X) + X * phi(X)), X the Gelu INPUT.""")
fast_gelu_grad = _unary(
    "fast_gelu_grad", "FastGeluGrad", "X", lambda dy, x: dy * _fast_gelu_slope(x),
    """ORT FastGeluGrad (tanh approximation, FastGelu without bias), X the FastGelu INPUT:
    t = tanh(a (X + 0.044715 X^3)), a = sqrt(2/pi);
    dX = dY * 0.5 * (1 + t + (1 - t^2) (a X + 3 * 0.044715 a X^3)).""")
# the matrix rows take a non-default alpha, so the attribute's path is what they transform
quick_gelu_grad = _unary(
    "quick_gelu_grad", "QuickGeluGrad", "X", _quick_gelu_slope,
    """ORT QuickGeluGrad: s = sigmoid(alpha X); dX = dY * s * (1 + alpha X (1 - s)).""",
    attrs={"alpha": 1.702}, matrix_attrs={"alpha": 1.1})
leaky_relu_grad = _unary(
    "leaky_relu_grad", "LeakyReluGrad", "Y", _leaky_relu_slope,
    """ORT LeakyReluGrad: dX = dY where Y > 0, else alpha * dY (Y the LeakyRelu OUTPUT, of X's
    sign; at Y == 0 the slope is alpha, as ORT computes it).""",
    attrs={"alpha": 0.01}, forward=lambda x: np.where(x > 0, x, 0.01 * x),
    matrix_attrs={"alpha": 0.2})
sin_grad = _unary(
    "sin_grad", "SinGrad", "X", lambda dy, x: dy * jnp.cos(x),
    """ORT SinGrad (ONNX domain, since 9): dX = dY * cos(X), X the Sin INPUT.""", domain="")
cos_grad = _unary(
    "cos_grad", None, "X", lambda dy, x: -dy * jnp.sin(x),
    """dX = -dY * sin(X), X the Cos INPUT. ORT has no CosGrad node (its gradient builder
    writes Sin, Mul and Neg), so this is not in ORT_OPS.""")


# ---- the biased Gelu gradients

def _check_biased(dY, X, B):
    rules.same_dtype(dY=dY, X=X, B=B)
    rules.same_shape(dY=dY, X=X)
    if X.ndim == 0 or B.shape != X.shape[-1:]:
        raise ValueError(f"B must be 1-D with X's last dim, got B {B.shape} for X {X.shape}")


def _biased(slope):
    def run(dY, X, B):
        t = rules.compute_dtype(dY.dtype)
        return (dY.astype(t) * slope(X.astype(t) + B.astype(t))).astype(dY.dtype)
    return run


def _biased_inputs(rng, shape, dtype):
    return tuple(_normal(rng, s, dtype) for s in (shape, shape, shape[-1:]))


def _bias_op(name, op_type, slope, doc):
    return define(
        name, ort=(_MS, op_type), inputs=("dY: float", "X: float", "B: float"),
        outputs=("dX",), check=_check_biased, reference=_biased(slope), doc=doc,
        matrix=Matrix(_biased_inputs, grad=(0, 1, 2)))


bias_gelu_grad_dx = _bias_op(
    "bias_gelu_grad_dx", "BiasGeluGrad_dX", _gelu_slope,
    """ORT BiasGeluGrad_dX: GeluGrad(dY, X + B), B a bias over X's last dim. (The builder takes
    the bias gradient as an ONNX ReduceSum of this dX over the leading dims.)""")
bias_fast_gelu_grad_dx = _bias_op(
    "bias_fast_gelu_grad_dx", "BiasFastGeluGrad_dX", _fast_gelu_slope,
    """ORT BiasFastGeluGrad_dX: FastGeluGrad(dY, X + B), B a bias over X's last dim.""")


# ---- FakeQuantGrad

def _mask_inputs(rng, shape, dtype):
    return _normal(rng, shape, dtype), jnp.asarray(rng.random(shape) > 0.5)


fake_quant_grad = define(
    "fake_quant_grad", ort=(_MS, "FakeQuantGrad"), inputs=("dY: float", "gradient_mask: bool"),
    outputs=("dX",), check=lambda dY, mask: rules.same_shape(dY=dY, gradient_mask=mask),
    reference=lambda dY, mask: jnp.where(mask, dY, jnp.zeros((), dY.dtype)),
    doc="""ORT FakeQuantGrad (straight-through estimator): dX = dY where gradient_mask, else 0.
    gradient_mask is FakeQuant's bool `mask` output. (ORT registers float32 only; the other
    float dtypes are accepted here too.)""",
    matrix=Matrix(_mask_inputs, grad=(0,)))


# ---- DivGrad

def _sum_to(x, shape):
    """Sums x over the axes numpy broadcasting added or stretched to reach x.shape from
    `shape` (ORT's BroadcastGradientArgs + ReduceSum + Reshape)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes, keepdims=False).reshape(shape) if axes else x.reshape(shape)


def _check_div(dY, A, B, *, outputs):
    rules.same_dtype(dY=dY, A=A, B=B)
    rules.outputs(outputs, 2)
    try:
        full = jnp.broadcast_shapes(A.shape, B.shape)
    except ValueError:
        raise ValueError(f"A {A.shape} and B {B.shape} do not broadcast") from None
    if tuple(dY.shape) != tuple(full):
        raise ValueError(f"dY must have the broadcast shape {tuple(full)}, got {dY.shape}")


def _div_grad(dY, A, B, *, outputs):
    want_a, want_b = rules.outputs(outputs, 2)
    dtype = dY.dtype
    t = rules.compute_dtype(dtype)
    dy, a, b = dY.astype(t), A.astype(t), B.astype(t)
    dA = _sum_to(dy / b, A.shape).astype(dtype) if want_a else None
    dB = _sum_to(-dy * a / (b * b), B.shape).astype(dtype) if want_b else None
    return dA, dB


def _div_inputs(rng, shape, dtype):
    """dY and A at `shape`, B over its last dim, |B| in [0.5, 1.5)."""
    b_shape = shape[-1:]
    b = (rng.random(b_shape) + 0.5) * rng.choice([-1, 1], b_shape)
    return _normal(rng, shape, dtype), _normal(rng, shape, dtype), jnp.asarray(b, dtype)


div_grad = define(
    "div_grad", ort=(_MS, "DivGrad"), inputs=("dY: float", "A: float", "B: float"),
    outputs=("dA", "dB"), options={"outputs": (True, True)}, check=_check_div,
    reference=_div_grad,
    doc="""ORT DivGrad, the gradient of C = A / B with numpy broadcasting:
    dA = sum_to(dY / B, A.shape), dB = sum_to(-dY * A / (B * B), B.shape), each summed over
    the axes broadcasting added to or stretched in that input.

    Both outputs are optional in ORT; `outputs` (one bool per output, ORT order) says which
    are wanted, and an unwanted one comes back as None and is never computed. (ORT's gradient
    builder emits DivGrad only when both A and B need gradients.) ORT has no CPU kernel for
    DivGrad; it inlines this same function body.
    """,
    # DivGrad's third derivatives grow as 1/b^4: finite differences at jax's default step were
    # 5.3e-5 off (seed 3602258262, |b| >= 0.5); a 1e-5 step keeps them within the tolerance
    matrix=Matrix(_div_inputs, grad=(0, 1, 2), eps=1e-5))


__all__ = ["bias_fast_gelu_grad_dx", "bias_gelu_grad_dx", "cos_grad", "div_grad",
           "fake_quant_grad", "fast_gelu_grad", "gelu_grad", "leaky_relu_grad", "quick_gelu_grad",
           "relu_grad", "sigmoid_grad", "sin_grad", "tanh_grad"]
