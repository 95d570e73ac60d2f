"""softmax and log_softmax whose derivatives run ORT's gradient kernels.

Both are `jax.custom_jvp`: the tangent map is a kernel-backed linear op, so forward mode
works too (check_grads' default), and reverse mode transposes it into SoftmaxGrad_13 /
LogSoftmaxGrad_13. The forward pass is XLA's own (it fuses into its neighbours).
"""
import functools

import jax

from jaxops.ops import softmax as ops

__all__ = ["log_softmax", "softmax"]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def softmax(x, axis=-1):
    """softmax over one axis; backward pass = SoftmaxGrad_13."""
    return jax.nn.softmax(x, axis=axis)


@softmax.defjvp
def _softmax_jvp(axis, primals, tangents):
    (x,), (t,) = primals, tangents
    y = softmax(x, axis)
    return y, ops.softmax_grad_13(t, y, axis=axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def log_softmax(x, axis=-1):
    """log_softmax over one axis; backward pass = LogSoftmaxGrad_13."""
    return jax.nn.log_softmax(x, axis=axis)


@log_softmax.defjvp
def _log_softmax_jvp(axis, primals, tangents):
    (x,), (t,) = primals, tangents
    y = log_softmax(x, axis)
    return y, ops.log_softmax_grad_transpose(t, y, axis=axis)
