"""FakeQuant (XLA code) against a numpy model of ORT's CUDA kernel; its straight-through
gradient (FakeQuantGrad of the mask); the vmap and sharding cases beyond its matrix row; bad
input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from jaxops import ops
from helpers import DTYPE_IDS, FLOAT_DTYPES, on_cpu_devices


def _model(x, scale, zp, qmin=0, qmax=255):
    """ORT's CUDA FakeQuant per element, in float64 on values given in the compute dtype."""
    q = np.round(x / scale) + zp  # np.round: half to even
    clamped = np.where(np.isnan(q), qmin, np.clip(q, qmin, qmax))
    return (clamped - zp) * scale, (q >= qmin) & (q <= qmax)


def test_spec_example():
    x = jnp.array([-1, 0, 0.26, 1, 30], jnp.float32)
    y, mask = ops.fake_quant(x, jnp.float32(0.1), jnp.float32(0))
    np.testing.assert_allclose(y, [0, 0, 0.3, 1, 25.5], rtol=1e-6)
    np.testing.assert_array_equal(mask, [False, True, True, True, False])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("zp,qmin,qmax", [(0.0, 0, 255), (3.0, -8, 7), (-2.5, -128, 127)], ids=str)
def test_matches_model(rng, dtype, zp, qmin, qmax):
    # a power-of-two scale makes x / scale exact (XLA:CPU divides through a reciprocal, which
    # can be an ulp off the correctly rounded quotient and move a near-tie)
    scale = 0.125
    x = rng.standard_normal((6, 33)) * 4
    x.flat[:7] = [0.0625, 0.1875, -0.0625, -0.1875, np.nan, np.inf, -np.inf]  # ties (to even)
    x = jnp.asarray(x, dtype)
    y, mask = ops.fake_quant(x, jnp.asarray(scale, dtype), jnp.asarray([zp], dtype),
                             quant_min=qmin, quant_max=qmax)
    assert y.dtype == dtype and mask.dtype == jnp.bool_ and y.shape == mask.shape == x.shape
    with np.errstate(invalid="ignore"):
        want, want_mask = _model(np.asarray(x, np.float64), scale, zp, qmin, qmax)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(np.asarray(y, np.float64),
                                  np.asarray(jnp.asarray(want, dtype), np.float64))


def _inputs(rng, shape=(4, 6)):
    x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.float64)
    return x, jnp.asarray(0.1, jnp.float64), jnp.asarray([4.0], jnp.float64)


def test_gradient_is_the_masked_cotangent(rng):
    x, s, zp = _inputs(rng)
    kw = {"quant_min": -20, "quant_max": 20}
    (y, mask), vjp = jax.vjp(lambda x, s, zp: ops.fake_quant(x, s, zp, **kw), x, s, zp)
    assert 0 < mask.sum() < mask.size  # both branches taken
    dy = jnp.asarray(rng.standard_normal(x.shape))
    dx, ds, dzp = vjp((dy, np.zeros(mask.shape, jax.dtypes.float0)))
    np.testing.assert_array_equal(dx, ops.fake_quant_grad(dy, mask))
    assert ds.shape == s.shape and dzp.shape == zp.shape and not ds.any() and not dzp.any()
    g = jax.grad(lambda x: ops.fake_quant(x, s, zp, **kw)[0].sum())(x)
    np.testing.assert_array_equal(g, mask.astype(g.dtype))


def test_check_grads_order2_of_the_backward(rng):
    """The forward is a staircase: its straight-through gradient is no finite difference of it,
    so check_grads runs on the VJP map, which is what higher-order autodiff differentiates."""
    x, s, zp = _inputs(rng)

    def vjp_map(dy):
        return jax.vjp(lambda x: ops.fake_quant(x, s, zp, quant_min=-20, quant_max=20)[0], x)[1](dy)

    check_grads(vjp_map, (jnp.asarray(rng.standard_normal(x.shape)),), order=2,
                modes=("fwd", "rev"))
    # and the second derivative through the straight-through estimator is zero
    hess = jax.jacfwd(jax.grad(lambda x: ops.fake_quant(x, s, zp)[0].sum()))(x[0])
    assert not np.asarray(hess).any()


# tests/test_op_matrix.py runs jit, vmap (in_axes 0, 1 and -1 everywhere, each operand
# unbatched in turn) and a sharded forward from the spec's matrix row; here: mixed in_axes,
# two operands unbatched, scalar scale/zero_point, and the gradient (the row has none: the
# forward is a staircase)
@pytest.mark.parametrize("in_axes", [(1, 0, 0), (-1, None, None), (None, 0, None)], ids=str)
def test_vmap(rng, in_axes):
    xs = jnp.asarray(rng.standard_normal((3, 4, 6)) * 3)
    ss = jnp.asarray([0.1, 0.2, 0.3])
    zps = jnp.asarray([[0.0], [2.0], [-3.0]])
    args = (xs, ss, zps)
    batched = [a[0] if ax is None else jnp.moveaxis(a, 0, ax) if ax else a
               for a, ax in zip(args, in_axes)]
    got = jax.vmap(lambda x, s, z: ops.fake_quant(x, s, z, quant_min=-10, quant_max=10),
                   in_axes=in_axes)(*batched)
    for k in range(3):
        one = [a[0] if ax is None else a[k] for a, ax in zip(args, in_axes)]
        want = ops.fake_quant(*one, quant_min=-10, quant_max=10)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[k], w)
    # vmap of the gradient, with an unbatched scale
    g = jax.vmap(jax.grad(lambda x, s: ops.fake_quant(x, s, zps[0])[0].sum()),
                 in_axes=(0, None))(xs, ss[0])
    np.testing.assert_array_equal(g, ops.fake_quant(xs, ss[0], zps[0])[1].astype(g.dtype))


def test_sharded_gradient_and_mask_are_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x, s, zp = _inputs(rng, (8, 6))
    placed = jax.device_put(x, NamedSharding(mesh, P("x")))
    f = jax.jit(jax.value_and_grad(lambda x: ops.fake_quant(x, s, zp)[0].sum()))
    hlo = f.lower(placed).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    y, mask = jax.jit(ops.fake_quant)(placed, s, zp)
    assert y.sharding.spec[:1] == ("x",) and mask.sharding.spec[:1] == ("x",)
    np.testing.assert_array_equal(y, ops.fake_quant(x, s, zp)[0])


def test_bad_input():
    x, s = jnp.ones((2, 3), jnp.float32), jnp.float32(0.1)
    cases = [((x.astype(jnp.int32), s, s), {}, TypeError, "must be float16"),
             ((x, s.astype(jnp.float64), s), {}, TypeError, "share one dtype"),
             ((x, jnp.ones(2, jnp.float32), s), {}, ValueError, "scale must be a scalar"),
             ((x, s, jnp.ones((1, 1), jnp.float32)), {}, ValueError, "zero_point must be a"),
             ((x, s, s), {"quant_min": 1.5}, TypeError, "quant_min must be an int"),
             ((x, s, s), {"quant_min": 5, "quant_max": 4}, ValueError, "must not exceed")]
    for args, kw, error, text in cases:
        for call in (ops.fake_quant, jax.jit(ops.fake_quant, static_argnames=tuple(kw))):
            with pytest.raises(error, match=f"jaxops.ops.fake_quant: .*{text}"):
                call(*args, **kw)


def test_ort_ops_table():
    assert ops.ORT_OPS[("com.microsoft", "FakeQuant")] is ops.fake_quant
    assert ops.fake_quant.spec.attrs == {"quant_min": 0, "quant_max": 255}
