"""Random generators. ONNX leaves the stream to the runtime: here a node draws from
jax.random with the key PRNGKey(int(seed)) (seed 0 when the node has none), so a node gives
the same values on every call (never the values ORT or numpy would draw)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..registry import handler
from ._util import np_dtype


def _key(seed):
    return jax.random.PRNGKey(0 if seed is None else int(seed))


def _dtype(dtype, like=None, default=1):
    if dtype is not None:
        return np_dtype(dtype)
    return like.dtype if like is not None else np_dtype(default)


@handler("RandomNormal")
def random_normal(ctx, *, shape, dtype=1, mean=0.0, scale=1.0, seed=None):
    dt = _dtype(dtype)
    ctx.check_size(shape, np.float32)  # no inputs: it runs on the host, allocating at once
    return (mean + scale * jax.random.normal(_key(seed), tuple(shape), jnp.float32)).astype(dt)


@handler("RandomUniform")
def random_uniform(ctx, *, shape, dtype=1, high=1.0, low=0.0, seed=None):
    dt = _dtype(dtype)
    ctx.check_size(shape, np.float32)
    return jax.random.uniform(_key(seed), tuple(shape), jnp.float32, low, high).astype(dt)


@handler("RandomNormalLike")
def random_normal_like(ctx, x, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    dt = _dtype(dtype, x)
    return (mean + scale * jax.random.normal(_key(seed), x.shape, jnp.float32)).astype(dt)


@handler("RandomUniformLike")
def random_uniform_like(ctx, x, *, dtype=None, high=1.0, low=0.0, seed=None):
    dt = _dtype(dtype, x)
    return jax.random.uniform(_key(seed), x.shape, jnp.float32, low, high).astype(dt)


@handler("Bernoulli", since=15)
def bernoulli(ctx, p, *, dtype=None, seed=None):
    dt = _dtype(dtype, p)
    return (jax.random.uniform(_key(seed), p.shape, jnp.float32) < p).astype(dt)


@handler("Multinomial", since=7)
def multinomial(ctx, logits, *, dtype=6, sample_size=1, seed=None):
    """logits [batch, classes] (unnormalized log-probabilities) -> [batch, sample_size]."""
    draws = jax.random.categorical(_key(seed), jnp.asarray(logits), axis=-1,
                                   shape=(sample_size, logits.shape[0]))
    return draws.T.astype(np_dtype(dtype))
