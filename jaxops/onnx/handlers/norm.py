"""Normalizations: BatchNorm, LayerNorm, RMSNorm, InstanceNorm, GroupNorm, LRN, LpNorm, MVN."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..registry import handler
from ._util import norm_axis


def _bcast(v, x):
    """A per-channel vector shaped to broadcast against NC... x."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2)) if x.ndim > 1 else v


@handler("BatchNormalization")
def batch_norm(ctx, x, scale, b, mean, var, *, epsilon=1e-5, momentum=0.9, training_mode=0,
               spatial=1, is_test=None, consumed_inputs=None):
    if training_mode:
        axes = (0,) + tuple(range(2, x.ndim))
        bmean = jnp.mean(x, axis=axes)
        bvar = jnp.var(x, axis=axes)
        y = (x - _bcast(bmean, x)) / jnp.sqrt(_bcast(bvar, x) + epsilon) * _bcast(scale, x) + _bcast(b, x)
        run_mean = mean * momentum + bmean * (1 - momentum)
        run_var = var * momentum + bvar * (1 - momentum)
        return (y.astype(x.dtype), run_mean.astype(mean.dtype), run_var.astype(var.dtype))
    # one factor a channel, as ORT computes it: a divide per element cost XLA:CPU 5-10% of a
    # small CNN's forward (RegNet's 1.58x ORT's time -> 1.40x, one core)
    k = scale / jnp.sqrt(var + epsilon)
    y = ((x - _bcast(mean, x)) * _bcast(k, x) + _bcast(b, x)).astype(x.dtype)
    return y if ctx.num_outputs == 1 else (y,) + (mean, var)[: ctx.num_outputs - 1]


def _stash(x, stash_type):
    return x.astype(jnp.float32) if stash_type == 1 and x.dtype != jnp.float64 else x


@handler("LayerNormalization", since=17)
def layer_norm(ctx, x, scale, b=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = norm_axis(axis, x.ndim)
    axes = tuple(range(axis, x.ndim))
    xs = _stash(x, stash_type)
    mean = jnp.mean(xs, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xs - mean), axis=axes, keepdims=True)
    inv = jax.lax.rsqrt(var + epsilon)
    y = ((xs - mean) * inv).astype(x.dtype) * scale
    if b is not None:
        y = y + b
    return (y, mean, inv)[: max(ctx.num_outputs, 1)] if ctx.num_outputs > 1 else y


@handler("RMSNormalization", since=23)
def rms_norm(ctx, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = norm_axis(axis, x.ndim)
    axes = tuple(range(axis, x.ndim))
    xs = _stash(x, stash_type)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xs), axis=axes, keepdims=True) + epsilon)
    return (xs * inv).astype(x.dtype) * scale


@handler("InstanceNormalization", since=6)
def instance_norm(ctx, x, scale, b, *, epsilon=1e-5):
    axes = tuple(range(2, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    return ((x - mean) / jnp.sqrt(var + epsilon) * _bcast(scale, x) + _bcast(b, x)).astype(x.dtype)


def _group_norm(x, scale, b, epsilon, num_groups, stash_type, per_channel):
    n, c = x.shape[:2]
    xs = _stash(x, stash_type)
    g = xs.reshape((n, num_groups, -1))
    mean = jnp.mean(g, axis=-1, keepdims=True)
    var = jnp.var(g, axis=-1, keepdims=True)
    y = ((g - mean) / jnp.sqrt(var + epsilon)).reshape(x.shape).astype(x.dtype)
    if not per_channel:  # opset 18: scale/bias are per group
        scale = jnp.repeat(scale, c // num_groups)
        b = jnp.repeat(b, c // num_groups)
    return y * _bcast(scale, x) + _bcast(b, x)


@handler("GroupNormalization", since=18)
def group_norm_18(ctx, x, scale, b, *, epsilon=1e-5, num_groups):
    return _group_norm(x, scale, b, epsilon, num_groups, 1, per_channel=scale.shape[0] != num_groups)


@handler("GroupNormalization", since=21)
def group_norm_21(ctx, x, scale, b, *, epsilon=1e-5, num_groups, stash_type=1):
    return _group_norm(x, scale, b, epsilon, num_groups, stash_type, per_channel=True)


@handler("LRN")
def lrn(ctx, x, *, size, alpha=1e-4, beta=0.75, bias=1.0):
    c = x.shape[1]
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    sq = jnp.square(x)
    padded = jnp.pad(sq, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))
    total = sum(padded[:, i:i + c] for i in range(size))
    return (x / (bias + alpha / size * total) ** beta).astype(x.dtype)


@handler("LpNormalization")
def lp_norm(ctx, x, *, axis=-1, p=2):
    n = jnp.sum(jnp.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p) if p != 1 else \
        jnp.sum(jnp.abs(x), axis=axis, keepdims=True)
    return jnp.where(n == 0, jnp.zeros((), x.dtype), x / jnp.where(n == 0, 1, n)).astype(x.dtype)


@handler("MeanVarianceNormalization", since=9)
def mvn(ctx, x, *, axes=(0, 2, 3)):
    axes = tuple(axes)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x), axis=axes, keepdims=True) - jnp.square(mean)
    return ((x - mean) / (jnp.sqrt(var) + 1e-9)).astype(x.dtype)


def _dropout(ctx, x, ratio, training, seed):
    mask_needed = ctx.num_outputs > 1
    if not training or ratio == 0:
        return (x, jnp.ones(x.shape, bool)) if mask_needed else x
    keep = jax.random.bernoulli(jax.random.PRNGKey(seed or 0), 1 - ratio, x.shape)
    y = jnp.where(keep, x / (1 - ratio), 0).astype(x.dtype)
    return (y, keep) if mask_needed else y


@handler("Dropout")
def dropout_1(ctx, x, *, ratio=0.5, is_test=0, consumed_inputs=None):
    return _dropout(ctx, x, ratio, 0, 0)


@handler("Dropout", since=12)
def dropout_12(ctx, x, ratio=None, training_mode=None, *, seed=None):
    r = 0.5 if ratio is None else float(ctx.static(ratio, "ratio"))
    t = False if training_mode is None else bool(ctx.static(training_mode, "training_mode"))
    return _dropout(ctx, x, r, t, seed)


def _nll(x, target, weight, ignore_index, reduction):
    """x: log-probabilities [N, C, ...], target [N, ...]."""
    c = x.shape[1]
    t = target.astype(jnp.int32)
    ignored = (t == ignore_index) if ignore_index is not None else jnp.zeros(t.shape, bool)
    safe = jnp.where(ignored, 0, t)
    picked = jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0]
    w = jnp.ones((c,), x.dtype) if weight is None else weight
    wt = jnp.where(ignored, jnp.zeros((), x.dtype), w[safe])
    loss = -picked * wt
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return (jnp.sum(loss) / jnp.sum(wt)).astype(x.dtype)


@handler("NegativeLogLikelihoodLoss", since=12)
def nll_loss(ctx, x, target, weight=None, *, ignore_index=None, reduction="mean"):
    return _nll(x, target, weight, ignore_index, reduction)


@handler("SoftmaxCrossEntropyLoss", since=12)
def softmax_ce_loss(ctx, scores, labels, weights=None, *, ignore_index=None, reduction="mean"):
    logp = jax.nn.log_softmax(scores, axis=1)
    loss = _nll(logp, labels, weights, ignore_index, reduction)
    return (loss, logp) if ctx.num_outputs > 1 else loss
