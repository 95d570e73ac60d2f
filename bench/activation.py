"""Elementwise activation gradients in context: jax.grad of a jitted MLP block.

The issue's target for these ops is end to end: "no slower than the XLA reference inside a
jitted MLP/transformer block backward". Each case times the backward of
    y = act(x @ W1 + b1) @ W2        (x [T, D], W1 [D, 4D], W2 [4D, D])
given dy, returning the gradients of x, W1, b1 and W2 (flattened into one array, which both
sides pay for alike):
  jaxops       the activation's backward is the jaxops op (GeluGrad, FastGeluGrad,
               ReluGrad, BiasGeluGrad_dX: the last fuses the bias add, as ORT's BiasGelu)
               through jax.custom_vjp,
  xla:autodiff plain jax autodiff of the same forward (jax.nn.gelu, jax.nn.relu, ...).
Both are XLA code, so the comparison shows what the ops' formulation costs after fusion.
`bytes` counts the block's inputs and gradients once (the matmuls dominate the time).
"""
import functools
import math

import jax
import jax.numpy as jnp

from bench.harness import DTYPES, Case
from jaxops import ops

FAMILY = "activation"


def _with_grad(forward, grad_op, *, on_input=True):
    """forward with a custom_vjp whose backward is grad_op(dY, X) (or (dY, Y))."""
    @jax.custom_vjp
    def act(h):
        return forward(h)

    def fwd(h):
        y = forward(h)
        return y, h if on_input else y

    def bwd(saved, dy):
        return (grad_op(dy, saved),)

    act.defvjp(fwd, bwd)
    return act


def _bias_gelu():
    """gelu(h + b) with ORT's BiasGeluGrad_dX backward; the bias grad is a sum of dX."""
    @jax.custom_vjp
    def act(h, b):
        return jax.nn.gelu(h + b, approximate=False)

    def fwd(h, b):
        return act(h, b), (h, b)

    def bwd(saved, dy):
        h, b = saved
        dx = ops.bias_gelu_grad_dx(dy, h, b)
        return dx, jnp.sum(dx.astype(jnp.float32), axis=tuple(range(dx.ndim - 1))).astype(b.dtype)

    act.defvjp(fwd, bwd)
    return act


# name -> (the activation with jaxops' backward, its plain-JAX forward, bias fused?)
ACTIVATIONS = {
    "gelu_grad": (_with_grad(functools.partial(jax.nn.gelu, approximate=False), ops.gelu_grad),
                  functools.partial(jax.nn.gelu, approximate=False), False),
    "fast_gelu_grad": (_with_grad(functools.partial(jax.nn.gelu, approximate=True),
                                  ops.fast_gelu_grad),
                       functools.partial(jax.nn.gelu, approximate=True), False),
    "relu_grad": (_with_grad(jax.nn.relu, ops.relu_grad), jax.nn.relu, False),
    "bias_gelu_grad_dx": (_bias_gelu(), functools.partial(jax.nn.gelu, approximate=False), True),
}


def _block_grads(act, fused_bias):
    def backward(x, w1, b1, w2, dy):
        def block(x, w1, b1, w2):
            h = x @ w1
            a = act(h, b1) if fused_bias else act(h + b1)
            return a @ w2
        _, vjp = jax.vjp(block, x, w1, b1, w2)
        return jnp.concatenate([g.reshape(-1) for g in vjp(dy)])
    return backward


def _make_inputs(tokens, d, dtype):
    def make(key):
        k = jax.random.split(key, 5)
        x = jax.random.normal(k[0], (tokens, d), jnp.float32)
        w1 = jax.random.normal(k[1], (d, 4 * d), jnp.float32) / math.sqrt(d)
        b1 = jax.random.normal(k[2], (4 * d,), jnp.float32) * 0.1
        w2 = jax.random.normal(k[3], (4 * d, d), jnp.float32) / math.sqrt(4 * d)
        dy = jax.random.normal(k[4], (tokens, d), jnp.float32)
        return tuple(a.astype(dtype) for a in (x, w1, b1, w2, dy))
    return make


def case(op, dtype, tokens, d):
    jaxops_act, plain, fused = ACTIVATIONS[op]
    jdt = DTYPES[dtype]
    xla = _block_grads(lambda h: plain(h), False)

    def reference(*args):
        return xla(*(a.astype(jnp.float32) for a in args))

    n_in = tokens * d * 2 + d * 4 * d * 2 + 4 * d
    return Case(
        name=f"mlp_backward/{op}/{dtype}/T{tokens}xD{d}", family=FAMILY, op=op, dtype=dtype,
        shape=(tokens, d), params={"hidden": 4 * d},
        make_inputs=_make_inputs(tokens, d, jdt),
        jaxops=_block_grads(jaxops_act, fused), reference=reference,
        xla={"autodiff": xla}, torch=None,
        bytes=2 * n_in * jnp.dtype(jdt).itemsize,
        tol=1e-1 if dtype == "bf16" else 1e-4)  # bf16 matmuls vs an f32 reference


def cases(quick: bool) -> list[Case]:
    tokens, d = (256, 128) if quick else (8192, 1024)
    out = []
    for op in ACTIVATIONS:
        for dtype in ("bf16", "f32"):
            out.append(case(op, dtype, tokens, d))
    return out
