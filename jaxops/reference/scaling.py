"""Pure-JAX references of ORT's mixed-precision / scaling / finiteness ops (spec section
"Mixed precision / scaling / finiteness"). Reduced precision computes in f32."""
import jax.numpy as jnp


def acc_dtype(dtype):
    """The dtype the math runs in: f64 for f64, f32 otherwise."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def reduce_all_l2(*xs):
    """ReduceAllL2: sqrt of the sum of squares of every element of every input (a scalar of
    the first input's dtype)."""
    a = jnp.result_type(*(acc_dtype(x.dtype) for x in xs))
    total = sum(jnp.sum(jnp.square(x.astype(a))) for x in xs)
    return jnp.sqrt(total).astype(xs[0].dtype)


def is_all_finite(*xs, isinf_only=0, isnan_only=0):
    """IsAllFinite: True when no element of any input is inf/nan (only inf with isinf_only,
    only nan with isnan_only)."""
    def bad(x):
        if isinf_only:
            return jnp.isinf(x)
        if isnan_only:
            return jnp.isnan(x)
        return ~jnp.isfinite(x)
    return ~jnp.any(jnp.stack([jnp.any(bad(x)) for x in xs]))


def mixed_precision_scale(S, *xs, to, fuse_outputs=0):
    """MixedPrecisionScale: cast(X_i * S, to); fuse_outputs=1 gives one flat concatenation."""
    ys = [(x.astype(acc_dtype(x.dtype)) * jnp.reshape(S, ()).astype(acc_dtype(x.dtype))).astype(to)
          for x in xs]
    if fuse_outputs:
        return (jnp.concatenate([y.reshape(-1) for y in ys]),)
    return tuple(ys)


def is_finite(x):
    """IsFinite: elementwise, False for inf and nan."""
    return jnp.isfinite(x)


def scale(x, s, *, scale_down=0):
    """Scale: x * s, or x / s with scale_down=1 (s cast to x's dtype first)."""
    s = jnp.reshape(s, ()).astype(x.dtype)
    return x / s if scale_down else x * s


def scaled_sum(x0, x1, x2=None, *, scale_0, scale_1, scale_2=1.0):
    """ScaledSum: scale_0*x0 + scale_1*x1 (+ scale_2*x2), in f32 for reduced precision."""
    a = acc_dtype(x0.dtype)
    out = scale_0 * x0.astype(a) + scale_1 * x1.astype(a)
    if x2 is not None:
        out = out + scale_2 * x2.astype(a)
    return out.astype(x0.dtype)


def batch_scale(x, *, scale_0, scale_1, scale_2=None):
    """BatchScale: (x*scale_0, x*scale_1[, x*scale_2])."""
    a = acc_dtype(x.dtype)
    scales = (scale_0, scale_1) + (() if scale_2 is None else (scale_2,))
    return tuple((x.astype(a) * s).astype(x.dtype) for s in scales)


def all_(x):
    """All: logical AND of every element (a scalar)."""
    return jnp.all(x)
