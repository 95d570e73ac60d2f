"""Plain definitions of the dropout gradients, written independently of jaxops.ops.dropout
(the test oracle)."""
import jax.numpy as jnp

from jaxops.reference.softmax import softmax_grad


def dropout_grad(dy, mask, ratio=0.5):
    if ratio == 0:
        return dy
    return jnp.where(mask, dy / (1 - ratio), 0).astype(dy.dtype)


def unpack_bits(words, shape):
    bits = (words[:, None] >> jnp.arange(32, dtype=jnp.uint32)[None, :]) & 1
    return bits.reshape(-1)[:int(jnp.size(jnp.zeros(shape)))].reshape(shape).astype(bool)


def bitmask_dropout_grad(dy, words, ratio=0.5):
    return dropout_grad(dy, unpack_bits(words, dy.shape), ratio)


def softmax_dropout_grad(dy, mask, y, ratio=0.5, axis=1):
    g = jnp.where(mask, dy / (1 - ratio), 0).astype(dy.dtype)
    return softmax_grad(g, y, axis, through_end=True)
