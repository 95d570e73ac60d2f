"""Every public function of jaxops.nn passes check_grads at order 2 in forward and reverse mode,
and its reverse pass still runs the ORT gradient kernel (the primitive shows in the jaxpr of
jax.grad), not an XLA re-derivation of the forward."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxops import nn


def _rng():
    return np.random.default_rng(0)


def _normal(shape, dtype=jnp.float64, rng=None):
    return jnp.asarray((rng or _rng()).standard_normal(shape), dtype)


def _away_from_zero(shape, dtype=jnp.float64):
    # |x| >= 0.1 keeps finite differences off the sign formats' kink at 0
    x = _rng().standard_normal(shape)
    return jnp.asarray(np.where(x < 0, x - 0.1, x + 0.1), dtype)


_IDS = jnp.asarray([[0, 5, 2], [5, 1, 1]])
_LABELS = jnp.asarray([[0, 6, 3], [-100, 2, 6]])  # one ignored sample


def _cases():
    """name -> (function of the differentiable arrays, those arrays, primitives the reverse pass
    must bind, check_grads tolerance or None for its default)."""
    r = _rng()
    x35 = _normal((3, 5), rng=r)
    return {
        "softmax": (lambda x: nn.softmax(x, axis=0), (x35,), ["jaxops_softmax_grad_13"], None),
        "log_softmax": (lambda x: nn.log_softmax(x), (x35,), ["jaxops_log_softmax_grad_13"],
                        None),
        "embedding": (lambda t: nn.embedding(t, _IDS), (_normal((6, 4), rng=r),),
                      ["jaxops_gather_grad"], None),
        "gather": (lambda x: nn.gather(x, _IDS, axis=1), (_normal((2, 6, 3), rng=r),),
                   ["jaxops_gather_grad"], None),
        "concat": (lambda a, b: nn.concat([a, b], axis=1),
                   (_normal((2, 3), rng=r), _normal((2, 4), rng=r)), ["jaxops_split_training"],
                   None),
        "split": (lambda x: nn.split(x, (2, 1, 3), axis=1), (_normal((2, 6), rng=r),),
                  ["jaxops_concat_training"], None),
        "cross_entropy": (lambda x, w: nn.cross_entropy(x, _LABELS, w, -100),
                          (_normal((2, 3, 7), rng=r), jnp.asarray(r.random(7) + 0.5)),
                          ["jaxops_softmax_cross_entropy_rows_grad"], None),
        "layer_norm": (lambda x, s, b: nn.layer_norm(x, s, b, axis=1),
                       (_normal((3, 2, 4), rng=r), _normal((2, 4), rng=r), _normal((2, 4), rng=r)),
                       ["jaxops_layer_normalization_grad"], None),
        "rms_norm": (lambda x, s: nn.rms_norm(x, s), (_normal((3, 5), rng=r), _normal(5, rng=r)),
                     ["jaxops_simplified_layer_normalization_grad"], None),
        # the sign formats are exact for a function whose derivative needs only x's sign
        "gist_checkpoint": (nn.gist_checkpoint(lambda x: jax.nn.leaky_relu(x, 0.1), "binarize"),
                            (_away_from_zero((3, 8)),), [], None),
        # pack16 keeps x in float16: f's derivatives at x rounded to f16 (2^-11 relative), so
        # f32 tolerances; msfp15 (1/32 of a tile's largest value) is checked below
        "gist_checkpoint_pack16": (
            nn.gist_checkpoint(lambda x, w: jnp.tanh(x @ w), "pack16"),
            (_normal((3, 8), jnp.float32, r), _normal((8, 2), jnp.float32, r) / 3), [], 5e-2),
    }


CASES = _cases()


def test_every_public_function_has_a_case():
    assert set(nn.__all__) <= {name.split("_pack16")[0] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_check_grads_order2_fwd_and_rev(name):
    fn, args, _, tol = CASES[name]
    kw = {} if tol is None else dict(atol=tol, rtol=tol, eps=1e-2)
    check_grads(fn, args, order=2, modes=("fwd", "rev"), **kw)
    check_grads(jax.jit(fn), args, order=1, modes=("fwd", "rev"), **kw)


def _binds(jaxpr, primitive):
    """Whether the printed jaxpr binds `primitive` (its name, then params or operands)."""
    return re.search(rf"\b{primitive}(\[| )", jaxpr) is not None


def _loss(fn):
    def loss(*args):
        out = jax.tree.leaves(fn(*args))
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in out)
    return loss


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2]])
def test_reverse_pass_runs_the_kernel(name, monkeypatch):
    fn, args, kernels, _ = CASES[name]
    argnums = tuple(range(len(args)))
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss(fn), argnums))(*args))
    for kernel in kernels:
        # the primitive itself (an FFI custom call when lowered), bound in the backward
        assert _binds(jaxpr, kernel), (kernel, jaxpr)
    # and the gradient equals the references' (JAXOPS_DISABLE=all)
    got = jax.grad(_loss(fn), argnums)(*args)
    monkeypatch.setenv("JAXOPS_DISABLE", "all")
    want = jax.grad(_loss(fn), argnums)(*args)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12), got, want)


def test_cross_entropy_and_norms_bind_no_xla_rederivation():
    """The backward of the three former custom_vjp functions: the kernel computes the
    gradient of the big operand; no transposed softmax/normalisation is left (the tangent
    maps appear only in forward mode)."""
    for name in ("cross_entropy", "layer_norm", "rms_norm"):
        fn, args, kernels, _ = CASES[name]
        jaxpr = str(jax.make_jaxpr(jax.grad(_loss(fn), tuple(range(len(args)))))(*args))
        assert not _binds(jaxpr, r"jaxops_\w+_jvp"), (name, jaxpr)
        assert "custom_vjp" not in jaxpr, (name, jaxpr)
        assert jaxpr.count(f"{kernels[0]}[") == 1, (name, jaxpr)  # one call: every gradient
        fwd = str(jax.make_jaxpr(lambda *a: jax.jvp(fn, a, a)[1])(*args))
        assert _binds(fwd, r"jaxops_\w+_jvp") and not _binds(fwd, kernels[0]), (name, fwd)


def test_gist_msfp15_forward_and_reverse_agree():
    """msfp15 is lossy (the derivative is f's at the decoded input), so check_grads against f
    cannot hold; jvp and vjp are transposes of one linear map, and the backward decodes with the
    msfp15 kernel."""
    r = _rng()
    layer = nn.gist_checkpoint(lambda x, w: jnp.tanh(x @ w), "msfp15")
    x, w = _normal((4, 16), jnp.float32, r), _normal((16, 3), jnp.float32, r) / 4
    tx, tw = _normal((4, 16), jnp.float32, r), _normal((16, 3), jnp.float32, r)
    ct = _normal((4, 3), jnp.float32, r)
    y, jvp_out = jax.jvp(layer, (x, w), (tx, tw))
    _, vjp = jax.vjp(layer, x, w)
    gx, gw = vjp(ct)
    lhs, rhs = float(jnp.sum(ct * jvp_out)), float(jnp.sum(gx * tx) + jnp.sum(gw * tw))
    assert abs(lhs - rhs) <= 1e-5 * (abs(lhs) + 1), (lhs, rhs)
    np.testing.assert_array_equal(y, jnp.tanh(x @ w))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(layer(x, w)), (0, 1)))(x, w))
    assert _binds(jaxpr, "jaxops_gist_pack_msfp15_decoder")
