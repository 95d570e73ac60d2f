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

from jaxops._src import rules
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops._src.spec import Matrix, define
from jaxops.reference import loss as ref

_REDUCTIONS = ("none", "sum", "mean")
# ONNX TensorProto element types accepted as output_type
_ONNX_FLOATS = ref.ONNX_FLOATS

# ---------------------------------------------------------------------------------------
# The row kernels: x [R, C], labels int32 [R] (-1: no target), per-row f32 (f64) scalars.


def _check_x_labels(x, labels):
    if np.dtype(x.dtype) not in rules.FLOATS or x.ndim != 2:
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


# The public ops' kernel paths bind the row kernels directly: their spec has already checked
# the arguments and read JAXOPS_DISABLE (the helpers above are jaxops.nn's entry points).
def _bind_forward(x, labels, log_prob_dtype=None):
    if log_prob_dtype is None:
        return _FWD.bind(x, labels)
    return _FWD_LOG_PROB.bind(x, labels, out_type=_ONNX_TYPE[jnp.dtype(log_prob_dtype)])


def _bind_grad(g, x, lse, labels, bias=None, *, out_dtype):
    code = _ONNX_TYPE[jnp.dtype(out_dtype)]
    if bias is None:
        return _BWD.bind(g, x, lse, labels, out_type=code)
    return _BWD_BIAS.bind(g, x, lse, labels, bias, out_type=code)


# ---------------------------------------------------------------------------------------
# Argument rules (plain messages: each op's public function prefixes its name). jaxops.nn's
# cross_entropy shares them.


def _rank(label, x, min_rank):
    if x.ndim < min_rank:
        raise ValueError(f"{label} must have rank >= {min_rank}, got shape {x.shape}")


def _shape(label, x, shape):
    if x.shape != tuple(shape):
        raise ValueError(f"{label} must have shape {tuple(shape)}, got {x.shape}")


def _reduction(reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _ignore_index_attr(ignore_index):
    if ignore_index is not None:
        rules.integer("ignore_index", ignore_index)


def _ignore_index_input(ignore_index):
    """SoftmaxCrossEntropyLossInternal's ignore_index: an int64 scalar (or [1]) tensor, which
    may be traced (its dtype is the input kind's rule)."""
    if ignore_index is not None and (ignore_index.size != 1 or ignore_index.ndim > 1):
        raise ValueError(f"ignore_index must be a scalar (or [1]) tensor, got shape "
                         f"{ignore_index.shape}")


def _output_type(output_type):
    if output_type is None:
        return
    if isinstance(output_type, bool) or rules.integer("output_type", output_type) \
            not in _ONNX_FLOATS:
        raise ValueError(f"output_type must be an ONNX float type {sorted(_ONNX_FLOATS)}, "
                         f"got {output_type!r}")


def _scalar_dy(dY, reduction, shape):
    if reduction == "none":
        _shape("dY", dY, shape)
    elif dY.size != 1:
        raise ValueError(f"dY must be a scalar for reduction={reduction!r}, got {dY.shape}")


def check_logits_labels(logits, labels, weights, reduction, ignore_index):
    """jaxops.nn.cross_entropy's rules: logits [..., C] (classes last), labels [...],
    weights [C]."""
    rules.floats(logits=logits)
    _rank("logits", logits, 1)
    if np.dtype(labels.dtype) not in rules.INDEX:
        raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
    _shape("labels", labels, logits.shape[:-1])
    if weights is not None:
        rules.floats(weights=weights)
        _shape("weights", weights, logits.shape[-1:])
    _reduction(reduction)
    _ignore_index_attr(ignore_index)


# ---------------------------------------------------------------------------------------
# Layouts


def _int(v):
    return None if v is None else operator.index(v)


def _scalar(v):
    return None if v is None else v.reshape(())


def _out_dtype(output_type, default):
    return jnp.dtype(default if output_type is None else _ONNX_FLOATS[int(output_type)])


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


def _check_sce(scores, labels, weights, reduction):
    _rank("scores", scores, 2)
    _shape("labels", labels, scores.shape[:1] + scores.shape[2:])
    if weights is not None:
        rules.same_dtype(scores=scores, weights=weights)
        _shape("weights", weights, scores.shape[1:2])
    _reduction(reduction)


def _sce_loss(scores, labels, weights, ignore_index, reduction, out, with_log_prob):
    t = ref.acc_dtype(scores.dtype)
    c = scores.shape[1]
    l = labels.reshape(-1)
    w, ignored, _ = ref.class_weights(l, c, weights, ignore_index, t)
    lab = _row_labels(l, c, ignored)
    res = _bind_forward(_to_rows(scores), lab, out if with_log_prob else None)
    loss = ref.reduce_loss(jnp.where(ignored, 0, w * res[0]), w, reduction)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    log_prob = _from_rows(res[2], scores.shape) if with_log_prob else None
    return loss.astype(out), log_prob


def _check_loss(scores, labels, weights, *, reduction, ignore_index, return_log_prob):
    _check_sce(scores, labels, weights, reduction)
    _ignore_index_attr(ignore_index)


def _loss_kernel(scores, labels, weights, *, reduction, ignore_index, return_log_prob):
    return _sce_loss(scores, labels, weights, _int(ignore_index), reduction, scores.dtype,
                     return_log_prob)


def _loss_reference(scores, labels, weights, *, reduction, ignore_index, return_log_prob):
    y, lp = ref.softmax_cross_entropy_loss(scores, labels, weights, reduction=reduction,
                                           ignore_index=_int(ignore_index))
    return y, lp if return_log_prob else None


def _check_internal(scores, labels, weights, ignore_index, *, reduction, output_type):
    _check_sce(scores, labels, weights, reduction)
    _ignore_index_input(ignore_index)
    _output_type(output_type)


def _internal_kernel(scores, labels, weights, ignore_index, *, reduction, output_type):
    return _sce_loss(scores, labels, weights, _scalar(ignore_index), reduction,
                     _out_dtype(output_type, scores.dtype), True)


def _internal_reference(scores, labels, weights, ignore_index, *, reduction, output_type):
    return ref.softmax_cross_entropy_loss(
        scores, labels, weights, reduction=reduction, ignore_index=_scalar(ignore_index),
        output_type=_out_dtype(output_type, scores.dtype))


def _check_sce_grad(dY, log_prob, label, weight, reduction):
    _rank("log_prob", log_prob, 2)
    _shape("label", label, log_prob.shape[:1] + log_prob.shape[2:])
    _reduction(reduction)
    _scalar_dy(dY, reduction, label.shape)
    if weight is not None:
        _shape("weight", weight, log_prob.shape[1:2])


def _sce_grad(dY, log_prob, label, weight, ignore_index, reduction, bias, out):
    t = ref.acc_dtype(log_prob.dtype)
    c = log_prob.shape[1]
    l = label.reshape(-1)
    w, ignored, _ = ref.class_weights(l, c, weight, ignore_index, t)
    dy = dY.reshape(-1) if reduction == "none" else dY.reshape(())
    g = ref.grad_scale(dy, w, ignored, reduction)
    zero_lse = jnp.zeros(g.shape, t)  # x is log_prob: exp(x - 0) is the softmax
    bias_rows = None if bias is None else _to_rows(bias)
    d = _bind_grad(g, _to_rows(log_prob), zero_lse, _row_labels(l, c, ignored), bias_rows,
                   out_dtype=out)
    return _from_rows(d, log_prob.shape)


def _check_loss_grad(dY, log_prob, label, weight, *, reduction, ignore_index):
    _check_sce_grad(dY, log_prob, label, weight, reduction)
    _ignore_index_attr(ignore_index)


def _loss_grad_kernel(dY, log_prob, label, weight, *, reduction, ignore_index):
    return _sce_grad(dY, log_prob, label, weight, _int(ignore_index), reduction, None,
                     log_prob.dtype)


def _loss_grad_reference(dY, log_prob, label, weight, *, reduction, ignore_index):
    return ref.softmax_cross_entropy_loss_grad(dY, log_prob, label, weight, reduction=reduction,
                                               ignore_index=_int(ignore_index))


def _check_internal_grad(dY, log_prob, label, weight, ignore_index, bias, *, reduction,
                         output_type):
    _check_sce_grad(dY, log_prob, label, weight, reduction)
    _ignore_index_input(ignore_index)
    _output_type(output_type)
    if bias is not None:
        _shape("bias", bias, log_prob.shape)
        out = _out_dtype(output_type, log_prob.dtype)
        if bias.dtype != out:
            raise TypeError(f"bias must have dtype {out} (the output's), got {bias.dtype}")


def _internal_grad_kernel(dY, log_prob, label, weight, ignore_index, bias, *, reduction,
                          output_type):
    return _sce_grad(dY, log_prob, label, weight, _scalar(ignore_index), reduction, bias,
                     _out_dtype(output_type, log_prob.dtype))


def _internal_grad_reference(dY, log_prob, label, weight, ignore_index, bias, *, reduction,
                             output_type):
    return ref.softmax_cross_entropy_loss_grad(
        dY, log_prob, label, weight, reduction=reduction, ignore_index=_scalar(ignore_index),
        bias=bias, output_type=_out_dtype(output_type, log_prob.dtype))


# ---------------------------------------------------------------------------------------
# SparseSoftmaxCrossEntropy (ORT-private, ONNX domain): classes last, per-sample weight


def _check_sparse(logits, label, weight, reduction, logits_name="logits"):
    _rank(logits_name, logits, 1)
    _shape("label", label, logits.shape[:-1])
    if weight is not None:
        _shape("weight", weight, label.shape)
    _reduction(reduction)


def _sparse_kernel(logits, label, weight, *, reduction, return_log_prob):
    t = ref.acc_dtype(logits.dtype)
    c = logits.shape[-1]
    l = label.reshape(-1)
    ok = (l >= 0) & (l < c)
    res = _bind_forward(logits.reshape(-1, c), _row_labels(l, c, ~ok),
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


def _sparse_reference(logits, label, weight, *, reduction, return_log_prob):
    y, lp = ref.sparse_softmax_cross_entropy(logits, label, weight, reduction=reduction)
    return y, lp if return_log_prob else None


def _check_sparse_grad(dY, log_prob, label, weight, *, reduction):
    _check_sparse(log_prob, label, weight, reduction, "log_prob")
    _scalar_dy(dY, reduction, label.shape)


def _sparse_grad_kernel(dY, log_prob, label, weight, *, reduction):
    t = ref.acc_dtype(log_prob.dtype)
    c = log_prob.shape[-1]
    l = label.reshape(-1)
    ok = (l >= 0) & (l < c)
    w = jnp.ones(l.shape, t) if weight is None else weight.reshape(-1).astype(t)
    dy = dY.reshape(-1) if reduction == "none" else dY.reshape(())
    g = dy.astype(t) * jnp.where(ok, w, jnp.nan)
    if reduction == "mean":
        g = g / jnp.sum(w)
    d = _bind_grad(g, log_prob.reshape(-1, c), jnp.zeros(l.shape, t), _row_labels(l, c, ~ok),
                   out_dtype=log_prob.dtype)
    return d.reshape(log_prob.shape)


def _sparse_grad_reference(dY, log_prob, label, weight, *, reduction):
    dY = dY if reduction == "none" else dY.reshape(())
    return ref.sparse_softmax_cross_entropy_grad(dY, log_prob, label, weight,
                                                 reduction=reduction)


# ---------------------------------------------------------------------------------------
# SoftmaxCrossEntropy (com.microsoft, soft labels): XLA code


def _check_soft(logits, label, *, reduction):
    _rank("logits", logits, 1)
    rules.same_dtype(logits=logits, label=label)
    _shape("label", label, logits.shape)
    _reduction(reduction)


def _check_soft_grad(dY, log_prob, label, *, reduction):
    _rank("log_prob", log_prob, 1)
    rules.same_dtype(log_prob=log_prob, label=label)
    _shape("label", label, log_prob.shape)
    _reduction(reduction)
    _scalar_dy(dY, reduction, log_prob.shape[:-1])


def _soft_grad(dY, log_prob, label, *, reduction):
    return ref.softmax_cross_entropy_grad(dY.reshape(dY.shape if reduction == "none" else ()),
                                          log_prob, label, reduction=reduction)


# ---------------------------------------------------------------------------------------
# The specs. Matrix rows: [N, C] inputs (rows on dim 0), reduction 'none' (a per-sample output
# stays sharded like the rows; the reduced losses are jnp sums on top), ignore_index a real class.


def _scores(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape) * 2, dtype)


def _class_labels(rng, shape):
    return jnp.asarray(rng.integers(0, shape[1], shape[:1] + shape[2:]))


def _log_prob(scores, axis):
    return jax.nn.log_softmax(scores.astype(jnp.float64), axis=axis).astype(scores.dtype)


def _make_loss(rng, shape, dtype):
    return (_scores(rng, shape, dtype), _class_labels(rng, shape),
            jnp.asarray(rng.random(shape[1]) + 0.1, dtype))


def _make_internal(rng, shape, dtype):
    return _make_loss(rng, shape, dtype) + (jnp.asarray([1]),)


def _make_loss_grad(rng, shape, dtype):
    scores, labels, weights = _make_loss(rng, shape, dtype)
    dy = jnp.asarray(rng.standard_normal(labels.shape), dtype)
    return dy, _log_prob(scores, 1), labels, weights


def _make_internal_grad(rng, shape, dtype):
    dy, log_prob, labels, weights = _make_loss_grad(rng, shape, dtype)
    return (dy, log_prob, labels, weights, jnp.asarray([1]),
            jnp.asarray(rng.standard_normal(shape), dtype))


def _make_sparse(rng, shape, dtype):
    return (_scores(rng, shape, dtype), jnp.asarray(rng.integers(0, shape[-1], shape[:-1])),
            jnp.asarray(rng.random(shape[:-1]) + 0.1, dtype))


def _make_sparse_grad(rng, shape, dtype):
    logits, label, weight = _make_sparse(rng, shape, dtype)
    return (jnp.asarray(rng.standard_normal(label.shape), dtype), _log_prob(logits, -1), label,
            weight)


def _make_soft(rng, shape, dtype):
    return (_scores(rng, shape, dtype),
            jax.nn.softmax(jnp.asarray(rng.standard_normal(shape)), -1).astype(dtype))


def _make_soft_grad(rng, shape, dtype):
    logits, label = _make_soft(rng, shape, dtype)
    return (jnp.asarray(rng.standard_normal(shape[:-1]), dtype), _log_prob(logits, -1), label)


_MS = "com.microsoft"
_NONE = {"reduction": "none"}
_IGNORE_1 = {"reduction": "none", "ignore_index": 1}

softmax_cross_entropy_loss = define(
    "softmax_cross_entropy_loss", ort=("", "SoftmaxCrossEntropyLoss"),
    inputs=("scores: float", "labels: index", "weights?: float"), outputs=("output", "log_prob"),
    attrs={"reduction": "mean", "ignore_index": None}, options={"return_log_prob": True},
    check=_check_loss, kernel=_loss_kernel, reference=_loss_reference,
    doc="""ONNX SoftmaxCrossEntropyLoss (opsets 12 and 13) -> (output, log_prob).

    scores [N, C, d1..] (classes on axis 1), labels int [N, d1..], weights [C] per class.
    loss_i = -weights[l_i] * log_softmax(scores)[i, l_i]; 'none' gives [N, d1..], 'sum' the
    sum, 'mean' the sum divided by the weight sum of the non-ignored samples (the count
    without weights), 0 when every sample is ignored. log_prob has scores' shape; with
    return_log_prob=False it is not computed (None) and the kernel never writes it.
    Out-of-range labels: NaN, see the module docstring.
    """,
    matrix=Matrix(_make_loss, attrs=_IGNORE_1, grad=(0, 2)))

softmax_cross_entropy_loss_internal = define(
    "softmax_cross_entropy_loss_internal", ort=(_MS, "SoftmaxCrossEntropyLossInternal"),
    inputs=("scores: float", "labels: index", "weights?: float", "ignore_index?: index"),
    outputs=("output", "log_prob"), attrs={"reduction": "mean", "output_type": None},
    check=_check_internal, kernel=_internal_kernel, reference=_internal_reference,
    doc="""com.microsoft SoftmaxCrossEntropyLossInternal -> (output, log_prob).

    SoftmaxCrossEntropyLoss with ignore_index an optional int64 scalar INPUT (it may be a
    traced value) and both outputs cast to `output_type` (an ONNX TensorProto float type:
    1 f32, 10 f16, 11 f64, 16 bf16; default: the scores' dtype).
    """,
    matrix=Matrix(_make_internal, attrs=_NONE, grad=(0, 2)))

softmax_cross_entropy_loss_grad = define(
    "softmax_cross_entropy_loss_grad", ort=(_MS, "SoftmaxCrossEntropyLossGrad"),
    inputs=("dY: float", "log_prob: float", "label: index", "weight?: float"),
    outputs=("d_logits",), attrs={"reduction": "mean", "ignore_index": None},
    check=_check_loss_grad, kernel=_loss_grad_kernel, reference=_loss_grad_reference,
    doc="""com.microsoft SoftmaxCrossEntropyLossGrad -> d_logits, log_prob's shape and dtype.

    d[i, c, ..] = g_i * (exp(log_prob[i, c, ..]) - [c == l_i]) with g_i = dY * w[l_i] / the
    weight sum of non-ignored samples (mean; all zeros when that sum is 0), dY * w[l_i] (sum),
    dY_i * w[l_i] (none); 0 for ignored samples. dY is a scalar unless reduction is 'none'.
    """,
    matrix=Matrix(_make_loss_grad, attrs=_IGNORE_1, grad=(0, 1, 3)))

softmax_cross_entropy_loss_internal_grad = define(
    "softmax_cross_entropy_loss_internal_grad", ort=(_MS, "SoftmaxCrossEntropyLossInternalGrad"),
    inputs=("dY: float", "log_prob: float", "label: index", "weight?: float",
            "ignore_index?: index", "bias?: float"),
    outputs=("d_logits",), attrs={"reduction": "mean", "output_type": None},
    check=_check_internal_grad, kernel=_internal_grad_kernel,
    reference=_internal_grad_reference,
    doc="""com.microsoft SoftmaxCrossEntropyLossInternalGrad -> d_logits.

    SoftmaxCrossEntropyLossGrad with ignore_index an optional int64 scalar input, an optional
    `bias` (log_prob's shape, the output dtype) added to the result in the same pass, and the
    result cast to `output_type` (ONNX float type; default log_prob's dtype).
    """,
    matrix=Matrix(_make_internal_grad, attrs=_NONE, grad=(0, 1, 3, 5)))

sparse_softmax_cross_entropy = define(
    "sparse_softmax_cross_entropy", ort=("", "SparseSoftmaxCrossEntropy"),
    inputs=("logits: float", "label: index", "weight?: float"), outputs=("Y", "log_prob"),
    attrs={"reduction": "mean"}, options={"return_log_prob": True},
    check=lambda logits, label, weight, *, reduction, return_log_prob: _check_sparse(
        logits, label, weight, reduction),
    kernel=_sparse_kernel, reference=_sparse_reference,
    doc="""ORT SparseSoftmaxCrossEntropy (ONNX domain, opset 9) -> (Y, log_prob).

    logits [..., C], label int [...], weight per SAMPLE (label's shape). loss_i =
    -log_softmax(logits)[i, l_i]; mean: sum w_i loss_i / sum w_i (/ count without weight;
    NaN when the weights sum to 0, as ORT); sum: sum w_i loss_i; none: w_i loss_i, label's
    shape as ORT's schema says (ORT 1.19.2's CPU kernel returns the sum there instead; graphs
    type that output by the schema, so the schema is followed). No ignore_index.
    """,
    matrix=Matrix(_make_sparse, attrs=_NONE, grad=(0, 2)))

sparse_softmax_cross_entropy_grad = define(
    "sparse_softmax_cross_entropy_grad", ort=("", "SparseSoftmaxCrossEntropyGrad"),
    inputs=("dY: float", "log_prob: float", "label: index", "weight?: float"),
    outputs=("d_logits",), attrs={"reduction": "mean"}, check=_check_sparse_grad,
    kernel=_sparse_grad_kernel, reference=_sparse_grad_reference,
    doc="""ORT SparseSoftmaxCrossEntropyGrad (ONNX domain, opset 9) -> d_logits.

    d[i, c] = dY * w_i * (exp(log_prob[i, c]) - [c == l_i]) / (sum w for mean (count without
    weight), 1 for sum); for 'none' dY has label's shape and scales each sample.
    """,
    matrix=Matrix(_make_sparse_grad, attrs=_NONE, grad=(0, 1, 3)))

softmax_cross_entropy = define(
    "softmax_cross_entropy", ort=(_MS, "SoftmaxCrossEntropy"),
    inputs=("logits: float", "label: float"), outputs=("Y", "log_prob"),
    attrs={"reduction": "mean"}, check=_check_soft, reference=ref.softmax_cross_entropy,
    doc="""com.microsoft SoftmaxCrossEntropy -> (Y, log_prob), soft labels, classes last.

    loss_i = -sum_c label[i, c] * log_softmax(logits)[i, c]; mean divides by the row count,
    none gives label.shape[:-1]. Plain XLA code (no kernel: a legacy forward op that
    generate_artifacts does not emit).
    """,
    matrix=Matrix(_make_soft, attrs=_NONE, grad=(0, 1)))

softmax_cross_entropy_grad = define(
    "softmax_cross_entropy_grad", ort=(_MS, "SoftmaxCrossEntropyGrad"),
    inputs=("dY: float", "log_prob: float", "label: float"), outputs=("d_logits",),
    attrs={"reduction": "mean"}, check=_check_soft_grad, reference=_soft_grad,
    doc="""com.microsoft SoftmaxCrossEntropyGrad: dY * (exp(log_prob) - label) / (rows if mean).
    Plain XLA code.""",
    matrix=Matrix(_make_soft_grad, attrs=_NONE, grad=(0, 1, 2)))


__all__ = ["softmax_cross_entropy", "softmax_cross_entropy_grad", "softmax_cross_entropy_loss",
           "softmax_cross_entropy_loss_grad", "softmax_cross_entropy_loss_internal",
           "softmax_cross_entropy_loss_internal_grad", "sparse_softmax_cross_entropy",
           "sparse_softmax_cross_entropy_grad"]
