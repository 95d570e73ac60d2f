"""MixedPrecisionScale, IsFinite, IsAllFinite, ReduceAllL2, Scale, ScaledSum, BatchScale, All
against numpy (f64), over dtypes, bad input (jit, vmap, gradients and sharding: the op matrix,
tests/test_op_matrix.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxops import ops


def _x(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float64) if x.dtype != jnp.float64 else x, np.float64)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_reduce_all_l2(rng, dtype):
    xs = [_x(rng, s, dtype) for s in [(3, 4), (7,), ()]]
    out = ops.reduce_all_l2(*xs)
    assert out.shape == () and out.dtype == dtype
    expected = np.sqrt(sum(np.sum(_f64(x) ** 2) for x in xs))
    assert_close(out, expected, dtype, ulps=4)
    assert float(ops.reduce_all_l2(jnp.asarray([3.0, 4.0]), jnp.asarray([12.0]))) == 13.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_finiteness(rng, dtype):
    x = _x(rng, (4, 5), dtype)
    inf, nan = x.at[1, 2].set(jnp.inf), x.at[0, 0].set(jnp.nan)
    np.testing.assert_array_equal(ops.is_finite(inf), np.isfinite(_f64(inf)))
    assert bool(ops.is_all_finite(x, x)) and not bool(ops.is_all_finite(x, inf))
    assert not bool(ops.is_all_finite(nan)) and ops.is_all_finite(x).shape == ()
    assert bool(ops.is_all_finite(nan, isinf_only=1)) and not bool(ops.is_all_finite(inf, isinf_only=1))
    assert bool(ops.is_all_finite(inf, isnan_only=1)) and not bool(ops.is_all_finite(nan, isnan_only=1))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("to,to_dtype", [(1, jnp.float32), (10, jnp.float16), (16, jnp.bfloat16)])
def test_mixed_precision_scale(rng, dtype, to, to_dtype):
    xs = [_x(rng, (3, 2), dtype), _x(rng, (5,), dtype)]
    s = jnp.asarray([0.125], jnp.float32)
    ys = ops.mixed_precision_scale(s, *xs, to=to)
    assert len(ys) == 2
    for y, x in zip(ys, xs):
        assert y.dtype == to_dtype and y.shape == x.shape
        assert_close(y, _f64(x) * 0.125, to_dtype if jnp.finfo(to_dtype).eps > jnp.finfo(dtype).eps
                     else dtype, ulps=1)
    (flat,) = ops.mixed_precision_scale(s, *xs, to=to, fuse_outputs=1)
    assert flat.shape == (11,)
    np.testing.assert_array_equal(flat, jnp.concatenate([y.ravel() for y in ys]))
    np.testing.assert_allclose(ops.mixed_precision_scale(jnp.float32(0.1), jnp.asarray([1., 2, 3]),
                                                         to=1)[0], [0.1, 0.2, 0.3], rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_scale_scaled_sum_batch_scale(rng, dtype):
    a, b, c = (_x(rng, (4, 3), dtype) for _ in range(3))
    assert_close(ops.scale(a, jnp.asarray([2], jnp.int64)), _f64(a) * 2, dtype, ulps=1)
    assert_close(ops.scale(a, jnp.asarray(4.0), scale_down=1), _f64(a) / 4, dtype, ulps=1)
    assert_close(ops.scaled_sum(a, b, scale_0=0.5, scale_1=-2.0), 0.5 * _f64(a) - 2 * _f64(b),
                 dtype, ulps=2)
    assert_close(ops.scaled_sum(a, b, c, scale_0=0.5, scale_1=-2.0, scale_2=3.0),
                 0.5 * _f64(a) - 2 * _f64(b) + 3 * _f64(c), dtype, ulps=2)
    outs = ops.batch_scale(a, scale_0=0.5, scale_1=3.0)
    assert len(outs) == 2
    outs = ops.batch_scale(a, scale_0=0.5, scale_1=3.0, scale_2=-1.0)
    for o, s in zip(outs, (0.5, 3.0, -1.0)):
        assert o.dtype == dtype
        assert_close(o, _f64(a) * s, dtype, ulps=1)


def test_all():
    assert bool(ops.all(jnp.ones((2, 3), bool))) and not bool(ops.all(jnp.asarray([True, False])))
    assert ops.all(jnp.ones(3, bool)).shape == ()


def test_sharded_reduce_all_l2(rng):
    # a scalar of sharded inputs (the matrix's sharding check needs a sharded output)
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sh = NamedSharding(mesh, P("x"))
    a, b = (jax.device_put(_x(rng, (8, 4), jnp.float32), sh) for _ in range(2))
    np.testing.assert_allclose(jax.jit(ops.reduce_all_l2)(a, b),
                               np.sqrt(np.sum(np.asarray(a) ** 2) + np.sum(np.asarray(b) ** 2)),
                               rtol=1e-6)


def test_bad_input():
    f = jnp.ones(3)
    cases = [
        (lambda: ops.reduce_all_l2(), ValueError, "reduce_all_l2: needs at least one"),
        (lambda: ops.reduce_all_l2(jnp.ones(3, jnp.int32)), TypeError,
         r"reduce_all_l2: X\[0\] must be"),
        (lambda: ops.is_finite(jnp.ones(3, bool)), TypeError, "is_finite"),
        (lambda: ops.is_all_finite(f, isinf_only=1, isnan_only=1), ValueError, "exclude"),
        (lambda: ops.mixed_precision_scale(jnp.ones(2), f, to=1), ValueError, "one element"),
        (lambda: ops.mixed_precision_scale(jnp.ones(1), f, to=7), ValueError, "to must be"),
        (lambda: ops.scale(f, jnp.ones(2)), ValueError, "scale: scale must hold one"),
        (lambda: ops.scale(f, jnp.ones(1, bool)), TypeError, "scale must be a float or int"),
        (lambda: ops.scaled_sum(f, jnp.ones(4), scale_0=1.0, scale_1=1.0), ValueError,
         "scaled_sum: input0 and input1 must share one shape"),
        (lambda: ops.batch_scale(jnp.ones(2, jnp.int32), scale_0=1.0, scale_1=1.0), TypeError,
         "batch_scale"),
        (lambda: ops.all(f), TypeError, "all: X must be bool"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text) as info:
            call()
        assert "jaxops.ops." in str(info.value)


def test_ort_ops_table():
    ms = "com.microsoft"
    for op_type, fn in [("MixedPrecisionScale", ops.mixed_precision_scale),
                        ("IsFinite", ops.is_finite), ("IsAllFinite", ops.is_all_finite),
                        ("ReduceAllL2", ops.reduce_all_l2), ("Scale", ops.scale),
                        ("ScaledSum", ops.scaled_sum), ("BatchScale", ops.batch_scale),
                        ("All", ops.all)]:
        assert ops.ORT_OPS[(ms, op_type)] is fn
