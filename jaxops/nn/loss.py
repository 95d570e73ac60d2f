"""cross_entropy whose forward and backward are the fused softmax cross-entropy kernels.

The forward kernel reads the logits once and keeps only each row's nll and logsumexp; the
backward kernel recomputes the softmax from the logits and that logsumexp and writes d_logits
once, so log_prob never exists in memory. The per-row nll is a `jax.custom_jvp` whose tangent
map (`rows_jvp`, XLA code) is linear with the backward kernel as its transpose: forward mode
works, reverse mode runs the kernel, and higher orders differentiate the kernels' pure-JAX
references. Weights, ignore_index and the reduction are jnp code around the nll.
"""
import operator

import jax
import jax.numpy as jnp

from jaxops._src import rules
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
    with rules.named("cross_entropy"):
        ops.check_logits_labels(logits, labels, weights, reduction, ignore_index)
    ignore_index = None if ignore_index is None else operator.index(ignore_index)
    if disabled("cross_entropy"):
        return ref.cross_entropy(logits, labels, weights, ignore_index, reduction)
    return _cross_entropy(logits, labels, weights, ignore_index, reduction)


def _prepare(logits, labels, weights, ignore_index):
    c = logits.shape[-1]
    l = labels.reshape(-1)
    w, ignored, lc = ref.class_weights(l, c, weights, ignore_index, ref.acc_dtype(logits.dtype))
    return logits.reshape(-1, c), ops._row_labels(l, c, ignored), w, ignored, lc


def _cross_entropy(logits, labels, weights, ignore_index, reduction):
    x, lab, w, ignored, _ = _prepare(logits, labels, weights, ignore_index)
    per_row = jnp.where(ignored, 0, w * _row_nll(x, lab))
    loss = ref.reduce_loss(per_row, w, reduction)  # weights' gradient: jnp autodiff of this
    return (loss.reshape(labels.shape) if reduction == "none" else loss).astype(logits.dtype)


@jax.custom_jvp
def _row_nll(x, labels):
    return ops.rows_forward(x, labels)[0]


@_row_nll.defjvp
def _row_nll_jvp(primals, tangents):
    (x, labels), (t, _) = primals, tangents
    nll, lse = ops.rows_forward(x, labels)
    return nll, ops.rows_jvp(t, x, lse, labels)
