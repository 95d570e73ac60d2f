"""ai.onnx.preview.training optimizers: Adagrad, Adam, Momentum (several tensors per node:
inputs R, T, then X..., G..., state...; outputs new X..., new state...)."""
from __future__ import annotations

import jax.numpy as jnp

from ..registry import handler

DOMAIN = "ai.onnx.preview.training"


def _groups(rest, k):
    n = len(rest) // k
    return [rest[i * n:(i + 1) * n] for i in range(k)]


@handler("Adagrad", since=1, domain=DOMAIN)
def adagrad(ctx, r, t, *rest, decay_factor=0.0, epsilon=0.0, norm_coefficient=0.0):
    xs, gs, hs = _groups(rest, 3)
    lr = r / (1 + t * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm_coefficient * x + g
        h2 = h + g * g
        new_x.append((x - lr * g / (jnp.sqrt(h2) + epsilon)).astype(x.dtype))
        new_h.append(h2.astype(h.dtype))
    return tuple(new_x + new_h)


@handler("Adam", since=1, domain=DOMAIN)
def adam(ctx, r, t, *rest, alpha=0.9, beta=0.999, epsilon=0.0, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    xs, gs, vs, hs = _groups(rest, 4)
    # bias correction from step 1 on; step 0 uses the raw rate
    lr = jnp.where(t > 0, r * jnp.sqrt(1 - beta ** t) / (1 - alpha ** t), r)
    out_x, out_v, out_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm_coefficient * x + g
        v2 = alpha * v + (1 - alpha) * g
        h2 = beta * h + (1 - beta) * g * g
        x2 = (1 - norm_coefficient_post) * (x - lr * v2 / (jnp.sqrt(h2) + epsilon))
        out_x.append(x2.astype(x.dtype))
        out_v.append(v2.astype(v.dtype))
        out_h.append(h2.astype(h.dtype))
    return tuple(out_x + out_v + out_h)


@handler("Momentum", since=1, domain=DOMAIN)
def momentum(ctx, r, t, *rest, alpha, beta, mode, norm_coefficient):
    xs, gs, vs = _groups(rest, 3)
    b = jnp.where(t > 0, beta, 1.0)
    out_x, out_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm_coefficient * x + g
        v2 = alpha * v + b * g
        step = v2 if mode == "standard" else g + alpha * v2
        out_x.append((x - r * step).astype(x.dtype))
        out_v.append(v2.astype(v.dtype))
    return tuple(out_x + out_v)
