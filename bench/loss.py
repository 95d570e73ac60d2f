"""jaxops.nn.cross_entropy forward + backward: d_logits of the mean loss, ignore_index=-100
with 10% of the labels ignored.

Ideal traffic: 3 passes over the logits (the forward reads them, the backward reads them again
and writes d_logits): 3 * rows * classes * itemsize. XLA peers: jax.grad of the pure-JAX
reference (f16/bf16 upcast to f32 inside, as the kernels do) and of the plain formula in the
input dtype. torch: F.cross_entropy(..., ignore_index=-100) forward + autograd backward.
"""
import math

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
import jaxops
from jaxops.reference import loss as ref

FAMILY = "loss"
IGNORE = -100


def _make_inputs(shape, dtype):
    rows, c = shape

    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        x = (jax.random.normal(k1, shape, jnp.float32) * 2).astype(dtype)
        labels = jax.random.randint(k2, (rows,), 0, c, jnp.int32)
        labels = jnp.where(jax.random.uniform(k3, (rows,)) < 0.1, IGNORE, labels)
        return x, labels
    return make


def _grad(loss_fn):
    return lambda x, labels: jax.grad(lambda x: loss_fn(x, labels))(x)


def _plain(x, labels):
    """The loss in the input dtype (log_softmax, gather, masked mean), no upcast."""
    lp = jax.nn.log_softmax(x, axis=-1)
    keep = labels != IGNORE
    picked = jnp.take_along_axis(lp, jnp.where(keep, labels, 0)[:, None], axis=-1)[:, 0]
    return -jnp.sum(jnp.where(keep, picked, 0)) / jnp.maximum(jnp.sum(keep), 1)


def _torch(torch, x, labels):
    xt = x.detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(xt, labels.long(), ignore_index=IGNORE)
    return torch.autograd.grad(loss, xt)[0]


def case(dtype, shape):
    shape = tuple(shape)
    jdt = DTYPES[dtype]
    ours = lambda x, l: jaxops.nn.cross_entropy(x, l, ignore_index=IGNORE)
    reference = lambda x, l: ref.cross_entropy(x, l, None, IGNORE)
    return Case(
        name=f"cross_entropy/{dtype}/{'x'.join(map(str, shape))}", family=FAMILY,
        op="cross_entropy", dtype=dtype, shape=shape,
        params={"reduction": "mean", "ignore_index": IGNORE, "ignored": 0.1},
        make_inputs=_make_inputs(shape, jdt),
        jaxops=_grad(ours),
        reference=lambda x, l: _grad(reference)(x.astype(jnp.float32), l),
        xla={"ref": _grad(reference), "plain": _grad(_plain)},
        torch=_torch,
        bytes=3 * math.prod(shape) * jnp.dtype(jdt).itemsize)


def cases(quick: bool) -> list[Case]:
    shapes = [(64, 2000), (128, 4096)] if quick else [(8192, 50304), (32768, 32000)]
    return [case(dtype, shape) for dtype in ("bf16", "f32") for shape in shapes]
