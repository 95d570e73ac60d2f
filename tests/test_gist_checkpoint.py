"""jaxops.nn.gist_checkpoint: compressed saved activations lower the compiled temp memory of a
jitted MLP's gradient, and the gradients are f's exact ones at the decoded input."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import nn, ops
from helpers import fresh_process
from jaxops.cpu import concurrent_scheduler

B, D, LAYERS = 512, 128, 4


def _layer(x, w, b):
    return jax.nn.gelu(x @ w + b)


def _relu_layer(relu):
    return lambda x, w, b: relu(x @ w + b)


def _loss(layer, params, x):
    for w, b in params:
        x = layer(x, w, b)
    return jnp.sum(x * x)


def _mlp():
    rng = np.random.default_rng(0)
    params = [(jnp.asarray(rng.standard_normal((D, D)) / np.sqrt(D), jnp.float32),
               jnp.asarray(rng.standard_normal(D) * 0.1, jnp.float32)) for _ in range(LAYERS)]
    return params, jnp.asarray(rng.standard_normal((B, D)), jnp.float32)


@pytest.fixture(scope="module")
def mlp():
    return _mlp()


def _temp_bytes(layer, params, x):
    grad = jax.jit(jax.grad(lambda p, x: _loss(layer, p, x), argnums=(0, 1)))
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def _measure() -> dict:
    """The compiled temp bytes of the MLP's gradient: gelu layers plain, under
    jax.checkpoint and gist's float formats; relu layers plain and under its sign formats."""
    params, x = _mlp()
    got = {"plain": _temp_bytes(_layer, params, x),
           "remat": _temp_bytes(jax.checkpoint(_layer), params, x),
           "relu": _temp_bytes(_relu_layer(jax.nn.relu), params, x)}
    for fmt in ("pack16", "msfp15"):
        got[fmt] = _temp_bytes(nn.gist_checkpoint(_layer, fmt), params, x)
    for fmt in ("pack1", "binarize"):
        got[fmt] = _temp_bytes(_relu_layer(nn.gist_checkpoint(jax.nn.relu, fmt)), params, x)
    return got


# XLA's buffer scheduling decides how much of the saving shows: measured in units of one
# [512, 128] f32 activation, gelu MLP plain / jax.checkpoint / pack16 / msfp15, relu MLP plain /
# pack1 / binarize: XLA:CPU's concurrency-optimized scheduler, jax 0.12: 10 / 4 / 3.5 / 2,
# 7 / 4 / 4; jax 0.8: 10 / 7 / 8 / 8, 7 / 4 / 7; its memory-minimizing one (what importing
# jaxops picks: jaxops.cpu.prefer_memory_scheduler), jax 0.12: 9 / 7 / 8 / 8, 7 / 7 / 7.
RECENT_XLA = jax.__version_info__ >= (0, 12)


def _check_drops(got, concurrent):
    for fmt in ("pack16", "msfp15"):
        assert got[fmt] < got["plain"], (fmt, got)
        if RECENT_XLA and concurrent:
            assert got[fmt] < got["remat"] and 2 * got[fmt] < got["plain"], (fmt, got)
    if RECENT_XLA and concurrent:
        assert got["msfp15"] <= got["pack16"], got
    for fmt in ("pack1", "binarize"):
        if concurrent and (fmt == "pack1" or RECENT_XLA):
            assert got[fmt] < got["relu"], (fmt, got)
        else:  # the memory-minimizing scheduler keeps the relu MLP's floats alive anyway
            assert got[fmt] <= got["relu"], (fmt, got)


def test_compiled_temp_memory_drops():
    """This process's scheduler (conftest imports jaxops: the memory-minimizing one)."""
    _check_drops(_measure(), concurrent_scheduler())


def test_compiled_temp_memory_drops_under_xlas_scheduler():
    """A fresh process with XLA:CPU's concurrency-optimized scheduler, where the saving shows
    in full."""
    script = ("import json, os, sys\n"
              "os.environ['XLA_FLAGS'] = '--xla_cpu_enable_concurrency_optimized_scheduler=true'\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "import test_gist_checkpoint as t\n"
              "print(json.dumps(t._measure()))")
    out = fresh_process(script, str(Path(__file__).parent), timeout=300)
    _check_drops(json.loads(out.strip().splitlines()[-1]), True)


def _grads(layer, params, x):
    return jax.jit(jax.grad(lambda p, x: _loss(layer, p, x), argnums=(0, 1)))(params, x)


def _rel_err(got, want):
    return max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.parametrize("fmt,decode,bound", [
    ("pack16", lambda x: x.astype(jnp.float16).astype(jnp.float32), 2e-3),
    ("msfp15", lambda x: ops.gist_pack_msfp15_decoder(ops.gist_pack_msfp15_encoder(x), to=1), 6e-2),
])
def test_gradients_are_fs_at_the_decoded_input(mlp, fmt, decode, bound):
    params, x = mlp
    w, b = params[0]
    layer = nn.gist_checkpoint(_layer, fmt)
    y, vjp = jax.vjp(layer, x, w, b)
    np.testing.assert_array_equal(y, _layer(x, w, b))  # the forward is f itself
    dy = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), jnp.float32)
    _, exact_at_decoded = jax.vjp(_layer, decode(x), w, b)
    for g, e in zip(vjp(dy), exact_at_decoded(dy)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    # and the whole MLP's gradients stay within the format's error of the exact ones
    assert _rel_err(_grads(layer, params, x), _grads(_layer, params, x)) < bound


@pytest.mark.parametrize("fmt", ["pack1", "binarize"])
@pytest.mark.parametrize("act", [jax.nn.relu, lambda h: jax.nn.leaky_relu(h, 0.1)],
                         ids=["relu", "leaky_relu"])
def test_sign_formats_are_exact_for_relu(mlp, fmt, act):
    params, x = mlp
    # Exact masks, so only the matmuls' rounding differs: on a GPU the two programs sum the
    # GEMMs in different orders, and entries that cancel are off by more than 1e-5 relative
    # (H100, highest precision: 4.3e-6 off 0.054 in gradients up to 21). The tolerance is
    # f32 rounding of the leaf's largest entry; a wrong mask is off by the entries themselves.
    with jax.default_matmul_precision("highest"):
        want = _grads(_relu_layer(act), params, x)
        got = _grads(_relu_layer(nn.gist_checkpoint(act, fmt)), params, x)
    tol = lambda w: 64 * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(w)))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=0, atol=tol(w)), got, want)


def test_argnums_and_pytrees():
    rng = np.random.default_rng(2)
    x, h = (jnp.asarray(rng.standard_normal((4, 16)), jnp.float32) for _ in range(2))
    params = {"w": jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)}

    def f(x, params, h):
        return {"y": jnp.tanh(x @ params["w"]) * h}

    g = nn.gist_checkpoint(f, "pack16", argnums=(0, -1))
    c = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    # a loss linear in y: the same cotangent whether y comes from x or from x decoded
    loss = lambda f: lambda x, p, h: jnp.sum(f(x, p, h)["y"] * c)
    got = jax.grad(loss(g), argnums=(0, 1, 2))(x, params, h)
    r = lambda a: a.astype(jnp.float16).astype(jnp.float32)
    want = jax.grad(loss(f), argnums=(0, 1, 2))(r(x), params, r(h))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


@pytest.mark.parametrize("fmt", ["msfp15", "pack1"])
def test_vmap_and_jit(mlp, fmt):
    params, x = mlp
    w, b = params[0]
    if fmt == "pack1":  # rows of 13: each example's bits end in a partial byte
        layer, x = nn.gist_checkpoint(lambda x, w, b: jax.nn.relu(x), fmt), x[:4, :13]
    else:
        layer, x = nn.gist_checkpoint(_layer, fmt), x[:4]
    loss = lambda x: jnp.sum(layer(x, w, b) ** 2)
    per_row = jax.vmap(jax.grad(loss))(x)
    whole = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(per_row, whole, rtol=1e-5, atol=1e-5)
    if fmt == "pack1":
        np.testing.assert_array_equal(whole, 2 * jax.nn.relu(x))


def test_bad_arguments():
    f = lambda x: x
    with pytest.raises(ValueError, match="gist_checkpoint: format must be one of .*pack8.*invert"):
        nn.gist_checkpoint(f, "pack8")
    with pytest.raises(TypeError, match="gist_checkpoint: argnums"):
        nn.gist_checkpoint(f, "pack16", argnums="0")
    with pytest.raises(TypeError, match="gist_checkpoint: format 'pack16' stores float32"):
        nn.gist_checkpoint(f, "pack16")(jnp.ones(8, jnp.bfloat16))
    with pytest.raises(TypeError, match="gist_checkpoint: format 'pack1' needs a float"):
        nn.gist_checkpoint(f, "pack1")(jnp.ones(8, jnp.int32))
    with pytest.raises(ValueError, match="gist_checkpoint: argnums 3 out of range"):
        nn.gist_checkpoint(f, "pack16", argnums=3)(jnp.ones(8))
    with pytest.raises(ValueError, match="gist_checkpoint: format 'msfp15' needs the last dim"):
        nn.gist_checkpoint(f, "msfp15")(jnp.ones((2, 5), jnp.float32))
