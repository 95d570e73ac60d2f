"""SoftmaxGrad(_13) and LogSoftmaxGrad(_13): dX from dY and the forward output Y.

Ideal traffic: read dY, read Y, write dX (3 * numel * itemsize). XLA peers: the reference
(f16/bf16 upcast to f32, as the kernels do) and, for f16/bf16, the plain formula in the
input dtype. torch: `torch._softmax_backward_data` / `torch._log_softmax_backward_data`.
Non-last-axis cases are compared per byte with the last-axis [8192,4096] case of the same
op and dtype (target: within 1.5x).
"""
import functools
import math

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
from jaxops import ops
from jaxops.reference import softmax as ref

FAMILY = "softmax"
NON_LAST_TARGET = 1.5

# op name -> (jaxops function, is log-softmax, sums through the end (pre-opset-13))
OPS = {
    "softmax_grad_13": (ops.softmax_grad_13, False, False),
    "log_softmax_grad_13": (ops.log_softmax_grad_13, True, False),
    "softmax_grad": (ops.softmax_grad, False, True),
    "log_softmax_grad": (ops.log_softmax_grad, True, True),
}


def _name(op, dtype, shape, axis):
    return f"{op}/{dtype}/{'x'.join(map(str, shape))}/axis{axis}"


def _make_inputs(shape, dtype, axes, log):
    def make(key):
        k1, k2 = jax.random.split(key)
        dy = jax.random.normal(k1, shape, jnp.float32)
        logits = jax.random.normal(k2, shape, jnp.float32)
        y = (jax.nn.log_softmax if log else jax.nn.softmax)(logits, axis=axes)
        return dy.astype(dtype), y.astype(dtype)
    return make


def _plain(axes, log):
    """The formula in the input dtype, no upcast (jnp.sum still accumulates in f32)."""
    if log:
        return lambda dy, y: dy - jnp.exp(y) * jnp.sum(dy, axis=axes, keepdims=True)
    return lambda dy, y: y * (dy - jnp.sum(dy * y, axis=axes, keepdims=True))


def _torch(shape, axis, log, through_end):
    ndim = len(shape)
    lead = math.prod(shape[:axis])

    def call(torch, dy, y):
        f = torch._log_softmax_backward_data if log else torch._softmax_backward_data
        if through_end and axis < ndim - 1:  # sum over axis..end: a 2-D view
            return f(dy.reshape(lead, -1), y.reshape(lead, -1), 1, dy.dtype).reshape(dy.shape)
        return f(dy, y, axis, dy.dtype)
    return call


def case(op, dtype, shape, axis, baseline=None):
    fn, log, through_end = OPS[op]
    shape = tuple(shape)
    axis_n = axis % len(shape)
    axes = ref.reduced_axes(len(shape), axis, through_end)
    jdt = DTYPES[dtype]
    reference = ref.log_softmax_grad if log else ref.softmax_grad
    xla = {"ref": functools.partial(reference, axis=axis, through_end=through_end)}
    if dtype in ("bf16", "f16"):
        xla["plain"] = _plain(axes, log)
    f32 = lambda dy, y: reference(dy.astype(jnp.float32), y.astype(jnp.float32),
                                  axis=axis, through_end=through_end)
    return Case(
        name=_name(op, dtype, shape, axis), family=FAMILY, op=op, dtype=dtype, shape=shape,
        params={"axis": axis},
        make_inputs=_make_inputs(shape, jdt, axes, log),
        jaxops=functools.partial(fn, axis=axis),
        reference=f32, xla=xla, torch=_torch(shape, axis_n, log, through_end),
        bytes=3 * math.prod(shape) * jnp.dtype(jdt).itemsize,
        baseline=baseline, target=NON_LAST_TARGET if baseline else None)


def cases(quick: bool) -> list[Case]:
    if quick:
        last, vocab, nonlast = (128, 512), (32, 2000), ((4, 256, 8), 1)
    else:
        last, vocab, nonlast = (8192, 4096), (4096, 50304), ((64, 4096, 64), 1)
    out = []
    for op in ("softmax_grad_13", "log_softmax_grad_13"):
        for dtype in ("f32", "bf16"):
            out.append(case(op, dtype, last, -1))
            out.append(case(op, dtype, vocab, -1))
            shape, axis = nonlast
            out.append(case(op, dtype, shape, axis, baseline=_name(op, dtype, last, -1)))
    out.append(case("softmax_grad", "f32", last, 1))  # pre-opset-13: sums axis..end
    return out
