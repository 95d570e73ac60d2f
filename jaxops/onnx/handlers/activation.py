"""Activations and the softmax family (opset < 13 softmax flattens to 2-D at `axis`)."""
from __future__ import annotations

import math

import numpy as np
import jax
import jax.numpy as jnp
from jax.scipy.special import erf

from jaxops._src import rules

from ..registry import handler


def _c(v, x):
    """A Python float attribute as a constant of x's dtype (keeps f16/f64 exact)."""
    return jnp.asarray(v, x.dtype)


@handler("Relu")
def relu(ctx, x, **_legacy):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@handler("LeakyRelu")
def leaky_relu(ctx, x, *, alpha=0.01, **_legacy):
    return jnp.where(x >= 0, x, x * _c(alpha, x))


@handler("PRelu")
def prelu(ctx, x, slope, **_legacy):
    return jnp.where(x >= 0, x, x * slope)


@handler("Elu")
def elu(ctx, x, *, alpha=1.0, **_legacy):
    return jnp.where(x > 0, x, _c(alpha, x) * jnp.expm1(x))


@handler("Celu", since=12)
def celu(ctx, x, *, alpha=1.0):
    a = _c(alpha, x)
    return jnp.maximum(x, 0) + jnp.minimum(0, a * jnp.expm1(x / a))


@handler("Selu")
def selu(ctx, x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875, **_legacy):
    return _c(gamma, x) * jnp.where(x > 0, x, _c(alpha, x) * jnp.expm1(x))


@handler("Sigmoid")
def sigmoid(ctx, x, **_legacy):
    if x.dtype == jnp.float32:
        # XLA:CPU's logistic divides per element: EfficientNet's forward spent ~15% of its
        # time there. The tanh form has no divide and ORT's own (MLAS, 0.5 + a rational
        # function) error: within ~6e-8 absolute, not relative, for large negative x. Other
        # platforms keep the exact logistic.
        return jax.lax.platform_dependent(x, cpu=lambda x: 0.5 * jnp.tanh(0.5 * x) + 0.5,
                                          default=jax.nn.sigmoid)
    return jax.nn.sigmoid(x)


@handler("HardSigmoid")
def hard_sigmoid(ctx, x, *, alpha=0.2, beta=0.5, **_legacy):
    return jnp.clip(_c(alpha, x) * x + _c(beta, x), 0, 1).astype(x.dtype)


@handler("HardSwish", since=14)
def hard_swish(ctx, x):
    # alpha = 1/6 as the spec writes it: a multiply (x / 6 divides per element)
    return x * jnp.clip(x * _c(1 / 6, x) + _c(0.5, x), 0, 1).astype(x.dtype)


@handler("Softplus")
def softplus(ctx, x):
    return jax.nn.softplus(x)


@handler("Softsign")
def softsign(ctx, x):
    return x / (1 + jnp.abs(x))


@handler("ThresholdedRelu", since=10)
def thresholded_relu(ctx, x, *, alpha=1.0):
    return jnp.where(x > _c(alpha, x), x, jnp.zeros((), x.dtype))


@handler("Shrink", since=9)
def shrink(ctx, x, *, bias=0.0, lambd=0.5):
    b, l = _c(bias, x), _c(lambd, x)
    return jnp.where(x < -l, x + b, jnp.where(x > l, x - b, jnp.zeros((), x.dtype)))


@handler("Mish", since=18)
def mish(ctx, x):
    return x * jnp.tanh(jax.nn.softplus(x))


@handler("Swish", since=24)
def swish(ctx, x, *, alpha=1.0):
    return x * jax.nn.sigmoid(_c(alpha, x) * x)


def erf_gelu(x):
    """Gelu in ORT's form, 0.5 x (1 + erf(x / sqrt(2))) (float32 for narrower floats; for
    x < -3 within 2 eps |x| of ORT's, whose erf rounds otherwise in the tail).
    jax.nn.gelu's erfc form cost XLA:CPU three more fusions a Gelu: with it whisper_ts's
    train step took 1.08x the time (bert_ts 1.04x), its eval 0.98-0.99x (one core, A/B
    interleaved, 2026-11-29)."""
    y = x.astype(rules.compute_dtype(x.dtype))
    return (0.5 * y * (erf(y * (1 / math.sqrt(2))) + 1)).astype(x.dtype)


@handler("Gelu", since=20)
def gelu(ctx, x, *, approximate="none"):
    if approximate == "tanh":
        return jax.nn.gelu(x, approximate=True).astype(x.dtype)
    return erf_gelu(x)


@handler("SwiGLU", since=25)
def swiglu(ctx, a, b, *, alpha=1.0):
    return (a * jax.nn.sigmoid(_c(alpha, a) * a) * b).astype(a.dtype)


def _flat2d(fn):
    """Opset < 13 softmax semantics: coerce to 2-D [prod(shape[:axis]), prod(shape[axis:])]."""
    def run(x, axis):
        axis = axis + x.ndim if axis < 0 else axis
        lead = int(np.prod(x.shape[:axis]))
        return fn(x.reshape(lead, -1), 1).reshape(x.shape)
    return run


def _softmax(x, axis):
    return jax.nn.softmax(x, axis=axis)


def _log_softmax(x, axis):
    return jax.nn.log_softmax(x, axis=axis)


def _hardmax(x, axis):
    idx = jnp.argmax(x, axis=axis, keepdims=True)
    pos = jnp.arange(x.shape[axis]).reshape([-1 if d == (axis % x.ndim) else 1 for d in range(x.ndim)])
    return (pos == idx).astype(x.dtype)


for _name, _fn in [("Softmax", _softmax), ("LogSoftmax", _log_softmax), ("Hardmax", _hardmax)]:
    def _make(fn):
        old = _flat2d(fn)
        return (lambda ctx, x, *, axis=1: old(x, axis)), (lambda ctx, x, *, axis=-1: fn(x, axis))
    _old, _new = _make(_fn)
    handler(_name, since=1)(_old)
    handler(_name, since=13)(_new)
