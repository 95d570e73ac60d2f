"""ConvGrad / ConvTransposeGrad as jax's own reverse-mode derivative (jax.vjp) of the forward
Conv / ConvTranspose (which tests check against ORT's CPU Conv and ConvTranspose)."""
import jax
import jax.numpy as jnp

from jaxops.ops.conv import conv, conv_transpose


def _grads(forward, dY, X, W):
    _, vjp = jax.vjp(forward, X, W)
    dX, dW = vjp(dY)
    return dX, dW, jnp.sum(dY, axis=(0,) + tuple(range(2, dY.ndim)))


def conv_grad(dY, X, W, **attrs):
    return _grads(lambda x, w: conv(x, w, **attrs), dY, X, W)


def conv_transpose_grad(dY, X, W, **attrs):
    return _grads(lambda x, w: conv_transpose(x, w, **attrs), dY, X, W)
