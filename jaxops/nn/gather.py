"""gather and embedding whose derivatives run the GatherGrad kernel.

Both are `jax.custom_jvp`: the forward is XLA's own gather; the tangent map is
`gather_grad_transpose` (a gather), whose transpose is the GatherGrad kernel, so reverse mode
runs the kernel and forward mode (check_grads' default) works too, at any order.

Index rules as in jaxops.ops.gather_grad: a negative index wraps once; an index still out of
range reads 0 in the forward pass and gets no gradient.
"""
import functools

import jax

from jaxops.ops import gather as ops
from jaxops.reference import gather as ref

__all__ = ["embedding", "gather"]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def gather(x, indices, axis=0):
    """x gathered along `axis` at `indices` (any shape): x[..., indices, ...]."""
    return ref.gather(x, indices, axis % x.ndim)


@gather.defjvp
def _gather_jvp(axis, primals, tangents):
    (x, indices), (t, _) = primals, tangents
    return gather(x, indices, axis), ops.gather_grad_transpose(t, indices, axis=axis)


def embedding(table, ids):
    """Rows of `table` [V, ...] at `ids` (any shape): table[ids]; backward = GatherGrad."""
    return gather(table, ids, 0)
