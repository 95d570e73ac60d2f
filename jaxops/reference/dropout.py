"""Plain definitions of the dropout gradients, written independently of jaxops.ops.dropout
(the test oracle)."""
import math

import jax.numpy as jnp

from jaxops.reference.softmax import softmax_grad


def dropout_grad(dy, mask, ratio=0.5):
    if ratio == 0 and dy.dtype in (jnp.float32, jnp.float64):  # ORT: f16 keeps the mask
        return dy
    return jnp.where(mask, dy / (1 - ratio), 0).astype(dy.dtype)


def unpack_bits(words, shape):
    i = jnp.arange(math.prod(shape), dtype=jnp.uint32)
    return ((words[i // 32] >> (i % 32)) & 1).astype(bool).reshape(shape)


def bitmask_dropout_grad(dy, words, ratio=0.5):
    return dropout_grad(dy, unpack_bits(words, dy.shape), ratio)


def softmax_dropout_grad(dy, mask, y, ratio=0.5, axis=1):
    g = jnp.where(mask, dy / (1 - ratio), 0).astype(dy.dtype)
    return softmax_grad(g, y, axis, through_end=True)
