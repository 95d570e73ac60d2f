"""Softmax cross-entropy losses and their gradients (ORT training ops).

  SoftmaxCrossEntropyLoss (ONNX, opsets 12/13)    softmax_cross_entropy_loss
  SoftmaxCrossEntropyLossGrad (ms)                softmax_cross_entropy_loss_grad
  SoftmaxCrossEntropyLossInternal (ms)            softmax_cross_entropy_loss_internal
  SoftmaxCrossEntropyLossInternalGrad (ms)        softmax_cross_entropy_loss_internal_grad
  SparseSoftmaxCrossEntropy (ONNX-domain, ORT)    sparse_softmax_cross_entropy
  SparseSoftmaxCrossEntropyGrad (ONNX-domain)     sparse_softmax_cross_entropy_grad
  SoftmaxCrossEntropy (ms, soft labels)           softmax_cross_entropy
  SoftmaxCrossEntropyGrad (ms)                    softmax_cross_entropy_grad

The hard-label ops run two row kernels (ffi/include/jaxops/loss.h): a forward that reads each
row of logits once (online max/sum) and writes the row's nll and logsumexp (and log_prob only
when asked for), and a backward that reads log_prob (or the logits) once and writes d_logits
once. ORT's layouts ([N, C, d1..] with classes on axis 1) are mapped to rows here, and weights,
ignore_index and the reduction become per-row scalars in XLA; the sums over rows are XLA
reductions, so results are deterministic. The soft-label ops (legacy loss_func ops that
generate_artifacts never emits) are plain XLA code.

Labels: a label equal to ignore_index contributes 0 loss and 0 gradient and is left out of the
mean's weight sum (all ignored: the mean is 0, as in ORT). A label outside [0, C) that is not
ignore_index gives its sample a NaN loss and a NaN gradient row (so a sum or mean is NaN) and
is never used to address memory (ORT 1.19.2 CPU reads out of bounds there; newer ORT raises).

Differentiation: every op has gradients of any order through its pure-JAX reference (the
kernels' jvp rules differentiate it); `jaxops.nn.cross_entropy` is the fused training path.
"""
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src.disable import disabled
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops.reference import loss as ref

_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_INTS = (jnp.int32, jnp.int64)
_REDUCTIONS = ("none", "sum", "mean")
# ONNX TensorProto element types accepted as output_type
_ONNX_FLOATS = ref.ONNX_FLOATS

# ---------------------------------------------------------------------------------------
# The row kernels: x [R, C], labels int32 [R] (-1: no target), per-row f32 (f64) scalars.


def _check_x_labels(x, labels):
    if x.dtype not in _FLOATS or x.ndim != 2:
        raise TypeError(f"x must be a float [rows, classes] array, got {x.dtype}{x.shape}")
    if labels.dtype != jnp.int32 or labels.shape != x.shape[:1]:
        raise TypeError(f"labels must be int32 [{x.shape[0]}], got {labels.dtype}{labels.shape}")
    return jnp.dtype(ref.acc_dtype(x.dtype))


def _check_vec(name, v, rows, acc):
    if v.dtype != acc or v.shape != (rows,):
        raise TypeError(f"{name} must be {acc} [{rows}], got {v.dtype}{v.shape}")


_ONNX_TYPE = {jnp.dtype(v): k for k, v in _ONNX_FLOATS.items()}


def _fwd_shape(x, labels, out_type=None):
    acc = _check_x_labels(x, labels)
    vec = jax.ShapeDtypeStruct(x.shape[:1], acc)
    if out_type is None:
        return vec, vec
    return vec, vec, jax.ShapeDtypeStruct(x.shape, _ONNX_FLOATS[int(out_type)])


def _bwd_shape(g, x, lse, labels, bias=None, *, out_type):
    out_dtype = jnp.dtype(_ONNX_FLOATS[int(out_type)])
    acc = _check_x_labels(x, labels)
    _check_vec("g", g, x.shape[0], acc)
    _check_vec("lse", lse, x.shape[0], acc)
    if bias is not None and (bias.shape != x.shape or bias.dtype != out_dtype):
        raise TypeError(f"bias must be {out_dtype}{x.shape}, got {bias.dtype}{bias.shape}")
    return jax.ShapeDtypeStruct(x.shape, out_dtype)


def _batch_rows(op, args, dims, **params):
    """Row kernels treat every leading dim alike: fold the batch into the rows."""
    args = batch_at_front(args, dims)
    b = args[0].shape[0]
    out = op.bind(*(a.reshape((-1,) + a.shape[2:]) for a in args), **params)
    unfold = lambda o: o.reshape((b, -1) + o.shape[1:])
    if isinstance(out, tuple):
        return tuple(unfold(o) for o in out), (0,) * len(out)
    return unfold(out), 0


def _no_attrs(*args, **params):
    return {}


def _out_type_attr(*args, out_type):
    """The output dtype as an ONNX type code: an FFI attribute (the inner primitive's shape
    rule needs it) that the handler checks against its output buffer."""
    return {"out_type": np.int64(out_type)}


def _fwd_factors(x, labels, out_type=None):
    rows = (("r",), ("r",)) + ((("r", "c"),) if out_type is not None else ())
    return Factors((("r", "c"), ("r",)), rows, ("c",))


def _bwd_factors(g, x, lse, labels, bias=None, *, out_type):
    operands = (("r",), ("r", "c"), ("r",), ("r",)) + ((("r", "c"),) if bias is not None else ())
    return Factors(operands, (("r", "c"),), ("c",))


_FWD = Op("softmax_cross_entropy_rows", shape=_fwd_shape, reference=ref.rows_forward,
          batch=_batch_rows, target="jaxops_sce_fwd", ffi_attrs=_no_attrs,
          factors=_fwd_factors, multiple_results=True)
_FWD_LOG_PROB = Op("softmax_cross_entropy_rows_log_prob", shape=_fwd_shape,
                   reference=ref.rows_forward_log_prob, batch=_batch_rows,
                   target="jaxops_sce_fwd_log_prob", ffi_attrs=_out_type_attr,
                   factors=_fwd_factors, multiple_results=True)
_BWD = Op("softmax_cross_entropy_rows_grad", shape=_bwd_shape, reference=ref.rows_grad,
          batch=_batch_rows, target="jaxops_sce_bwd", ffi_attrs=_out_type_attr,
          factors=_bwd_factors)
_BWD_BIAS = Op("softmax_cross_entropy_rows_grad_bias", shape=_bwd_shape,
               reference=ref.rows_grad_bias, batch=_batch_rows, target="jaxops_sce_bwd_bias",
               ffi_attrs=_out_type_attr, factors=_bwd_factors)


def _jvp_shape(t, x, lse, labels):
    acc = _check_x_labels(x, labels)
    if t.dtype != x.dtype or t.shape != x.shape:
        raise TypeError(f"t must be {x.dtype}{x.shape}, got {t.dtype}{t.shape}")
    _check_vec("lse", lse, x.shape[0], acc)
    return jax.ShapeDtypeStruct(x.shape[:1], acc)


def _jvp_transpose(op, ct, t, x, lse, labels):
    if not is_undefined(t) or any(is_undefined(v) for v in (x, lse, labels)):
        raise NotImplementedError(f"{op.name} is linear in its first operand only")
    if is_zero(ct):
        return None, None, None, None
    return rows_grad(ct, x, lse, labels, out_dtype=t.aval.dtype), None, None, None


# The nll's tangent map (XLA code: forward mode only); its transpose is the backward kernel, so
# reverse mode through jaxops.nn.cross_entropy's custom_jvp runs the kernel.
_JVP = Op("softmax_cross_entropy_rows_jvp", shape=_jvp_shape, reference=ref.rows_jvp,
          batch=_batch_rows, impl=ref.rows_jvp, transpose=_jvp_transpose)


def rows_jvp(t, x, lse, labels):
    """Per-row tangent of nll at logits x [R, C] (lse from rows_forward) along t; linear in
    t, transposed by the rows_grad kernel."""
    return _JVP(t, x, lse, labels)


def rows_forward(x, labels, log_prob_dtype=None):
    """(nll, lse[, log_prob]) of rows x [R, C] with int32 labels (see loss.h); kernels."""
    if log_prob_dtype is None:
        return _FWD(x, labels)
    return _FWD_LOG_PROB(x, labels, out_type=_ONNX_TYPE[jnp.dtype(log_prob_dtype)])


def rows_grad(g, x, lse, labels, bias=None, *, out_dtype):
    """d = g * (exp(x - lse) - onehot(labels)) (+ bias) over rows; kernels."""
    code = _ONNX_TYPE[jnp.dtype(out_dtype)]
    if bias is None:
        return _BWD(g, x, lse, labels, out_type=code)
    return _BWD_BIAS(g, x, lse, labels, bias, out_type=code)


# ---------------------------------------------------------------------------------------
# Layouts and checks


class _Checks:
    """Raises TypeError/ValueError prefixed with the public op's name."""

    def __init__(self, name):
        self.name = name

    def fail(self, kind, msg):
        raise kind(f"jaxops.ops.{self.name}: {msg}")

    def float_array(self, label, x, min_rank=0):
        if x is None or not hasattr(x, "dtype") or x.dtype not in _FLOATS:
            self.fail(TypeError, f"{label} must be float16, bfloat16, float32 or float64, "
                                 f"got {getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim < min_rank:
            self.fail(ValueError, f"{label} must have rank >= {min_rank}, got shape {x.shape}")

    def labels(self, label, x, shape):
        if not hasattr(x, "dtype") or x.dtype not in _INTS:
            self.fail(TypeError, f"{label} must be int32 or int64, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.shape != tuple(shape):
            self.fail(ValueError, f"{label} must have shape {tuple(shape)}, got {x.shape}")

    def same_dtype(self, label, x, dtype):
        if x.dtype != dtype:
            self.fail(TypeError, f"{label} must have dtype {jnp.dtype(dtype)}, got {x.dtype}")

    def shape(self, label, x, shape):
        if x.shape != tuple(shape):
            self.fail(ValueError, f"{label} must have shape {tuple(shape)}, got {x.shape}")

    def reduction(self, r):
        if r not in _REDUCTIONS:
            self.fail(ValueError, f"reduction must be one of {_REDUCTIONS}, got {r!r}")

    def int_attr(self, label, v):
        if v is None:
            return None
        try:
            return operator.index(v)
        except TypeError:
            self.fail(TypeError, f"{label} must be an int, got {v!r}")

    def output_type(self, output_type, default):
        if output_type is None:
            return jnp.dtype(default)
        if output_type not in _ONNX_FLOATS:
            self.fail(ValueError, f"output_type must be an ONNX float type {sorted(_ONNX_FLOATS)}, "
                                  f"got {output_type!r}")
        return jnp.dtype(_ONNX_FLOATS[output_type])

    def ignore_index_input(self, v):
        if v is None:
            return None
        if not hasattr(v, "dtype") or v.dtype not in _INTS or v.size != 1 or v.ndim > 1:
            got = f"{getattr(v, 'dtype', type(v).__name__)}{getattr(v, 'shape', '')}"
            self.fail(TypeError, f"ignore_index must be an int64 scalar (or [1]) tensor, got {got}")
        return v.reshape(())


def _arrays(*xs):
    return [None if x is None else jnp.asarray(x) for x in xs]


def _to_rows(x):
    """[N, C, d1..] -> [N*d1*.., C] (classes last; a copy only when there are d dims)."""
    if x.ndim == 2:
        return x
    return jnp.moveaxis(x, 1, -1).reshape(-1, x.shape[1])


def _from_rows(d, shape):
    if len(shape) == 2:
        return d
    return jnp.moveaxis(d.reshape((shape[0],) + tuple(shape[2:]) + (shape[1],)), -1, 1)


def _row_labels(labels, c, ignored):
    """int32 labels for the kernels: -1 where a sample is ignored or out of range."""
    ok = (labels >= 0) & (labels < c) & ~ignored
    return jnp.where(ok, labels, -1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# SoftmaxCrossEntropyLoss and its Internal / Grad variants


def _check_sce(ch, scores, labels, weights, reduction):
    ch.float_array("scores", scores, 2)
    ch.labels("labels", labels, scores.shape[:1] + scores.shape[2:])
    if weights is not None:
        ch.float_array("weights", weights)
        ch.same_dtype("weights", weights, scores.dtype)
        ch.shape("weights", weights, scores.shape[1:2])
    ch.reduction(reduction)


def _sce_loss(scores, labels, weights, ignore_index, reduction, out, with_log_prob):
    t = ref.acc_dtype(scores.dtype)
    c = scores.shape[1]
    l = labels.reshape(-1)
    w, ignored, _ = ref.class_weights(l, c, weights, ignore_index, t)
    lab = _row_labels(l, c, ignored)
    res = rows_forward(_to_rows(scores), lab, out if with_log_prob else None)
    loss = ref.reduce_loss(jnp.where(ignored, 0, w * res[0]), w, reduction)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    log_prob = _from_rows(res[2], scores.shape) if with_log_prob else None
    return loss.astype(out), log_prob


def softmax_cross_entropy_loss(scores, labels, weights=None, *, reduction="mean",
                               ignore_index=None, return_log_prob=True):
    """ONNX SoftmaxCrossEntropyLoss (opsets 12 and 13) -> (output, log_prob).

    scores [N, C, d1..] (classes on axis 1), labels int [N, d1..], weights [C] per class.
    loss_i = -weights[l_i] * log_softmax(scores)[i, l_i]; 'none' gives [N, d1..], 'sum' the
    sum, 'mean' the sum divided by the weight sum of the non-ignored samples (the count
    without weights), 0 when every sample is ignored. log_prob has scores' shape; with
    return_log_prob=False it is not computed (None) and the kernel never writes it.
    Out-of-range labels: NaN, see the module docstring.
    """
    scores, labels, weights = _arrays(scores, labels, weights)
    ch = _Checks("softmax_cross_entropy_loss")
    _check_sce(ch, scores, labels, weights, reduction)
    ignore_index = ch.int_attr("ignore_index", ignore_index)
    if disabled("softmax_cross_entropy_loss"):
        y, lp = ref.softmax_cross_entropy_loss(scores, labels, weights, reduction=reduction,
                                               ignore_index=ignore_index)
        return y, lp if return_log_prob else None
    return _sce_loss(scores, labels, weights, ignore_index, reduction, scores.dtype,
                     return_log_prob)


def softmax_cross_entropy_loss_internal(scores, labels, weights=None, ignore_index=None, *,
                                        reduction="mean", output_type=None):
    """com.microsoft SoftmaxCrossEntropyLossInternal -> (output, log_prob).

    SoftmaxCrossEntropyLoss with ignore_index an optional int64 scalar INPUT (it may be a
    traced value) and both outputs cast to `output_type` (an ONNX TensorProto float type:
    1 f32, 10 f16, 11 f64, 16 bf16; default: the scores' dtype).
    """
    scores, labels, weights, ignore_index = _arrays(scores, labels, weights, ignore_index)
    ch = _Checks("softmax_cross_entropy_loss_internal")
    _check_sce(ch, scores, labels, weights, reduction)
    ignore_index = ch.ignore_index_input(ignore_index)
    out = ch.output_type(output_type, scores.dtype)
    if disabled("softmax_cross_entropy_loss_internal"):
        return ref.softmax_cross_entropy_loss(scores, labels, weights, reduction=reduction,
                                              ignore_index=ignore_index, output_type=out)
    return _sce_loss(scores, labels, weights, ignore_index, reduction, out, True)


def _check_sce_grad(ch, dY, log_prob, label, weight, reduction):
    ch.float_array("log_prob", log_prob, 2)
    ch.labels("label", label, log_prob.shape[:1] + log_prob.shape[2:])
    ch.reduction(reduction)
    ch.float_array("dY", dY)
    if reduction == "none":
        ch.shape("dY", dY, label.shape)
    elif dY.size != 1:
        ch.fail(ValueError, f"dY must be a scalar for reduction={reduction!r}, got {dY.shape}")
    if weight is not None:
        ch.float_array("weight", weight)
        ch.shape("weight", weight, log_prob.shape[1:2])


def _sce_grad(dY, log_prob, label, weight, ignore_index, reduction, bias, out):
    t = ref.acc_dtype(log_prob.dtype)
    c = log_prob.shape[1]
    l = label.reshape(-1)
    w, ignored, _ = ref.class_weights(l, c, weight, ignore_index, t)
    dy = dY.reshape(-1) if reduction == "none" else dY.reshape(())
    g = ref.grad_scale(dy, w, ignored, reduction)
    zero_lse = jnp.zeros(g.shape, t)  # x is log_prob: exp(x - 0) is the softmax
    bias_rows = None if bias is None else _to_rows(bias)
    d = rows_grad(g, _to_rows(log_prob), zero_lse, _row_labels(l, c, ignored), bias_rows,
                  out_dtype=out)
    return _from_rows(d, log_prob.shape)


def softmax_cross_entropy_loss_grad(dY, log_prob, label, weight=None, *, reduction="mean",
                                    ignore_index=None):
    """com.microsoft SoftmaxCrossEntropyLossGrad -> d_logits, log_prob's shape and dtype.

    d[i, c, ..] = g_i * (exp(log_prob[i, c, ..]) - [c == l_i]) with g_i = dY * w[l_i] / the
    weight sum of non-ignored samples (mean; all zeros when that sum is 0), dY * w[l_i] (sum),
    dY_i * w[l_i] (none); 0 for ignored samples. dY is a scalar unless reduction is 'none'.
    """
    dY, log_prob, label, weight = _arrays(dY, log_prob, label, weight)
    ch = _Checks("softmax_cross_entropy_loss_grad")
    _check_sce_grad(ch, dY, log_prob, label, weight, reduction)
    ignore_index = ch.int_attr("ignore_index", ignore_index)
    if disabled("softmax_cross_entropy_loss_grad"):
        return ref.softmax_cross_entropy_loss_grad(dY, log_prob, label, weight,
                                                   reduction=reduction, ignore_index=ignore_index)
    return _sce_grad(dY, log_prob, label, weight, ignore_index, reduction, None, log_prob.dtype)


def softmax_cross_entropy_loss_internal_grad(dY, log_prob, label, weight=None,
                                             ignore_index=None, bias=None, *,
                                             reduction="mean", output_type=None):
    """com.microsoft SoftmaxCrossEntropyLossInternalGrad -> d_logits.

    SoftmaxCrossEntropyLossGrad with ignore_index an optional int64 scalar input, an optional
    `bias` (log_prob's shape, the output dtype) added to the result in the same pass, and the
    result cast to `output_type` (ONNX float type; default log_prob's dtype).
    """
    dY, log_prob, label, weight, ignore_index, bias = _arrays(dY, log_prob, label, weight,
                                                              ignore_index, bias)
    ch = _Checks("softmax_cross_entropy_loss_internal_grad")
    _check_sce_grad(ch, dY, log_prob, label, weight, reduction)
    ignore_index = ch.ignore_index_input(ignore_index)
    out = ch.output_type(output_type, log_prob.dtype)
    if bias is not None:
        ch.float_array("bias", bias)
        ch.shape("bias", bias, log_prob.shape)
        ch.same_dtype("bias", bias, out)
    if disabled("softmax_cross_entropy_loss_internal_grad"):
        return ref.softmax_cross_entropy_loss_grad(
            dY, log_prob, label, weight, reduction=reduction, ignore_index=ignore_index,
            bias=bias, output_type=out)
    return _sce_grad(dY, log_prob, label, weight, ignore_index, reduction, bias, out)


# ---------------------------------------------------------------------------------------
# SparseSoftmaxCrossEntropy (ORT-private, ONNX domain): classes last, per-sample weight


def _check_sparse(ch, logits, label, weight, reduction, logits_name="logits"):
    ch.float_array(logits_name, logits, 1)
    ch.labels("label", label, logits.shape[:-1])
    if weight is not None:
        ch.float_array("weight", weight)
        ch.shape("weight", weight, label.shape)
    ch.reduction(reduction)


def sparse_softmax_cross_entropy(logits, label, weight=None, *, reduction="mean",
                                 return_log_prob=True):
    """ORT SparseSoftmaxCrossEntropy (ONNX domain, opset 9) -> (Y, log_prob).

    logits [..., C], label int [...], weight per SAMPLE (label's shape). loss_i =
    -log_softmax(logits)[i, l_i]; mean: sum w_i loss_i / sum w_i (/ count without weight;
    NaN when the weights sum to 0, as ORT); sum: sum w_i loss_i; none: w_i loss_i, label's
    shape as ORT's schema says (ORT 1.19.2's CPU kernel returns the sum there instead; graphs
    type that output by the schema, so the schema is followed). No ignore_index.
    """
    logits, label, weight = _arrays(logits, label, weight)
    ch = _Checks("sparse_softmax_cross_entropy")
    _check_sparse(ch, logits, label, weight, reduction)
    if disabled("sparse_softmax_cross_entropy"):
        y, lp = ref.sparse_softmax_cross_entropy(logits, label, weight, reduction=reduction)
        return y, lp if return_log_prob else None
    t = ref.acc_dtype(logits.dtype)
    c = logits.shape[-1]
    l = label.reshape(-1)
    ok = (l >= 0) & (l < c)
    res = rows_forward(logits.reshape(-1, c), _row_labels(l, c, ~ok),
                       logits.dtype if return_log_prob else None)
    w = jnp.ones(l.shape, t) if weight is None else weight.reshape(-1).astype(t)
    loss = w * jnp.where(ok, res[0], jnp.nan)
    if reduction == "none":
        y = loss.reshape(label.shape)
    elif reduction == "sum":
        y = jnp.sum(loss)
    else:
        y = jnp.sum(loss) / jnp.sum(w)
    return y.astype(logits.dtype), res[2].reshape(logits.shape) if return_log_prob else None


def sparse_softmax_cross_entropy_grad(dY, log_prob, label, weight=None, *, reduction="mean"):
    """ORT SparseSoftmaxCrossEntropyGrad (ONNX domain, opset 9) -> d_logits.

    d[i, c] = dY * w_i * (exp(log_prob[i, c]) - [c == l_i]) / (sum w for mean (count without
    weight), 1 for sum); for 'none' dY has label's shape and scales each sample.
    """
    dY, log_prob, label, weight = _arrays(dY, log_prob, label, weight)
    ch = _Checks("sparse_softmax_cross_entropy_grad")
    _check_sparse(ch, log_prob, label, weight, reduction, "log_prob")
    ch.float_array("dY", dY)
    if reduction == "none":
        ch.shape("dY", dY, label.shape)
    elif dY.size != 1:
        ch.fail(ValueError, f"dY must be a scalar for reduction={reduction!r}, got {dY.shape}")
    if disabled("sparse_softmax_cross_entropy_grad"):
        return ref.sparse_softmax_cross_entropy_grad(dY, log_prob, label, weight,
                                                     reduction=reduction)
    t = ref.acc_dtype(log_prob.dtype)
    c = log_prob.shape[-1]
    l = label.reshape(-1)
    ok = (l >= 0) & (l < c)
    w = jnp.ones(l.shape, t) if weight is None else weight.reshape(-1).astype(t)
    dy = dY.reshape(-1) if reduction == "none" else dY.reshape(())
    g = dy.astype(t) * jnp.where(ok, w, jnp.nan)
    if reduction == "mean":
        g = g / jnp.sum(w)
    d = rows_grad(g, log_prob.reshape(-1, c), jnp.zeros(l.shape, t), _row_labels(l, c, ~ok),
                  out_dtype=log_prob.dtype)
    return d.reshape(log_prob.shape)


# ---------------------------------------------------------------------------------------
# SoftmaxCrossEntropy (com.microsoft, soft labels): XLA code


def softmax_cross_entropy(logits, label, *, reduction="mean"):
    """com.microsoft SoftmaxCrossEntropy -> (Y, log_prob), soft labels, classes last.

    loss_i = -sum_c label[i, c] * log_softmax(logits)[i, c]; mean divides by the row count,
    none gives label.shape[:-1]. Plain XLA code (no kernel: a legacy forward op that
    generate_artifacts does not emit).
    """
    logits, label = _arrays(logits, label)
    ch = _Checks("softmax_cross_entropy")
    ch.float_array("logits", logits, 1)
    ch.float_array("label", label)
    ch.same_dtype("label", label, logits.dtype)
    ch.shape("label", label, logits.shape)
    ch.reduction(reduction)
    return ref.softmax_cross_entropy(logits, label, reduction=reduction)


def softmax_cross_entropy_grad(dY, log_prob, label, *, reduction="mean"):
    """com.microsoft SoftmaxCrossEntropyGrad: dY * (exp(log_prob) - label) / (rows if mean).
    Plain XLA code."""
    dY, log_prob, label = _arrays(dY, log_prob, label)
    ch = _Checks("softmax_cross_entropy_grad")
    ch.float_array("log_prob", log_prob, 1)
    ch.float_array("label", label)
    ch.same_dtype("label", label, log_prob.dtype)
    ch.shape("label", label, log_prob.shape)
    ch.reduction(reduction)
    ch.float_array("dY", dY)
    if reduction == "none":
        ch.shape("dY", dY, log_prob.shape[:-1])
    elif dY.size != 1:
        ch.fail(ValueError, f"dY must be a scalar for reduction={reduction!r}, got {dY.shape}")
    return ref.softmax_cross_entropy_grad(dY.reshape(dY.shape if reduction == "none" else ()),
                                          log_prob, label, reduction=reduction)


__all__ = ["softmax_cross_entropy", "softmax_cross_entropy_grad", "softmax_cross_entropy_loss",
           "softmax_cross_entropy_loss_grad", "softmax_cross_entropy_loss_internal",
           "softmax_cross_entropy_loss_internal_grad", "sparse_softmax_cross_entropy",
           "sparse_softmax_cross_entropy_grad"]

ORT_OPS = {
    ("", "SoftmaxCrossEntropyLoss"): softmax_cross_entropy_loss,
    ("", "SparseSoftmaxCrossEntropy"): sparse_softmax_cross_entropy,
    ("", "SparseSoftmaxCrossEntropyGrad"): sparse_softmax_cross_entropy_grad,
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"): softmax_cross_entropy_loss_grad,
    ("com.microsoft", "SoftmaxCrossEntropyLossInternal"): softmax_cross_entropy_loss_internal,
    ("com.microsoft", "SoftmaxCrossEntropyLossInternalGrad"):
        softmax_cross_entropy_loss_internal_grad,
    ("com.microsoft", "SoftmaxCrossEntropy"): softmax_cross_entropy,
    ("com.microsoft", "SoftmaxCrossEntropyGrad"): softmax_cross_entropy_grad,
}
