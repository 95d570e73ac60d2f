"""Pure-JAX normalisation ops: the test oracle and the JAXOPS_DISABLE fallback.

Two layers. The `*_core` functions are what the kernels compute: big operands (dY, X/Y, X_grad)
in one dtype T, small ones (scale, bias, statistics, reduced outputs) in T's accumulation dtype
(f64 for f64, else f32), laid out with `batch` leading group dims (vmap's batch dims):

  layer norms  X [G..., R..., N...] (N = the dims from `axis` on); scale/bias [G..., N...];
               mean/inv_std [G..., R...].
  batch norm   X [G..., n, C, S...]; scale, mean, ... [G..., C].

The ORT-level functions (`layer_normalization_grad`, ...) take ORT's operands and dtypes and
return ORT's: they cast and reshape around the core (`prepare_*`), exactly as jaxops.ops does
around the kernels.
"""
import math

import jax.numpy as jnp

LAYER, SIMPLIFIED, INVERTIBLE = 0, 1, 2


def acc_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _ln_shapes(x_shape, axis, batch):
    g, r, n = x_shape[:batch], x_shape[batch:axis], x_shape[axis:]
    return math.prod(g), math.prod(r), math.prod(n)


def ln_grad_core(mode, dy, x, scale, bias, mean, inv, *, axis, batch):
    """(dX, dscale, dbias) of a layer norm; `x` is Y for the invertible op. dbias is None for
    RMSNorm (SIMPLIFIED)."""
    G, R, N = _ln_shapes(x.shape, axis, batch)
    a = acc_dtype(x.dtype)
    xs, dys = x.astype(a).reshape(G, R, N), dy.astype(a).reshape(G, R, N)
    s = scale.astype(a).reshape(G, 1, N)
    inv = inv.astype(a).reshape(G, R, 1)
    if mode == INVERTIBLE:
        xh = (xs - bias.astype(a).reshape(G, 1, N)) / s
    elif mode == SIMPLIFIED:
        xh = xs * inv
    else:
        xh = (xs - mean.astype(a).reshape(G, R, 1)) * inv
    b = dys * s * inv
    dx = b - xh * jnp.mean(b * xh, axis=-1, keepdims=True)
    if mode != SIMPLIFIED:
        dx = dx - jnp.mean(b, axis=-1, keepdims=True)
    dscale = jnp.sum(dys * xh, axis=1).reshape(scale.shape)
    dbias = None if mode == SIMPLIFIED else jnp.sum(dys, axis=1).reshape(scale.shape)
    return dx.reshape(x.shape).astype(x.dtype), dscale, dbias


def ln_jvp_core(mode, tx, ts, tb, x, scale, mean, inv, *, axis, batch):
    """Tangent of y = xhat * scale (+ bias) along (tx, ts, tb), xhat = (x - mean) * inv
    (x * inv for RMSNorm, which has no tb): scale * inv * (tx [- mean_row(tx)] - xhat *
    mean_row(tx * xhat)) + xhat * ts (+ tb). Linear in (tx, ts, tb); ln_grad_core (the
    gradient kernels) is its transpose."""
    G, R, N = _ln_shapes(x.shape, axis, batch)
    a = acc_dtype(x.dtype)
    xs, t = x.astype(a).reshape(G, R, N), tx.astype(a).reshape(G, R, N)
    inv = inv.astype(a).reshape(G, R, 1)
    xh = xs * inv if mode == SIMPLIFIED else (xs - mean.astype(a).reshape(G, R, 1)) * inv
    dxh = t - xh * jnp.mean(t * xh, axis=-1, keepdims=True)
    if mode != SIMPLIFIED:
        dxh = dxh - jnp.mean(t, axis=-1, keepdims=True)
    row = lambda v: v.astype(a).reshape(G, 1, N)
    dy = row(scale) * inv * dxh + xh * row(ts)
    if mode != SIMPLIFIED:
        dy = dy + row(tb)
    return dy.reshape(x.shape).astype(x.dtype)


def _bn_view(x, batch):
    G = math.prod(x.shape[:batch])
    n, c = x.shape[batch], x.shape[batch + 1]
    S = math.prod(x.shape[batch + 2:])
    return G, n, c, S


def bn_grad_core(dy, x, scale, mean, inv, *, batch):
    G, n, C, S = _bn_view(x, batch)
    a = acc_dtype(x.dtype)
    xs, dys = x.astype(a).reshape(G, n, C, S), dy.astype(a).reshape(G, n, C, S)
    per = lambda v: v.astype(a).reshape(G, 1, C, 1)
    xh = (xs - per(mean)) * per(inv)
    sum_dy = jnp.sum(dys, axis=(1, 3), keepdims=True)
    sum_dyx = jnp.sum(dys * xh, axis=(1, 3), keepdims=True)
    m = n * S
    dx = per(scale) * per(inv) * (dys - sum_dy / m - xh * sum_dyx / m)
    return (dx.reshape(x.shape).astype(x.dtype), sum_dyx.reshape(scale.shape),
            sum_dy.reshape(scale.shape))


def bn_train_core(x, scale, b, in_mean, in_var, *, epsilon, momentum, batch):
    """Training-mode BatchNormInternal: batch statistics (biased variance) and running stats."""
    G, n, C, S = _bn_view(x, batch)
    a = acc_dtype(x.dtype)
    xs = x.astype(a).reshape(G, n, C, S)
    mean = jnp.mean(xs, axis=(1, 3), keepdims=True)
    var = jnp.mean(jnp.square(xs - mean), axis=(1, 3), keepdims=True)
    inv = 1 / jnp.sqrt(var + jnp.asarray(epsilon, jnp.float32).astype(a))
    per = lambda v: v.astype(a).reshape(G, 1, C, 1)
    y = per(scale) * (xs - mean) * inv + per(b)
    mom = jnp.asarray(momentum, jnp.float32).astype(a)
    flat = lambda v: v.reshape(scale.shape)
    return (y.reshape(x.shape).astype(x.dtype), mom * in_mean + (1 - mom) * flat(mean),
            mom * in_var + (1 - mom) * flat(var), flat(mean), flat(inv))


# ------------------------------------------------------------------------------------------
# ORT-level: casts and reshapes around the cores


def prepare_ln(dy, x, scale, bias, mean, inv, axis):
    """The core's operands for ORT's: axis made non-negative, dY and X in one dtype (the wider,
    exact since the core computes in f32 anyway), small operands in the accumulation dtype."""
    axis = axis % x.ndim
    big = jnp.promote_types(dy.dtype, x.dtype)
    a = acc_dtype(big)
    feat, rows = x.shape[axis:], x.shape[:axis]
    small = lambda v, shape: None if v is None else v.astype(a).reshape(shape)
    return (dy.astype(big), x.astype(big), small(scale, feat), small(bias, feat),
            small(mean, rows), small(inv, rows), axis)


def finish_ln(outs, x_dtype, scale):
    dx, dscale, dbias = outs
    cast = lambda v: None if v is None else v.reshape(scale.shape).astype(scale.dtype)
    return dx.astype(x_dtype), cast(dscale), cast(dbias)


def _ln_ort(mode, dy, x, scale, bias, mean, inv, axis):
    dy_, x_, s, b, m, i, axis = prepare_ln(dy, x, scale, bias, mean, inv, axis)
    outs = ln_grad_core(mode, dy_, x_, s, b, m, i, axis=axis, batch=0)
    return finish_ln(outs, x.dtype, scale)


def layer_normalization_grad(Y_grad, X, scale, mean, inv_std_dev, axis=-1):
    return _ln_ort(LAYER, Y_grad, X, scale, None, mean, inv_std_dev, axis)


def simplified_layer_normalization_grad(Y_grad, X, scale, inv_std_var, axis=-1):
    return _ln_ort(SIMPLIFIED, Y_grad, X, scale, None, None, inv_std_var, axis)[:2]


def invertible_layer_normalization_grad(Y_grad, Y, scale, bias, inv_std_var, axis=-1):
    return _ln_ort(INVERTIBLE, Y_grad, Y, scale, bias, None, inv_std_var, axis)


def prepare_bn(big, small):
    """Big operands in their common dtype, small ones (per channel) in its accumulation dtype."""
    t = jnp.result_type(*[v.dtype for v in big])
    a = acc_dtype(t)
    return [v.astype(t) for v in big], [v.astype(a).reshape(-1) for v in small]


def batch_normalization_grad(dY, X, scale, mean, variance, epsilon=None):
    """`variance` is the saved INVERSE std (ORT's kernel reads it so); epsilon is unused."""
    (dy, x), (s, m, i) = prepare_bn([dY, X], [scale, mean, variance])
    dx, ds, db = bn_grad_core(dy, x, s, m, i, batch=0)
    return dx.astype(X.dtype), ds.astype(scale.dtype), db.astype(scale.dtype)


def batch_norm_internal(X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                        training_mode=1):
    if not training_mode:
        a = acc_dtype(X.dtype)
        shape = (1, -1) + (1,) * (X.ndim - 2)
        per = lambda v: v.astype(a).reshape(shape)
        inv = 1 / jnp.sqrt(per(input_var) + jnp.asarray(epsilon, jnp.float32).astype(a))
        y = per(scale) * (X.astype(a) - per(input_mean)) * inv + per(B)
        return y.astype(X.dtype), None, None, None, None
    (x,), small = prepare_bn([X], [scale, B, input_mean, input_var])
    y, rm, rv, sm, si = bn_train_core(x, *small, epsilon=epsilon, momentum=momentum, batch=0)
    t2 = input_mean.dtype
    return (y.astype(X.dtype), rm.astype(t2), rv.astype(t2), sm.astype(t2), si.astype(t2))
