"""Pure-JAX SoftmaxGrad / LogSoftmaxGrad: the test oracle and the JAXOPS_DISABLE fallback.

`through_end=True` is ORT's pre-opset-13 rule: the sum runs over every dim from `axis` on.
Reduced-precision inputs are computed in f32 and rounded once at the end, as the kernels do.
"""
import jax.numpy as jnp


def reduced_axes(ndim: int, axis: int, through_end: bool) -> tuple[int, ...]:
    axis = axis % ndim
    return tuple(range(axis, ndim)) if through_end else (axis,)


def _compute_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def softmax_grad(dY, Y, axis=1, through_end=True):
    """dX = Y * (dY - sum(dY * Y))."""
    t = _compute_dtype(dY.dtype)
    dy, y = dY.astype(t), Y.astype(t)
    s = jnp.sum(dy * y, axis=reduced_axes(dY.ndim, axis, through_end), keepdims=True)
    return (y * (dy - s)).astype(dY.dtype)


def log_softmax_grad(dY, Y, axis=1, through_end=True):
    """dX = dY - exp(Y) * sum(dY), Y the log-softmax output."""
    t = _compute_dtype(dY.dtype)
    dy, y = dY.astype(t), Y.astype(t)
    s = jnp.sum(dy, axis=reduced_axes(dY.ndim, axis, through_end), keepdims=True)
    return (dy - jnp.exp(y) * s).astype(dY.dtype)


def log_softmax_grad_transpose(ct, Y, axis=-1, through_end=False):
    """The adjoint of log_softmax_grad in dY: ct - sum(ct * exp(Y)); also the forward-mode
    derivative of log_softmax."""
    t = _compute_dtype(ct.dtype)
    c, y = ct.astype(t), Y.astype(t)
    s = jnp.sum(c * jnp.exp(y), axis=reduced_axes(ct.ndim, axis, through_end), keepdims=True)
    return (c - s).astype(ct.dtype)
