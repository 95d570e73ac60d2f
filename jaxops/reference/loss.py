"""Pure-JAX softmax cross-entropy losses: the test oracle and the JAXOPS_DISABLE fallback.

ORT-level references (`softmax_cross_entropy_loss`, ...) are written directly over ORT's
layouts; `rows_*` are the references of the row kernels the ops are built from (loss.h).
f16/bf16 are computed in f32 and rounded once at the end, as the kernels do.

A label outside [0, C) that is not ignore_index has no defined ORT meaning (ORT 1.19.2 CPU
reads out of bounds): jaxops gives its row a NaN loss and NaN gradient, so a mean over the
batch is NaN too, and never reads outside the logits.
"""
import jax
import jax.numpy as jnp


def acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# ---------------------------------------------------------------------------------------
# row kernels: x [R, C], labels int32 [R]

def rows_forward(x, labels):
    """(nll [R], lse [R]) in the accumulation dtype; nll = 0 where the label is out of range."""
    a = x.astype(acc_dtype(x.dtype))
    lse = jax.nn.logsumexp(a, axis=-1)
    c = x.shape[-1]
    ok = (labels >= 0) & (labels < c)
    picked = jnp.take_along_axis(a, jnp.clip(labels, 0, max(c - 1, 0))[:, None], axis=-1)[:, 0]
    return jnp.where(ok, lse - picked, 0), lse


ONNX_FLOATS = {1: jnp.float32, 10: jnp.float16, 11: jnp.float64, 16: jnp.bfloat16}


def rows_forward_log_prob(x, labels, out_type):
    """(nll, lse, log_prob); out_type is log_prob's ONNX type code."""
    out_dtype = ONNX_FLOATS[int(out_type)]
    nll, lse = rows_forward(x, labels)
    a = x.astype(acc_dtype(x.dtype))
    return nll, lse, (a - lse[:, None]).astype(out_dtype)


def rows_grad(g, x, lse, labels, out_type):
    """d = g * (exp(x - lse) - onehot(label)), rows; x the logits, or log_prob with lse = 0.
    out_type: d's ONNX type code."""
    out_dtype = ONNX_FLOATS[int(out_type)]
    a = x.astype(acc_dtype(x.dtype))
    onehot = jnp.arange(x.shape[-1]) == labels[:, None]
    return (g[:, None] * (jnp.exp(a - lse[:, None]) - onehot)).astype(out_dtype)


def rows_jvp(t, x, lse, labels):
    """The nll's tangent per row, sum((exp(x - lse) - onehot(label)) * t) in the accumulation
    dtype: linear in t, and rows_grad is its transpose. A row without a target (label -1)
    gets lse's tangent: its caller masks that row's loss."""
    a = x.astype(acc_dtype(x.dtype))
    onehot = jnp.arange(x.shape[-1]) == labels[:, None]
    return jnp.sum((jnp.exp(a - lse[:, None]) - onehot) * t.astype(a.dtype), axis=-1)


def rows_grad_bias(g, x, lse, labels, bias, out_type):
    out_dtype = ONNX_FLOATS[int(out_type)]
    a = x.astype(acc_dtype(x.dtype))
    onehot = jnp.arange(x.shape[-1]) == labels[:, None]
    d = g[:, None] * (jnp.exp(a - lse[:, None]) - onehot) + bias.astype(a.dtype)
    return d.astype(out_dtype)


# ---------------------------------------------------------------------------------------
# ORT ops

def class_weights(labels, c, weights, ignore_index, dtype):
    """Per-sample weight w[l_i]: 0 for ignored samples, NaN for out-of-range labels."""
    if ignore_index is None:
        ignored = jnp.zeros(labels.shape, bool)
    else:
        ignored = labels == ignore_index
    ok = (labels >= 0) & (labels < c)
    lc = jnp.clip(labels, 0, max(c - 1, 0))
    w = jnp.ones(labels.shape, dtype) if weights is None else weights.astype(dtype)[lc]
    return jnp.where(ignored, 0, jnp.where(ok, w, jnp.nan)), ignored, lc


def reduce_loss(loss, w, reduction):
    """none / sum / mean; mean divides by the weight sum and is 0 when that is 0 (ORT)."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    den = jnp.sum(w)
    return jnp.where(den == 0, 0, jnp.sum(loss) / jnp.where(den == 0, 1, den))


def grad_scale(dY, w, ignored, reduction):
    """g_i of SoftmaxCrossEntropyLossGrad: dY * w_i (/ the weight sum for mean), 0 if ignored."""
    dy = dY.astype(w.dtype)
    if reduction == "mean":
        den = jnp.sum(w)
        g = jnp.where(den == 0, 0, dy * w / jnp.where(den == 0, 1, den))
    else:
        g = dy * w
    return jnp.where(ignored, 0, g)


def softmax_cross_entropy_loss(scores, labels, weights=None, *, reduction="mean",
                               ignore_index=None, output_type=None):
    """ONNX SoftmaxCrossEntropyLoss over class axis 1 -> (loss, log_prob)."""
    out = output_type or scores.dtype
    t = acc_dtype(scores.dtype)
    lp = jax.nn.log_softmax(scores.astype(t), axis=1)
    w, ignored, lc = class_weights(labels, scores.shape[1], weights, ignore_index, t)
    picked = jnp.squeeze(jnp.take_along_axis(lp, jnp.expand_dims(lc, 1), axis=1), 1)
    y = reduce_loss(jnp.where(ignored, 0, -w * picked), w, reduction)
    return y.astype(out), lp.astype(out)


def softmax_cross_entropy_loss_grad(dY, log_prob, label, weight=None, *, reduction="mean",
                                    ignore_index=None, bias=None, output_type=None):
    """SoftmaxCrossEntropyLossGrad(+Internal): d = g_i * (exp(log_prob) - onehot) (+ bias)."""
    out = output_type or log_prob.dtype
    t = acc_dtype(log_prob.dtype)
    c = log_prob.shape[1]
    w, ignored, lc = class_weights(label, c, weight, ignore_index, t)
    g = grad_scale(dY, w, ignored, reduction)
    onehot = jnp.expand_dims(label, 1) == jnp.arange(c).reshape((1, c) + (1,) * (label.ndim - 1))
    d = jnp.expand_dims(g, 1) * (jnp.exp(log_prob.astype(t)) - onehot)
    if bias is not None:
        d = d + bias.astype(t)
    return d.astype(out)


def sparse_softmax_cross_entropy(logits, label, weight=None, *, reduction="mean"):
    """SparseSoftmaxCrossEntropy over the last axis; weight is per sample -> (Y, log_prob)."""
    t = acc_dtype(logits.dtype)
    c = logits.shape[-1]
    lp = jax.nn.log_softmax(logits.astype(t), axis=-1)
    ok = (label >= 0) & (label < c)
    picked = jnp.take_along_axis(lp, jnp.clip(label, 0, max(c - 1, 0))[..., None], -1)[..., 0]
    nll = jnp.where(ok, -picked, jnp.nan)
    w = jnp.ones(label.shape, t) if weight is None else weight.astype(t)
    loss = w * nll
    if reduction == "none":
        y = loss
    elif reduction == "sum":
        y = jnp.sum(loss)
    else:
        y = jnp.sum(loss) / jnp.sum(w)
    return y.astype(logits.dtype), lp.astype(logits.dtype)


def sparse_softmax_cross_entropy_grad(dY, log_prob, label, weight=None, *, reduction="mean"):
    t = acc_dtype(log_prob.dtype)
    c = log_prob.shape[-1]
    ok = (label >= 0) & (label < c)
    w = jnp.ones(label.shape, t) if weight is None else weight.astype(t)
    g = dY.astype(t) * jnp.where(ok, w, jnp.nan)
    if reduction == "mean":
        g = g / jnp.sum(w)
    onehot = label[..., None] == jnp.arange(c)
    return (g[..., None] * (jnp.exp(log_prob.astype(t)) - onehot)).astype(log_prob.dtype)


def softmax_cross_entropy(logits, label, *, reduction="mean"):
    """com.microsoft SoftmaxCrossEntropy (soft labels, last axis) -> (Y, log_prob)."""
    t = acc_dtype(logits.dtype)
    lp = jax.nn.log_softmax(logits.astype(t), axis=-1)
    loss = -jnp.sum(label.astype(t) * lp, axis=-1)
    if reduction == "none":
        y = loss
    elif reduction == "sum":
        y = jnp.sum(loss)
    else:
        y = jnp.sum(loss) / max(loss.size, 1)
    return y.astype(logits.dtype), lp.astype(logits.dtype)


def softmax_cross_entropy_grad(dY, log_prob, label, *, reduction="mean"):
    t = acc_dtype(log_prob.dtype)
    g = dY.astype(t)
    if reduction == "none":
        g = g[..., None]
    elif reduction == "mean":
        g = g / max(log_prob.size // max(log_prob.shape[-1], 1), 1)
    return (g * (jnp.exp(log_prob.astype(t)) - label.astype(t))).astype(log_prob.dtype)


def cross_entropy(logits, labels, weights=None, ignore_index=None, reduction="mean"):
    """jaxops.nn.cross_entropy: logits [..., C], labels [...], SoftmaxCrossEntropyLoss rules."""
    c = logits.shape[-1]
    loss, _ = softmax_cross_entropy_loss(logits.reshape(-1, c), labels.reshape(-1), weights,
                                         reduction=reduction, ignore_index=ignore_index)
    return loss.reshape(labels.shape) if reduction == "none" else loss
