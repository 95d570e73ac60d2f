"""take_ranges (jaxops/ops/ranges.py): pieces of a flat buffer, gaps and overlaps allowed, in one
CPU kernel call; the reference's slices off the CPU. Values equal the slices bit for bit in
every dtype the kernel moves; jit, vmap, gradients of any order (the slices'), a sharded
buffer, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.test_util import check_grads

from helpers import new_rng, on_cpu_devices
from jaxops.ops.ranges import _reference, take_ranges

# (flat size, pieces): gaps, overlaps, a piece at the very end, an empty piece, a scalar
CASES = [
    (20, ((3, (2, 3)), (0, (4,)), (15, (5, 1)), (9, (0,)))),
    (64, ((0, (8, 8)),)),
    (1000, ((7, (3, 4, 5)), (100, ()), (990, (10,)), (8, (6, 2)))),
]
DTYPES = [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16, jnp.int8, jnp.int32, jnp.int64,
          jnp.uint16, jnp.bool_]


def _flat(n, dtype, rng):
    return jnp.asarray(rng.standard_normal(n) * 50, np.float64).astype(dtype)


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n, pieces", CASES, ids=["gaps", "whole", "3d"])
def test_matches_the_slices_and_is_one_call(n, pieces, dtype):
    x = _flat(n, dtype, new_rng())
    f = jax.jit(lambda x: take_ranges(x, pieces))
    _same(f(x), _reference(x, pieces=pieces))
    hlo = f.lower(x).compile().as_text()
    assert hlo.count("custom_call_target=\"jaxops_take_ranges\"") == (
        1 if jax.default_backend() == "cpu" else 0)


def test_eager_and_no_pieces():
    x = _flat(20, jnp.float32, new_rng())
    _same(take_ranges(x, CASES[0][1]), _reference(x, pieces=CASES[0][1]))
    assert take_ranges(x, ()) == ()


@pytest.mark.parametrize("axis", [0, 1])
def test_vmap_and_vmap_grad(axis):
    n, pieces = CASES[0]
    xs = jnp.stack([_flat(n, jnp.float32, new_rng()) for _ in range(3)], axis)
    f = jax.vmap(lambda x: take_ranges(x, pieces), in_axes=axis)
    _same(f(xs), _reference(jnp.moveaxis(xs, axis, 0), pieces=pieces))

    def loss(fn):
        return lambda x: sum(jnp.sum(jnp.sin(p) * (k + 1)) for k, p in enumerate(fn(x)))
    g = jax.vmap(jax.grad(loss(lambda x: take_ranges(x, pieces))), in_axes=axis)
    gr = jax.vmap(jax.grad(loss(lambda x: _reference(x, pieces=pieces))), in_axes=axis)
    np.testing.assert_allclose(g(xs), gr(xs), rtol=1e-6)


def test_gradients_any_order():
    n, pieces = CASES[0]  # overlapping pieces: their cotangents add up
    x = _flat(n, jnp.float64, new_rng())
    check_grads(lambda x: [p * p for p in take_ranges(x, pieces)], (x,), order=2,
                modes=("fwd", "rev"))


def test_sharded_buffer():
    """A piece needs its range whole: a sharded buffer is gathered (the factors replicate
    it), and the values are the slices'."""
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    n, pieces = CASES[2]
    x = _flat(n, jnp.float32, new_rng())
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
    f = jax.jit(lambda x: take_ranges(x, pieces))
    _same(f(placed), _reference(x, pieces=pieces))
    assert "jaxops_take_ranges" in f.lower(placed).compile().as_text()


@pytest.mark.parametrize("flat, pieces, error, match", [
    (jnp.zeros((4, 5)), ((0, (2,)),), ValueError, "rank 1"),
    (jnp.zeros(20), ((18, (3,)),), ValueError, "piece 0 .* reaches outside"),
    (jnp.zeros(20), ((0, (2,)), (-1, (2,))), ValueError, "piece 1 .* reaches outside"),
    (jnp.zeros(20), ((0, (2, -1)),), ValueError, "negative dim"),
    (jnp.zeros(20, jnp.complex64), ((0, (2,)),), TypeError, "unsupported dtype complex64"),
    (jnp.zeros(20), ((0.5, (2,)),), TypeError, "integer"),
])
def test_bad_input_is_a_clear_error(flat, pieces, error, match):
    with pytest.raises(error, match=match):
        take_ranges(flat, pieces)
    if error is ValueError:  # and under jit, at trace time
        with pytest.raises(error, match=f"take_ranges: .*{match}"):
            jax.jit(lambda x: take_ranges(x, pieces))(flat)
