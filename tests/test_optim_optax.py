"""jaxops.optim against optax's own transformations: 100 steps of a small model under
jax.jit with donated params and state. In f64 with hyperparameters exact in f32 (ORT's
attributes are f32) the two agree to f64 rounding, which shows the semantics coincide; in f32
they agree to f32 rounding (Adam amplifies rounding where the second moment is tiny)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxops.optim as jo

STEPS = 100


def _problem(dtype):
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((8, 16)) * 0.3, dtype),
              "b1": jnp.zeros(16, dtype),
              "w2": jnp.asarray(rng.standard_normal((16, 1)) * 0.3, dtype)}
    x = jnp.asarray(rng.standard_normal((32, 8)), dtype)
    y = jnp.sin(x.sum(1, keepdims=True))
    loss = lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)
    return params, loss


def _train(tx, dtype, fused):
    params, loss = _problem(dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, state):
        g = jax.grad(loss)(p)
        if fused:
            return tx.step(g, state, p)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    state = tx.init(params)
    for _ in range(STEPS):
        params, state = step(params, state)
    return params, float(loss(params))


H = dict(b1=0.875, b2=1 - 2**-10, eps=2**-20)  # exact in f32
LR, WD = 2**-7, 2**-7
_SCHEDULE = optax.piecewise_constant_schedule(2**-6, {30: 0.5, 60: 0.25})
PAIRS = {
    "adamw": (lambda: jo.adamw(LR, weight_decay=WD, **H), lambda: optax.adamw(LR, weight_decay=WD, **H)),
    "adam": (lambda: jo.adam(LR, **H), lambda: optax.adam(LR, **H)),
    "sgd": (lambda: jo.sgd(LR), lambda: optax.sgd(LR)),
    "lamb": (lambda: jo.lamb(LR, weight_decay=WD, **H), lambda: optax.lamb(LR, weight_decay=WD, **H)),
    "adamw_schedule": (lambda: jo.adamw(_SCHEDULE, weight_decay=WD, **H),
                       lambda: optax.adamw(_SCHEDULE, weight_decay=WD, **H)),
}


def _max_rel(a, b):
    return max(float(jnp.max(jnp.abs(x - y) / (jnp.abs(y) + 1e-3)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name,fused", [(n, True) for n in PAIRS] + [("adamw", False)], ids=str)
def test_matches_optax_f64(name, fused):
    ours, theirs = PAIRS[name]
    got, _ = _train(ours(), jnp.float64, fused)
    expected, _ = _train(theirs(), jnp.float64, False)
    assert _max_rel(got, expected) < 1e-11


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_matches_optax_f32(name):
    ours, theirs = PAIRS[name]
    got, loss = _train(ours(), jnp.float32, True)
    expected, expected_loss = _train(theirs(), jnp.float32, False)
    assert _max_rel(got, expected) < 2e-3
    assert abs(loss - expected_loss) <= 1e-4 * abs(expected_loss) + 1e-6


def test_hf_mode_differs_from_optax():
    got, _ = _train(jo.adamw(LR, weight_decay=WD, hf_mode=True, **H), jnp.float64, True)
    expected, _ = _train(optax.adamw(LR, weight_decay=WD, **H), jnp.float64, False)
    assert _max_rel(got, expected) > 1e-6


def test_clip_by_global_norm_in_a_chain():
    ours = optax.chain(jo.clip_by_global_norm(0.1), optax.adam(LR, **H))
    theirs = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(LR, **H))
    got, _ = _train(ours, jnp.float64, False)
    expected, _ = _train(theirs, jnp.float64, False)
    assert _max_rel(got, expected) < 1e-3  # ORT divides by norm + 1e-6, optax by norm


def test_is_an_optax_transformation():
    tx = jo.adamw(1e-3)
    assert isinstance(tx, optax.GradientTransformation)
    params = {"a": jnp.ones(3)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))
    with pytest.raises(NotImplementedError):
        jo.sgd(0.1, momentum=0.9)
