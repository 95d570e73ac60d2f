"""SinGrad (ONNX domain, ORT-private, since 9) and its cosine counterpart: elementwise, so XLA
code that fuses with its neighbours."""
import jax.numpy as jnp

from jaxops.ops import _validate as v


def _inputs(op, dY, X):
    dY, X = jnp.asarray(dY), jnp.asarray(X)
    dtype = v.floats(op, dY=dY, X=X)
    v.same_shape(op, dY=dY, X=X)
    acc = v.compute_dtype(dtype)
    return dY.astype(acc), X.astype(acc), dtype


def sin_grad(dY, X):
    """ORT SinGrad: dX = dY * cos(X), X the Sin INPUT (f16/bf16 computed in f32)."""
    dy, x, dtype = _inputs("sin_grad", dY, X)
    return (dy * jnp.cos(x)).astype(dtype)


def cos_grad(dY, X):
    """dX = -dY * sin(X), X the Cos INPUT. ORT has no CosGrad node (its gradient builder
    writes Sin, Mul and Neg), so this is not in ORT_OPS."""
    dy, x, dtype = _inputs("cos_grad", dY, X)
    return (-dy * jnp.sin(x)).astype(dtype)


__all__ = ["cos_grad", "sin_grad"]

ORT_OPS = {("", "SinGrad"): sin_grad}
