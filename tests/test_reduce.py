"""ReduceSumTraining."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from jaxops import ops
from helpers import on_cpu_devices

DTYPES = [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16, jnp.int32, jnp.int64]
IDS = ["f32", "f64", "f16", "bf16", "i32", "i64"]
AXES = [((2, 3, 4), [1]), ((2, 3, 4), [0, -1]), ((2, 3, 4), []), ((5,), [0]), ((3, 4), [-2]),
        ((0, 3), [0]), ((2, 3, 4), (2, 0, 1))]


def _data(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-1000, 1000, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


MATRIX = [(d, *a, k) for d in DTYPES for a in (AXES if d == jnp.float32 else AXES[1:4])
          for k in (1, 0)]


@pytest.mark.parametrize("dtype,shape,axes,keepdims", MATRIX,
                         ids=[f"{np.dtype(m[0]).name}-{m[1]}-{m[2]}-{m[3]}" for m in MATRIX])
def test_matches_numpy(rng, dtype, shape, axes, keepdims):
    x = _data(rng, shape, dtype)
    out = ops.reduce_sum_training(x, np.array(axes, np.int64), keepdims=keepdims)
    reduce = tuple(axes) if axes else None  # empty axes: every dim
    expected = np.sum(np.asarray(x, np.float64 if dtype != jnp.int64 else np.int64),
                      axis=reduce, keepdims=bool(keepdims))
    assert out.dtype == dtype and out.shape == expected.shape
    if jnp.issubdtype(dtype, jnp.integer):
        np.testing.assert_array_equal(np.asarray(out), expected)
    else:  # summation error: a few ulps of the sum of magnitudes (f16/bf16 sum in f32)
        scale = np.sum(np.abs(np.asarray(x, np.float64)), axis=reduce, keepdims=bool(keepdims))
        err = np.abs(np.asarray(out, np.float64) - expected)
        assert np.all(err <= 4 * float(jnp.finfo(dtype).eps) * (scale + np.abs(expected)))


def test_defaults_and_noop(rng):
    assert ops.reduce_sum_training.spec.attrs == {"keepdims": 1, "noop_with_empty_axes": 0}
    x = _data(rng, (2, 3), jnp.float32)
    assert ops.reduce_sum_training(x, []).shape == (1, 1)
    assert ops.reduce_sum_training(x, None, keepdims=0).shape == ()
    same = ops.reduce_sum_training(x, [], noop_with_empty_axes=1)
    np.testing.assert_array_equal(same, x)
    # noop only applies to empty axes
    assert ops.reduce_sum_training(x, [1], noop_with_empty_axes=1).shape == (2, 1)


def test_f16_accumulates_in_f32():
    x = jnp.full((4096,), 1.0, jnp.float16)  # an f16 running sum would stall at 2048
    assert float(ops.reduce_sum_training(x, [0], keepdims=0)) == 4096.0


def test_jit_vmap_grad(rng):
    x = _data(rng, (3, 4, 5), jnp.float64)
    f = lambda x: ops.reduce_sum_training(x, (1,), keepdims=0)
    np.testing.assert_allclose(jax.jit(f)(x), x.sum(1), rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(f, 2)(x), jnp.moveaxis(x, 2, 0).sum(2), rtol=1e-12)
    check_grads(lambda x: ops.reduce_sum_training(x, (0, 2)), (x,), order=2,
                modes=("fwd", "rev"))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(ops.reduce_sum_training(x, [0])))))(x)
    np.testing.assert_allclose(g, jnp.broadcast_to(jnp.cos(x.sum(1, keepdims=True)), x.shape),
                               rtol=1e-12)


def test_sharded_input_is_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = jax.device_put(_data(rng, (8, 6), jnp.float32), NamedSharding(mesh, P("x", None)))
    f = jax.jit(lambda x: ops.reduce_sum_training(x, [1]))
    hlo = f.lower(x).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    np.testing.assert_allclose(f(x), np.asarray(x).sum(1, keepdims=True), rtol=1e-6)
    assert f(x).sharding.spec[0] == "x"


def test_bad_input():
    x = jnp.ones((2, 3))
    cases = [
        ((jnp.ones(3, jnp.int8), [0]), TypeError, "data must be"),
        ((x, [2]), ValueError, "out of range"),
        ((x, [-3]), ValueError, "out of range"),
        ((x, [1, -1]), ValueError, "must not repeat"),
        ((x, [[0]]), TypeError, "1-D sequence of ints"),
        ((x, [0.5]), TypeError, "1-D sequence of ints"),
    ]
    for args, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.reduce_sum_training(*args)
        assert "jaxops.ops.reduce_sum_training" in str(info.value)
    with pytest.raises(TypeError, match="axes must be static") as info:
        jax.jit(ops.reduce_sum_training)(x, jnp.asarray([0]))
    assert "jaxops.ops.reduce_sum_training" in str(info.value)


def test_ort_ops_table():
    assert ops.ORT_OPS[("com.microsoft", "ReduceSumTraining")] is ops.reduce_sum_training
