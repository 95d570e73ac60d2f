"""Independent definitions of the activation gradients: where the op takes the forward INPUT,
the gradient is jax's own autodiff of the forward op (jax.vjp); where it takes the forward
OUTPUT, the derivative written in terms of that output. Computed in the inputs' dtype (tests
call these in float64)."""
import jax
import jax.numpy as jnp


def _vjp(forward, dY, X):
    return jax.vjp(forward, X)[1](dY)[0]


def relu_grad(dY, X):
    return _vjp(jax.nn.relu, dY, X)


def sigmoid_grad(dY, Y):
    return dY * (Y - Y * Y)


def tanh_grad(dY, Y):
    return dY - dY * Y * Y


def gelu_grad(dY, X):
    return _vjp(lambda x: jax.nn.gelu(x, approximate=False), dY, X)


def fast_gelu_grad(dY, X):
    return _vjp(lambda x: jax.nn.gelu(x, approximate=True), dY, X)


def quick_gelu_grad(dY, X, alpha=1.702):
    return _vjp(lambda x: x * jax.nn.sigmoid(alpha * x), dY, X)


def leaky_relu_grad(dY, Y, alpha=0.01):
    return jnp.where(Y > 0, dY, alpha * dY)


def bias_gelu_grad_dx(dY, X, B):
    return gelu_grad(dY, X + B)


def bias_fast_gelu_grad_dx(dY, X, B):
    return fast_gelu_grad(dY, X + B)


def fake_quant_grad(dY, gradient_mask):
    return jnp.where(gradient_mask, dY, 0).astype(dY.dtype)


def div_grad(dY, A, B):
    return jax.vjp(jnp.divide, A, B)[1](dY)
