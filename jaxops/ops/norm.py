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

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero
from jaxops._src.spec import REQUIRED, Matrix, define
from jaxops.reference import norm as ref

_STATS = (np.dtype(np.float32), np.dtype(np.float64))


# ------------------------------------------------------------------------------------------
# The kernel ops: operands as the cores in jaxops.reference.norm take them


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _core_check(big, small, big_shape, small_shapes):
    for b in big:
        if np.dtype(b.dtype) not in rules.FLOATS:
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
              factors=_bn_factors(2, 3, 1, 2), multiple_results=True,
              # H100, bf16 [64,256,28,28]: XLA 49.1 us against the kernel's 151.0
              # (docs/performance.md); the CPU kernel stays
              xla_when=lambda platform, *avals, batch: platform == "cuda")
_BN_TRAIN = Op("batch_norm_internal", shape=_bn_train_shape,
               reference=lambda *a, **p: ref.bn_train_core(*a, **p), batch=_bn_batch,
               target="jaxops_batch_norm_internal",
               ffi_attrs=lambda *a, batch, epsilon, momentum: {
                   "batch": np.int64(batch), "epsilon": np.float32(epsilon),
                   "momentum": np.float32(momentum)},
               factors=_bn_factors(1, 4, 1, 4), multiple_results=True)


# ------------------------------------------------------------------------------------------
# Argument rules of ORT's operands (plain messages: the public functions prefix the op's name)


def _float64_all_or_none(arrays):
    f64 = [np.dtype(v.dtype) == np.float64 for v in arrays.values()]
    if any(f64) and not all(f64):
        raise TypeError("float64 operands must all be float64, got "
                        + ", ".join(f"{label}={v.dtype}" for label, v in arrays.items()))


def _ln_check(names, n_v, same_xy=False):
    """LayerNorm grads' rules. names: ORT's input names, dY then X (or Y), then the n_v
    V-typed operands (scale[, bias]), then the U-typed statistics."""
    v_names, stat_names = names[2:2 + n_v], names[2 + n_v:]

    def check(*args, axis, **ignored):
        arrays = dict(zip(names, args))
        _float64_all_or_none(arrays)
        dy, x = args[:2]
        rules.same_dtype(**{n: arrays[n] for n in (names[0], *v_names)})
        if same_xy:
            rules.same_dtype(**{n: arrays[n] for n in names[:2]})
        rules.same_shape(**{n: arrays[n] for n in names[:2]})
        if x.ndim == 0:
            raise ValueError(f"{names[1]} must have rank >= 1, got a scalar")
        axis = rules.axis(axis, x.ndim)
        for label in stat_names:
            if np.dtype(arrays[label].dtype) not in _STATS:
                raise TypeError(f"{label} must be float32 or float64, got {arrays[label].dtype}")
        n, m = math.prod(x.shape[axis:]), math.prod(x.shape[:axis])
        for label in v_names:
            if arrays[label].size != n:
                raise ValueError(f"{label} must hold {n} values (X.shape[{axis}:] = "
                                 f"{x.shape[axis:]}), got shape {arrays[label].shape}")
        for label in stat_names:
            if arrays[label].size != m:
                raise ValueError(f"{label} must hold {m} values (one per row of X.shape[:{axis}] "
                                 f"= {x.shape[:axis]}), got shape {arrays[label].shape}")
    return check


def _bn_check(big, t1, t2):
    """BatchNorm rules: big (T: dY, X) share dtype and shape, T1 (scale[, B]) and T2 (the
    statistics) share a dtype each and hold one value per channel (X's dim 1)."""
    names = big + t1 + t2

    def check(*args, epsilon, **attrs):
        arrays = dict(zip(names, args))
        _float64_all_or_none(arrays)
        for group in (big, t1, t2):
            rules.same_dtype(**{n: arrays[n] for n in group})
        rules.same_shape(**{n: arrays[n] for n in big})
        x = arrays["X"]
        if x.ndim < 2:
            raise ValueError(f"X must have rank >= 2 (N, C, ...), got shape {x.shape}")
        c = x.shape[1]
        for label in t1 + t2:
            if arrays[label].shape != (c,):
                raise ValueError(f"{label} must have shape ({c},) (X's channels), got "
                                 f"{arrays[label].shape}")
        rules.number("epsilon", epsilon)
        for label in ("momentum", "training_mode"):
            if label in attrs:
                (rules.number if label == "momentum" else rules.integer)(label, attrs[label])
    return check


# ------------------------------------------------------------------------------------------
# The kernel paths (the spec has checked the operands and read JAXOPS_DISABLE)


def _ln_kernel(mode):
    def kernel(*args, axis, **ignored):
        dy, x, scale = args[:3]
        bias = args[3] if mode == ref.INVERTIBLE else None
        mean = args[3] if mode == ref.LAYER else None
        dy_, x_, s, b, m, i, axis = ref.prepare_ln(dy, x, scale, bias, mean, args[-1], axis)
        operands = {ref.LAYER: (dy_, x_, s, m, i), ref.SIMPLIFIED: (dy_, x_, s, i),
                    ref.INVERTIBLE: (dy_, x_, s, b, i)}[mode]
        outs = tuple(_LN_OPS[mode].bind(*operands, axis=axis, batch=0))
        outs = ref.finish_ln(outs + (None,) * (3 - len(outs)), x.dtype, scale)
        return outs[:2] if mode == ref.SIMPLIFIED else outs
    return kernel


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


def _bn_grad_kernel(dY, X, scale, mean, variance, *, epsilon):
    (dy, x), small = ref.prepare_bn([dY, X], [scale, mean, variance])
    dx, ds, db = _BN_GRAD.bind(dy, x, *small, batch=0)
    return dx.astype(X.dtype), ds.astype(scale.dtype), db.astype(scale.dtype)


def _bn_internal_kernel(X, scale, B, input_mean, input_var, *, epsilon, momentum,
                        training_mode):
    if not training_mode:
        return ref.batch_norm_internal(X, scale, B, input_mean, input_var, epsilon, momentum,
                                       training_mode=0)
    (x,), small = ref.prepare_bn([X], [scale, B, input_mean, input_var])
    y, rm, rv, sm, si = _BN_TRAIN.bind(x, *small, batch=0, epsilon=float(epsilon),
                                       momentum=float(momentum))
    t2 = input_mean.dtype
    return y.astype(X.dtype), rm.astype(t2), rv.astype(t2), sm.astype(t2), si.astype(t2)


# ------------------------------------------------------------------------------------------
# The ORT ops. Matrix rows: X [N, C] normalised over C (axis -1: rows on dim 0, which shard),
# statistics one per row; batch norms X [N, C, 4] (8+ samples a channel keep the variance off 0).


def _stats_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _make_ln(mode):
    def make(rng, shape, dtype):
        rows, feat = shape[:-1], shape[-1:]
        big = lambda: jnp.asarray(rng.standard_normal(shape), dtype)
        scale = jnp.asarray(rng.uniform(0.5, 1.5, feat) * rng.choice([-1, 1], feat), dtype)
        mean = jnp.asarray(rng.standard_normal(rows) * 0.3, _stats_dtype(dtype))
        inv = jnp.asarray(rng.uniform(0.5, 1.5, rows), _stats_dtype(dtype))
        if mode == ref.LAYER:
            return big(), big(), scale, mean, inv
        if mode == ref.SIMPLIFIED:
            return big(), big(), scale, inv
        return big(), big(), scale, jnp.asarray(rng.standard_normal(feat), dtype), inv
    return make


def _make_bn(train):
    def make(rng, shape, dtype):
        c = shape[1]
        full = tuple(shape) + (4,)
        x = jnp.asarray(rng.standard_normal(full) * 2 + 0.5, dtype)
        per = lambda v: jnp.asarray(v, dtype)
        scale = per(rng.uniform(0.5, 1.5, c))
        if train:
            return (x, scale, per(rng.standard_normal(c)), per(rng.standard_normal(c)),
                    per(rng.uniform(0.5, 2, c)))
        return (per(rng.standard_normal(full)), x, scale, per(rng.standard_normal(c) * 0.3),
                per(rng.uniform(0.5, 1.5, c)))
    return make


_MS = "com.microsoft"
_ROWS = {"axis": -1}
_BN_SHARD = ("batch norm reduces over N (dim 0) and the spatial dims: its kernels need them "
             "whole (channel sharding: tests/test_norm.py)")

layer_normalization_grad = define(
    "layer_normalization_grad", ort=(_MS, "LayerNormalizationGrad"),
    inputs=("Y_grad: float", "X: float", "scale: float", "mean: float", "inv_std_dev: float"),
    outputs=("X_grad", "scale_grad", "bias_grad"),
    attrs={"axis": -1, "epsilon": None, "stash_type": None},
    check=_ln_check(("Y_grad", "X", "scale", "mean", "inv_std_dev"), 1),
    kernel=_ln_kernel(ref.LAYER),
    reference=lambda dy, x, scale, mean, inv, *, axis, **ignored:
        ref.layer_normalization_grad(dy, x, scale, mean, inv, axis),
    doc="""ORT LayerNormalizationGrad -> (X_grad, scale_grad, bias_grad).

    `epsilon` and `stash_type` are accepted and ignored: ORT's gradient builder copies them
    from the forward node, the kernel does not read them.

    X is normalised over its dims from `axis` on; mean and inv_std_dev hold one value per row
    (LayerNormalization's outputs 1 and 2, any shape of that size). With xhat = (X - mean) *
    inv_std and B = Y_grad * scale * inv_std: X_grad = B - mean_row(B) - xhat * mean_row(B * xhat),
    scale_grad = sum_rows(Y_grad * xhat), bias_grad = sum_rows(Y_grad).
    """,
    matrix=Matrix(_make_ln(ref.LAYER), attrs=_ROWS, grad=(0, 1, 2, 3, 4)))

simplified_layer_normalization_grad = define(
    "simplified_layer_normalization_grad", ort=(_MS, "SimplifiedLayerNormalizationGrad"),
    inputs=("Y_grad: float", "X: float", "scale: float", "inv_std_var: float"),
    outputs=("X_grad", "scale_grad"), attrs={"axis": -1, "epsilon": None, "stash_type": None},
    check=_ln_check(("Y_grad", "X", "scale", "inv_std_var"), 1),
    kernel=_ln_kernel(ref.SIMPLIFIED),
    reference=lambda dy, x, scale, inv, *, axis, **ignored:
        ref.simplified_layer_normalization_grad(dy, x, scale, inv, axis),
    doc="""ORT SimplifiedLayerNormalizationGrad (RMSNorm) -> (X_grad, scale_grad).

    `epsilon` and `stash_type` (copied by ORT's gradient builder) are ignored.

    xhat = X * inv_std_var; B = Y_grad * scale * inv_std_var; X_grad = B - xhat * mean_row(B * xhat);
    scale_grad = sum_rows(Y_grad * xhat).
    """,
    matrix=Matrix(_make_ln(ref.SIMPLIFIED), attrs=_ROWS, grad=(0, 1, 2, 3)))

invertible_layer_normalization_grad = define(
    "invertible_layer_normalization_grad", ort=(_MS, "InvertibleLayerNormalizationGrad"),
    inputs=("Y_grad: float", "Y: float", "scale: float", "bias: float", "inv_std_var: float"),
    outputs=("X_grad", "scale_grad", "bias_grad"), attrs={"axis": -1},
    check=_ln_check(("Y_grad", "Y", "scale", "bias", "inv_std_var"), 2, same_xy=True),
    kernel=_ln_kernel(ref.INVERTIBLE),
    reference=lambda dy, y, scale, bias, inv, *, axis:
        ref.invertible_layer_normalization_grad(dy, y, scale, bias, inv, axis),
    doc="""ORT InvertibleLayerNormalizationGrad -> (X_grad, scale_grad, bias_grad).

    LayerNormalizationGrad with xhat reconstructed from the forward OUTPUT: (Y - bias) / scale
    (a zero scale gives inf/nan, as in ORT). X_grad has Y's dtype (ORT leaves it to the graph).
    """,
    matrix=Matrix(_make_ln(ref.INVERTIBLE), attrs=_ROWS, grad=(0, 1, 2, 3, 4)))

batch_normalization_grad = define(
    "batch_normalization_grad", ort=(_MS, "BatchNormalizationGrad"),
    inputs=("dY: float", "X: float", "scale: float", "mean: float", "variance: float"),
    outputs=("X_grad", "scale_grad", "bias_grad"), attrs={"epsilon": REQUIRED},
    check=_bn_check(("dY", "X"), ("scale",), ("mean", "variance")), kernel=_bn_grad_kernel,
    reference=lambda *args, epsilon: ref.batch_normalization_grad(*args),
    doc="""ORT BatchNormalizationGrad -> (X_grad, scale_grad, bias_grad), channel axis 1.

    `variance` must be the saved INVERSE std (BatchNormInternal output 4), which is what ORT's
    kernel reads despite the name; `epsilon` (required by ORT's schema) is therefore unused.
    m = N * prod(spatial), xhat = (X - mean) * inv_std: bias_grad = sum(dY), scale_grad =
    sum(dY * xhat), X_grad = scale * inv_std * (dY - bias_grad / m - xhat * scale_grad / m).
    """,
    matrix=Matrix(_make_bn(False), attrs={"epsilon": 1e-5}, grad=(0, 1, 2, 3, 4), shard=False,
                  skip=_BN_SHARD))

batch_norm_internal = define(
    "batch_norm_internal", ort=(_MS, "BatchNormInternal"),
    inputs=("X: float", "scale: float", "B: float", "input_mean: float", "input_var: float"),
    outputs=("Y", "running_mean", "running_var", "saved_mean", "saved_inv_std"),
    attrs={"epsilon": 1e-5, "momentum": 0.9, "training_mode": 1},
    check=_bn_check(("X",), ("scale", "B"), ("input_mean", "input_var")),
    kernel=_bn_internal_kernel, reference=ref.batch_norm_internal,
    doc="""ORT BatchNormInternal -> (Y, running_mean, running_var, saved_mean, saved_inv_std).

    training_mode=1: statistics over N and the spatial dims, var biased; inv_std =
    1 / sqrt(var + epsilon); Y = scale * (X - mean) * inv_std + B; running_mean =
    momentum * input_mean + (1 - momentum) * mean, running_var likewise with var (ORT's CPU
    kernel uses the biased variance here too). training_mode=0: Y from input_mean/input_var
    (plain XLA) and the other four outputs None.
    """,
    matrix=Matrix(_make_bn(True), grad=(0, 1, 2, 3, 4), shard=False, skip=_BN_SHARD))


__all__ = ["batch_norm_internal", "batch_normalization_grad", "invertible_layer_normalization_grad",
           "layer_normalization_grad", "simplified_layer_normalization_grad"]
