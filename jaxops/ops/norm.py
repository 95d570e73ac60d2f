"""LayerNormalizationGrad, SimplifiedLayerNormalizationGrad, InvertibleLayerNormalizationGrad,
BatchNormalizationGrad and BatchNormInternal (com.microsoft).

Dtypes follow ORT's type constraints. Layer norms: dY and scale (and bias) share V, X has T,
mean/inv_std have U in {f32, f64}; X_grad is T, scale_grad/bias_grad are V. Batch norm: dY and X
share T, scale (and B) have T1, mean/var T2; X_grad T, scale_grad/bias_grad T1; BatchNormInternal's
statistics outputs T2. float64 goes only with float64 everywhere; f16/bf16 compute in f32.

The kernels take the big operands in one dtype and the small ones in the accumulation dtype, so
the functions here cast the small operands (and, for a mixed dY/X pair, the narrower of the two
up, which is exact) before the call and the reduced outputs after it. scale_grad/bias_grad are
column sums over the rows; both platforms sum in a fixed order (deterministic, no atomics).

Differentiation: every op differentiates through its pure-JAX reference (jaxops.reference.norm),
so gradients of any order exist.
"""
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops.reference import norm as ref

_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
_STATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


# ------------------------------------------------------------------------------------------
# The kernel ops: operands as the cores in jaxops.reference.norm take them


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _core_check(big, small, big_shape, small_shapes):
    for b in big:
        if b.dtype not in _FLOATS:
            raise TypeError(f"expected float operands, got {b.dtype}")
        if b.dtype != big[0].dtype or b.shape != tuple(big_shape):
            raise ValueError("dY and X must share one dtype and shape")
    a = jnp.dtype(ref.acc_dtype(big[0].dtype))
    for s, shape in zip(small, small_shapes):
        if s.dtype != a or s.shape != tuple(shape):
            raise ValueError(f"expected a {a} operand of shape {tuple(shape)}, got {s.dtype}"
                             f"{tuple(s.shape)}")


def _ln_shape(mode):
    def shape(*args, axis, batch):
        dy, x, scale = args[:3]
        a = ref.acc_dtype(x.dtype)
        feat, rows = x.shape[:batch] + x.shape[axis:], x.shape[:axis]
        small_shapes = {ref.LAYER: [feat, rows, rows], ref.SIMPLIFIED: [feat, rows],
                        ref.INVERTIBLE: [feat, feat, rows]}[mode]
        _core_check([dy, x], args[2:], x.shape, small_shapes)
        outs = [_struct(x.shape, x.dtype), _struct(feat, a)]
        return tuple(outs if mode == ref.SIMPLIFIED else outs + [_struct(feat, a)])
    return shape


def _ln_reference(mode):
    def reference(*args, axis, batch):
        dy, x, scale = args[:3]
        bias = args[3] if mode == ref.INVERTIBLE else None
        mean = args[3] if mode == ref.LAYER else None
        outs = ref.ln_grad_core(mode, dy, x, scale, bias, mean, args[-1], axis=axis, batch=batch)
        return outs[:2] if mode == ref.SIMPLIFIED else outs
    return reference


def _ln_factors(mode):
    def factors(*args, axis, batch):
        x = args[1]
        g = tuple(f"g{i}" for i in range(batch))
        r = tuple(f"r{i}" for i in range(batch, axis))
        c = tuple(f"c{i}" for i in range(axis, x.ndim))
        small = {ref.LAYER: [g + c, g + r, g + r], ref.SIMPLIFIED: [g + c, g + r],
                 ref.INVERTIBLE: [g + c, g + c, g + r]}[mode]
        results = (g + r + c, g + c) + (() if mode == ref.SIMPLIFIED else (g + c,))
        return Factors((g + r + c, g + r + c, *small), results, replicated=c, summed=r)
    return factors


def _ln_batch(op, args, dims, *, axis, batch):
    args = batch_at_front(args, dims)
    outs = op.bind(*args, axis=axis + 1, batch=batch + 1)
    return outs, [0] * len(outs)


def _ln_attrs(*args, axis, batch):
    return {"axis": np.int64(axis), "batch": np.int64(batch)}


def _ln_op(name, mode):
    return Op(name, shape=_ln_shape(mode), reference=_ln_reference(mode), batch=_ln_batch,
              target=f"jaxops_{name}", ffi_attrs=_ln_attrs, factors=_ln_factors(mode),
              multiple_results=True)


_LAYER = _ln_op("layer_normalization_grad", ref.LAYER)
_SIMPLIFIED = _ln_op("simplified_layer_normalization_grad", ref.SIMPLIFIED)
_INVERTIBLE = _ln_op("invertible_layer_normalization_grad", ref.INVERTIBLE)
_LN_OPS = {ref.LAYER: _LAYER, ref.SIMPLIFIED: _SIMPLIFIED, ref.INVERTIBLE: _INVERTIBLE}


# The tangent maps of jaxops.nn.layer_norm / rms_norm: operands (tx, ts[, tb], x, scale[, mean],
# inv) in the kernels' layout, linear in the leading tangents. XLA code (forward mode only);
# the transpose is the gradient kernel, one call giving every cotangent.
def _jvp_n(mode):
    return 2 if mode == ref.SIMPLIFIED else 3


def _ln_jvp_shape(mode):
    grad_shape = _ln_shape(mode)

    def shape(*args, axis, batch):
        n = _jvp_n(mode)
        tangents, primals = args[:n], args[n:]
        grad_shape(tangents[0], *primals, axis=axis, batch=batch)  # dy = tx: the kernel's checks
        for t, like in zip(tangents, (primals[0], primals[1], primals[1])):
            if t.dtype != like.dtype or t.shape != like.shape:
                raise TypeError(f"tangent {t.dtype}{t.shape} must be {like.dtype}{like.shape}")
        return _struct(primals[0].shape, primals[0].dtype)
    return shape


def _ln_jvp_reference(mode):
    def reference(*args, axis, batch):
        n = _jvp_n(mode)
        (tx, ts, *tb), (x, scale, *stats) = args[:n], args[n:]
        mean = stats[0] if mode == ref.LAYER else None
        return ref.ln_jvp_core(mode, tx, ts, tb[0] if tb else None, x, scale, mean, stats[-1],
                               axis=axis, batch=batch)
    return reference


def _ln_jvp_transpose(mode):
    def transpose(op, ct, *args, axis, batch):
        n = _jvp_n(mode)
        if any(is_undefined(a) for a in args[n:]):
            raise NotImplementedError(f"{op.name} is linear in its tangent operands only")
        if is_zero(ct):
            return (None,) * len(args)
        grads = _LN_OPS[mode](ct, *args[n:], axis=axis, batch=batch)
        # a tangent passed as a (zero) constant gets no cotangent
        return tuple(g if is_undefined(a) else None for g, a in zip(grads, args[:n])) + \
            (None,) * (len(args) - n)
    return transpose


def _ln_jvp_batch(op, args, dims, *, axis, batch):
    return op.bind(*batch_at_front(args, dims), axis=axis + 1, batch=batch + 1), 0


_LN_JVPS = {mode: Op(f"{name}_jvp", shape=_ln_jvp_shape(mode),
                     reference=_ln_jvp_reference(mode), batch=_ln_jvp_batch,
                     impl=_ln_jvp_reference(mode), transpose=_ln_jvp_transpose(mode))
            for mode, name in ((ref.LAYER, "layer_norm"), (ref.SIMPLIFIED, "rms_norm"))}


def _bn_small_shape(x, batch):
    return x.shape[:batch] + (x.shape[batch + 1],)


def _bn_factors(n_big, n_small, n_out_big, n_out_small):
    def factors(*args, batch, **params):
        x = args[0] if n_big == 1 else args[1]
        g = tuple(f"g{i}" for i in range(batch))
        n, c = "n", "c"
        s = tuple(f"s{i}" for i in range(batch + 2, x.ndim))
        big, small = g + (n, c) + s, g + (c,)
        return Factors((big,) * n_big + (small,) * n_small,
                       (big,) * n_out_big + (small,) * n_out_small,
                       replicated=(n,) + s)
    return factors


def _bn_grad_shape(dy, x, scale, mean, inv, *, batch):
    if x.ndim < batch + 2:
        raise ValueError("X must have rank >= 2 (N, C, ...)")
    small = _bn_small_shape(x, batch)
    _core_check([dy, x], [scale, mean, inv], x.shape, [small] * 3)
    a = ref.acc_dtype(x.dtype)
    return _struct(x.shape, x.dtype), _struct(small, a), _struct(small, a)


def _bn_train_shape(x, scale, b, in_mean, in_var, *, batch, epsilon, momentum):
    if x.ndim < batch + 2:
        raise ValueError("X must have rank >= 2 (N, C, ...)")
    small = _bn_small_shape(x, batch)
    _core_check([x], [scale, b, in_mean, in_var], x.shape, [small] * 4)
    a = ref.acc_dtype(x.dtype)
    return (_struct(x.shape, x.dtype),) + (_struct(small, a),) * 4


def _bn_batch(op, args, dims, *, batch, **params):
    args = batch_at_front(args, dims)
    outs = op.bind(*args, batch=batch + 1, **params)
    return outs, [0] * len(outs)


_BN_GRAD = Op("batch_normalization_grad", shape=_bn_grad_shape,
              reference=lambda *a, batch: ref.bn_grad_core(*a, batch=batch), batch=_bn_batch,
              target="jaxops_batch_normalization_grad",
              ffi_attrs=lambda *a, batch: {"batch": np.int64(batch)},
              factors=_bn_factors(2, 3, 1, 2), multiple_results=True)
_BN_TRAIN = Op("batch_norm_internal", shape=_bn_train_shape,
               reference=lambda *a, **p: ref.bn_train_core(*a, **p), batch=_bn_batch,
               target="jaxops_batch_norm_internal",
               ffi_attrs=lambda *a, batch, epsilon, momentum: {
                   "batch": np.int64(batch), "epsilon": np.float32(epsilon),
                   "momentum": np.float32(momentum)},
               factors=_bn_factors(1, 4, 1, 4), multiple_results=True)


# ------------------------------------------------------------------------------------------
# Validation of ORT's operands (errors name the ORT op)


def _fail(name, error, msg):
    raise error(f"jaxops.ops.{name}: {msg}")


def _arrays(name, labels, values):
    out = []
    for label, v in zip(labels, values):
        if v is None:
            _fail(name, TypeError, f"{label} is required")
        v = jnp.asarray(v)
        if v.dtype not in _FLOATS:
            _fail(name, TypeError, f"{label} must be float16, bfloat16, float32 or float64, "
                                   f"got {v.dtype}")
        out.append(v)
    f64 = [jnp.dtype(v.dtype) == jnp.float64 for v in out]
    if any(f64) and not all(f64):
        _fail(name, TypeError, "float64 operands must all be float64, got "
                               + ", ".join(f"{l}={v.dtype}" for l, v in zip(labels, out)))
    return out


def _same(name, labels, values, what):
    first = values[0]
    for label, v in zip(labels[1:], values[1:]):
        if getattr(v, what) != getattr(first, what):
            err = TypeError if what == "dtype" else ValueError
            _fail(name, err, f"{labels[0]} and {label} must share one {what}, got "
                             f"{getattr(first, what)} and {getattr(v, what)}")


def _axis(name, axis, ndim):
    try:
        axis = operator.index(axis)
    except TypeError:
        _fail(name, TypeError, f"axis must be an int, got {axis!r}")
    if ndim == 0:
        _fail(name, ValueError, "X must have rank >= 1, got a scalar")
    if not -ndim <= axis < ndim:
        _fail(name, ValueError, f"axis {axis} is out of range for rank {ndim}")
    return axis % ndim


def _check_ln(name, labels, args, axis):
    """labels/args: dY, X (or Y), then V-typed operands (scale, [bias]), then U-typed stats."""
    args = _arrays(name, labels, args)
    dy, x = args[:2]
    n_v = 2 if "bias" in labels else 1
    v_labels = [labels[0]] + list(labels[2:2 + n_v])
    _same(name, v_labels, [dy] + args[2:2 + n_v], "dtype")
    if name == "invertible_layer_normalization_grad":
        _same(name, labels[:2], [dy, x], "dtype")
    _same(name, labels[:2], [dy, x], "shape")
    axis = _axis(name, axis, x.ndim)
    stats = args[2 + n_v:]
    for label, s in zip(labels[2 + n_v:], stats):
        if s.dtype not in _STATS:
            _fail(name, TypeError, f"{label} must be float32 or float64, got {s.dtype}")
    n, m = math.prod(x.shape[axis:]), math.prod(x.shape[:axis])
    for label, v in zip(labels[2:2 + n_v], args[2:2 + n_v]):
        if v.size != n:
            _fail(name, ValueError, f"{label} must hold {n} values (X.shape[{axis}:] = "
                                    f"{x.shape[axis:]}), got shape {v.shape}")
    for label, s in zip(labels[2 + n_v:], stats):
        if s.size != m:
            _fail(name, ValueError, f"{label} must hold {m} values (one per row of "
                                    f"X.shape[:{axis}] = {x.shape[:axis]}), got shape {s.shape}")
    return args, axis


def _check_bn(name, big_labels, big, t1_labels, t1, t2_labels, t2):
    args = _arrays(name, big_labels + t1_labels + t2_labels, big + t1 + t2)
    big, t1, t2 = args[:len(big)], args[len(big):len(big) + len(t1)], args[len(big) + len(t1):]
    _same(name, big_labels, big, "dtype")
    _same(name, big_labels, big, "shape")
    _same(name, t1_labels, t1, "dtype")
    _same(name, t2_labels, t2, "dtype")
    x = big[-1]
    if x.ndim < 2:
        _fail(name, ValueError, f"X must have rank >= 2 (N, C, ...), got shape {x.shape}")
    c = x.shape[1]
    for label, v in zip(t1_labels + t2_labels, t1 + t2):
        if v.shape != (c,):
            _fail(name, ValueError, f"{label} must have shape ({c},) (X's channels), got {v.shape}")
    return big, t1, t2


# ------------------------------------------------------------------------------------------
# The ORT ops


def ln_grad(mode, dy, x, scale, bias, mean, inv, axis):
    """Any-dtype entry used by jaxops.nn: casts around the kernel as the ORT ops do."""
    dy_, x_, s, b, m, i, axis = ref.prepare_ln(dy, x, scale, bias, mean, inv, axis)
    args = {ref.LAYER: (dy_, x_, s, m, i), ref.SIMPLIFIED: (dy_, x_, s, i),
            ref.INVERTIBLE: (dy_, x_, s, b, i)}[mode]
    outs = tuple(_LN_OPS[mode](*args, axis=axis, batch=0))
    return ref.finish_ln(outs + (None,) * (3 - len(outs)), x.dtype, scale)


def ln_jvp(mode, tx, ts, tb, x, scale, mean, inv, axis):
    """Tangent of jaxops.nn's layer_norm (mode LAYER) / rms_norm (SIMPLIFIED, tb None) at
    (x, scale) with the forward's mean and inv (any shape of one value per row), along
    (tx, ts, tb); tb None with LAYER: a layer without bias. Its transpose is one
    LayerNormalizationGrad / SimplifiedLayerNormalizationGrad call."""
    axis = axis % x.ndim
    a = ref.acc_dtype(x.dtype)
    feat, rows = x.shape[axis:], x.shape[:axis]
    small = lambda v, shape: v.astype(a).reshape(shape)
    tangents = [tx.astype(x.dtype), small(ts, feat)]
    stats = [small(inv, rows)]
    if mode == ref.LAYER:
        tangents.append(jnp.zeros(feat, a) if tb is None else small(tb, feat))
        stats.insert(0, small(mean, rows))
    return _LN_JVPS[mode](*tangents, x, small(scale, feat), *stats, axis=axis, batch=0)


def layer_normalization_grad(Y_grad, X, scale, mean, inv_std_dev, axis=-1, epsilon=None,
                             stash_type=None):
    """ORT LayerNormalizationGrad -> (X_grad, scale_grad, bias_grad).

    `epsilon` and `stash_type` are accepted and ignored: ORT's gradient builder copies them
    from the forward node, the kernel does not read them.

    X is normalised over its dims from `axis` on; mean and inv_std_dev hold one value per row
    (LayerNormalization's outputs 1 and 2, any shape of that size). With xhat = (X - mean) *
    inv_std and B = Y_grad * scale * inv_std: X_grad = B - mean_row(B) - xhat * mean_row(B * xhat),
    scale_grad = sum_rows(Y_grad * xhat), bias_grad = sum_rows(Y_grad).
    """
    name = "layer_normalization_grad"
    (dy, x, s, m, i), axis = _check_ln(name, ["Y_grad", "X", "scale", "mean", "inv_std_dev"],
                                       [Y_grad, X, scale, mean, inv_std_dev], axis)
    return ln_grad(ref.LAYER, dy, x, s, None, m, i, axis)


def simplified_layer_normalization_grad(Y_grad, X, scale, inv_std_var, axis=-1, epsilon=None,
                                        stash_type=None):
    """ORT SimplifiedLayerNormalizationGrad (RMSNorm) -> (X_grad, scale_grad).

    `epsilon` and `stash_type` (copied by ORT's gradient builder) are ignored.

    xhat = X * inv_std_var; B = Y_grad * scale * inv_std_var; X_grad = B - xhat * mean_row(B * xhat);
    scale_grad = sum_rows(Y_grad * xhat).
    """
    name = "simplified_layer_normalization_grad"
    (dy, x, s, i), axis = _check_ln(name, ["Y_grad", "X", "scale", "inv_std_var"],
                                    [Y_grad, X, scale, inv_std_var], axis)
    return ln_grad(ref.SIMPLIFIED, dy, x, s, None, None, i, axis)[:2]


def invertible_layer_normalization_grad(Y_grad, Y, scale, bias, inv_std_var, axis=-1):
    """ORT InvertibleLayerNormalizationGrad -> (X_grad, scale_grad, bias_grad).

    LayerNormalizationGrad with xhat reconstructed from the forward OUTPUT: (Y - bias) / scale
    (a zero scale gives inf/nan, as in ORT). X_grad has Y's dtype (ORT leaves it to the graph).
    """
    name = "invertible_layer_normalization_grad"
    (dy, y, s, b, i), axis = _check_ln(name, ["Y_grad", "Y", "scale", "bias", "inv_std_var"],
                                       [Y_grad, Y, scale, bias, inv_std_var], axis)
    return ln_grad(ref.INVERTIBLE, dy, y, s, b, None, i, axis)


def batch_normalization_grad(dY, X, scale, mean, variance, epsilon=None):
    """ORT BatchNormalizationGrad -> (X_grad, scale_grad, bias_grad), channel axis 1.

    `variance` must be the saved INVERSE std (BatchNormInternal output 4), which is what ORT's
    kernel reads despite the name; `epsilon` (required by ORT's schema) is therefore unused.
    m = N * prod(spatial), xhat = (X - mean) * inv_std: bias_grad = sum(dY), scale_grad =
    sum(dY * xhat), X_grad = scale * inv_std * (dY - bias_grad / m - xhat * scale_grad / m).
    """
    name = "batch_normalization_grad"
    (dy, x), (s,), (m, i) = _check_bn(name, ["dY", "X"], [dY, X], ["scale"], [scale],
                                      ["mean", "variance"], [mean, variance])
    (dy_, x_), small = ref.prepare_bn([dy, x], [s, m, i])
    dx, ds, db = _BN_GRAD(dy_, x_, *small, batch=0)
    return dx.astype(x.dtype), ds.astype(s.dtype), db.astype(s.dtype)


def batch_norm_internal(X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                        training_mode=1):
    """ORT BatchNormInternal -> (Y, running_mean, running_var, saved_mean, saved_inv_std).

    training_mode=1: statistics over N and the spatial dims, var biased; inv_std =
    1 / sqrt(var + epsilon); Y = scale * (X - mean) * inv_std + B; running_mean =
    momentum * input_mean + (1 - momentum) * mean, running_var likewise with var (ORT's CPU
    kernel uses the biased variance here too). training_mode=0: Y from input_mean/input_var
    (plain XLA) and the other four outputs None.
    """
    name = "batch_norm_internal"
    (x,), (s, b), (m, v) = _check_bn(name, ["X"], [X], ["scale", "B"], [scale, B],
                                     ["input_mean", "input_var"], [input_mean, input_var])
    if not training_mode:
        return ref.batch_norm_internal(x, s, b, m, v, epsilon, momentum, training_mode=0)
    (x_,), small = ref.prepare_bn([x], [s, b, m, v])
    y, rm, rv, sm, si = _BN_TRAIN(x_, *small, batch=0, epsilon=float(epsilon),
                                  momentum=float(momentum))
    t2 = m.dtype
    return y.astype(x.dtype), rm.astype(t2), rv.astype(t2), sm.astype(t2), si.astype(t2)


__all__ = ["batch_norm_internal", "batch_normalization_grad", "invertible_layer_normalization_grad",
           "layer_normalization_grad", "simplified_layer_normalization_grad"]

ORT_OPS = {
    ("com.microsoft", "LayerNormalizationGrad"): layer_normalization_grad,
    ("com.microsoft", "SimplifiedLayerNormalizationGrad"): simplified_layer_normalization_grad,
    ("com.microsoft", "InvertibleLayerNormalizationGrad"): invertible_layer_normalization_grad,
    ("com.microsoft", "BatchNormalizationGrad"): batch_normalization_grad,
    ("com.microsoft", "BatchNormInternal"): batch_norm_internal,
}
