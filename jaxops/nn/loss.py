"""cross_entropy whose forward and backward are the fused softmax cross-entropy kernels.

The forward kernel reads the logits once and keeps only each row's nll and logsumexp; the
backward kernel recomputes the softmax from the logits and that logsumexp and writes d_logits
once, so log_prob never exists in memory. Higher-order derivatives differentiate the kernels'
pure-JAX references.
"""
import functools

import jax
import jax.numpy as jnp

from jaxops._src.disable import disabled
from jaxops.ops import loss as ops
from jaxops.reference import loss as ref

__all__ = ["cross_entropy"]


def cross_entropy(logits, labels, weights=None, ignore_index=None, reduction="mean"):
    """Softmax cross-entropy with integer labels, ONNX SoftmaxCrossEntropyLoss's rules.

    logits [..., C] (classes LAST), labels int [...], weights [C] per class (optional).
    A label equal to `ignore_index` adds nothing and is left out of the mean's denominator
    (the weight sum of the other samples; 0 if every sample is ignored). A label outside
    [0, C) that is not ignore_index gives a NaN loss (and NaN gradient) for its sample.
    reduction: 'mean' (default), 'sum', or 'none' (labels' shape). Differentiable in logits
    (and weights); labels are not.
    """
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    weights = None if weights is None else jnp.asarray(weights)
    ch = ops._Checks("cross_entropy")
    ch.float_array("logits", logits, 1)
    ch.labels("labels", labels, logits.shape[:-1])
    if weights is not None:
        ch.float_array("weights", weights)
        ch.shape("weights", weights, logits.shape[-1:])
    ch.reduction(reduction)
    ignore_index = ch.int_attr("ignore_index", ignore_index)
    if disabled("cross_entropy"):
        return ref.cross_entropy(logits, labels, weights, ignore_index, reduction)
    return _cross_entropy(logits, labels, weights, ignore_index, reduction)


def _prepare(logits, labels, weights, ignore_index):
    c = logits.shape[-1]
    l = labels.reshape(-1)
    w, ignored, lc = ref.class_weights(l, c, weights, ignore_index, ref.acc_dtype(logits.dtype))
    return logits.reshape(-1, c), ops._row_labels(l, c, ignored), w, ignored, lc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cross_entropy(logits, labels, weights, ignore_index, reduction):
    return _forward(logits, labels, weights, ignore_index, reduction)[0]


def _forward(logits, labels, weights, ignore_index, reduction):
    x, lab, w, ignored, lc = _prepare(logits, labels, weights, ignore_index)
    nll, lse = ops.rows_forward(x, lab)
    per_row = jnp.where(ignored, 0, w * nll)
    loss = ref.reduce_loss(per_row, w, reduction)
    loss = (loss.reshape(labels.shape) if reduction == "none" else loss).astype(logits.dtype)
    return loss, (logits, labels, weights, lse, nll)


def _fwd(logits, labels, weights, ignore_index, reduction):
    return _forward(logits, labels, weights, ignore_index, reduction)


def _bwd(ignore_index, reduction, res, ct):
    logits, labels, weights, lse, nll = res
    x, lab, w, ignored, lc = _prepare(logits, labels, weights, ignore_index)
    ct_rows = ct.reshape(-1) if reduction == "none" else ct.reshape(())
    g = ref.grad_scale(ct_rows, w, ignored, reduction)
    d = ops.rows_grad(g, x, lse, lab, out_dtype=logits.dtype).reshape(logits.shape)
    d_weights = None
    if weights is not None:
        # d loss / d w_i: ct_i * nll_i (none, sum); ct * (nll_i - loss) / sum(w) (mean)
        ct_t = ct_rows.astype(w.dtype)
        if reduction == "mean":
            den = jnp.sum(w)
            mean = jnp.where(den == 0, 0, jnp.sum(jnp.where(ignored, 0, w * nll)) /
                             jnp.where(den == 0, 1, den))
            dw = jnp.where(den == 0, 0, ct_t * (nll - mean) / jnp.where(den == 0, 1, den))
        else:
            dw = ct_t * nll
        dw = jnp.where(ignored, 0, dw)
        d_weights = jnp.zeros(weights.shape, w.dtype).at[lc].add(dw).astype(weights.dtype)
    return d, None, d_weights


_cross_entropy.defvjp(_fwd, _bwd)
