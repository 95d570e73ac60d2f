"""ZeroGradient, InPlaceAccumulator, InPlaceAccumulatorV2, Group, PassThrough."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from jaxops import ops
from helpers import DTYPE_IDS, FLOAT_DTYPES, on_cpu_devices

# (buffer dtype, value dtype): every pair ORT's CUDA kernels register, plus f64
ACC_PAIRS = [(jnp.float32, jnp.float32), (jnp.float32, jnp.float16), (jnp.float16, jnp.float16),
             (jnp.float16, jnp.float32), (jnp.float32, jnp.bfloat16),
             (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
             (jnp.float64, jnp.float64)]
FLAGS = [None, True, False, "scalar-true", "scalar-false"]
# every flag form with f32 buffers and values, three with the other dtype pairs
ACC_CASES = [(p, f) for p in ACC_PAIRS for f in (FLAGS if p == ACC_PAIRS[0] else FLAGS[:2] + FLAGS[4:])]
ACC_CASE_IDS = [f"{np.dtype(p[0]).name}-{np.dtype(p[1]).name}-{f}" for p, f in ACC_CASES]


def _flag(f):
    if f is None:
        return None
    if isinstance(f, str):
        return jnp.asarray(f.endswith("true"))
    return jnp.asarray([f])


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float64))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3,), (2, 5), (0, 4), ()])
def test_zero_gradient(rng, dtype, shape):
    g = jnp.asarray(rng.standard_normal(shape), dtype)
    for signal in (jnp.ones(1), jnp.asarray([True]), jnp.int64(7)):
        out = ops.zero_gradient(g, signal)
        assert out.dtype == dtype and out.shape == shape
        assert not np.any(_np(out))
    # non-finite old gradients are zeroed too (not 0 * x)
    bad = jnp.full((2,), jnp.nan, dtype)
    np.testing.assert_array_equal(_np(ops.zero_gradient(bad, 0)), 0)


@pytest.mark.parametrize("pair,flag", ACC_CASES, ids=ACC_CASE_IDS)
def test_in_place_accumulator(rng, pair, flag):
    t, tg = pair
    old = jnp.asarray(rng.standard_normal((3, 4)), t)
    value = jnp.asarray(rng.standard_normal((3, 4)), tg)
    out = ops.in_place_accumulator(old, value, _flag(flag))
    assert out.dtype == t and out.shape == (3, 4)
    update = flag is None or flag is True or flag == "scalar-true"
    # ORT: old + cast<T>(value), rounded to T
    expected = old + value.astype(t) if update else old
    np.testing.assert_array_equal(_np(out), _np(expected))


@pytest.mark.parametrize("pair,flag", ACC_CASES, ids=ACC_CASE_IDS)
def test_in_place_accumulator_v2(rng, pair, flag):
    t, tg = pair
    buf = jnp.asarray(rng.standard_normal((4, 3)), t)
    value = jnp.asarray(rng.standard_normal((4, 3)), tg)
    updated, out = ops.in_place_accumulator_v2(buf, value, _flag(flag))
    assert updated.dtype == jnp.bool_ and updated.shape == (1,) and bool(updated[0])
    assert out.dtype == t and out.shape == (4, 3)
    overwrite = flag is True or flag == "scalar-true"
    expected = value.astype(t) if overwrite else buf + value.astype(t)
    np.testing.assert_array_equal(_np(out), _np(expected))


# (buffer shape, value shape): the buffer's shape broadcasts to the value's, as where ORT's
# gradient builder leaves a broadcast parameter's gradient unreduced
BROADCAST = [((), (1, 1, 4, 4)), ((), (5,)), ((4, 1), (2, 4, 3)), ((1, 3), (4, 3)),
             ((2, 1, 3), (2, 5, 3))]


@pytest.mark.parametrize("bshape,vshape", BROADCAST)
@pytest.mark.parametrize("flag", [None, True, False])
def test_accumulate_broadcast_value(rng, bshape, vshape, flag):
    """The value is summed over the dims the buffer was broadcast along: the true gradient of
    a parameter the forward graph broadcast."""
    buf = rng.standard_normal(bshape)
    value = rng.standard_normal(vshape)
    lead = len(vshape) - len(bshape)
    summed = value.sum(axis=tuple(range(lead)))
    summed = summed.sum(axis=tuple(i for i, n in enumerate(bshape) if n == 1), keepdims=True)
    summed = summed.reshape(bshape)
    b, v = jnp.asarray(buf), jnp.asarray(value)
    v1 = lambda b, v: ops.in_place_accumulator(b, v, _flag(flag))
    v2 = lambda b, v: ops.in_place_accumulator_v2(b, v, _flag(flag))[1]
    for run in (lambda f: f(b, v), lambda f: jax.jit(f)(b, v)):
        np.testing.assert_allclose(np.asarray(run(v1)), buf if flag is False else buf + summed,
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(run(v2)), summed if flag is True else buf + summed,
                                   rtol=1e-12, atol=1e-12)


def test_overwrite_ignores_non_finite_buffer():
    buf = jnp.asarray([jnp.nan, jnp.inf, 1.0])
    _, out = ops.in_place_accumulator_v2(buf, jnp.ones(3), jnp.asarray([True]))
    np.testing.assert_array_equal(out, 1.0)


def test_donated_buffer_is_updated_in_place(rng):
    acc = jax.jit(lambda b, v, f: ops.in_place_accumulator_v2(b, v, f), donate_argnums=0)
    buf = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    value = jnp.asarray(rng.standard_normal((64, 32)), jnp.float16)
    expected = np.asarray(buf) + np.asarray(value, np.float32)
    hlo = acc.lower(buf, value, jnp.asarray([False])).compile().as_text()
    assert "input_output_alias" in hlo  # the output lives in the donated buffer
    _, out = acc(buf, value, jnp.asarray([False]))
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert buf.is_deleted()
    acc1 = jax.jit(lambda b, v: ops.in_place_accumulator(b, v), donate_argnums=0)
    assert "input_output_alias" in acc1.lower(out, value).compile().as_text()


def test_group_and_pass_through(rng):
    x = jnp.asarray(rng.standard_normal((2, 3)))
    i = jnp.arange(4)
    done = ops.group(x, i, jnp.asarray(True))
    assert done.dtype == jnp.bool_ and done.shape == (1,) and bool(done[0])
    outs = ops.pass_through(x, i)
    assert isinstance(outs, tuple) and len(outs) == 2
    np.testing.assert_array_equal(outs[0], x)
    np.testing.assert_array_equal(outs[1], i)
    # under jit the barrier keeps the inputs alive and the values unchanged
    f = jax.jit(lambda x: ops.group(x * 2)[0] & jnp.all(ops.pass_through(x + 1)[0] == x + 1))
    assert bool(f(x))
    assert "opt-barrier" in jax.jit(lambda x: ops.group(x * 2)).lower(x).as_text("hlo")


def test_grads(rng):
    buf, value = (jnp.asarray(rng.standard_normal((3, 4))) for _ in range(2))
    for flag in (None, jnp.asarray([True]), jnp.asarray([False])):
        check_grads(lambda b, v: ops.in_place_accumulator_v2(b, v, flag)[1], (buf, value),
                    order=2, modes=("fwd", "rev"))
    check_grads(lambda b, v: ops.in_place_accumulator(b, v, jnp.asarray([False])), (buf, value),
                order=2, modes=("fwd", "rev"))
    g = jax.grad(lambda b, v: jnp.sum(ops.in_place_accumulator_v2(b, v, jnp.asarray([True]))[1]),
                 (0, 1))(buf, value)
    np.testing.assert_array_equal(g[0], 0)  # overwritten: no gradient to the old buffer
    np.testing.assert_array_equal(g[1], 1)


def test_sharded_input_is_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    s = NamedSharding(mesh, P("x", None))
    buf = jax.device_put(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32), s)
    value = jax.device_put(jnp.asarray(rng.standard_normal((8, 6)), jnp.float32), s)
    # (the matrix checks in_place_accumulator and pass_through; these two skip its sharding check:
    # the flag output comes first, and the zeros are a constant fill XLA places replicated)
    fns = [lambda b, v: ops.in_place_accumulator_v2(b, v, jnp.asarray([False]))[1],
           lambda b, v: ops.zero_gradient(b, v)]
    for fn in fns:
        f = jax.jit(fn)
        hlo = f.lower(buf, value).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo
        np.testing.assert_array_equal(f(buf, value), fn(np.asarray(buf), np.asarray(value)))
    assert jax.jit(fns[0])(buf, value).sharding.spec[0] == "x"


def test_bad_input():
    f32 = jnp.ones((2, 3), jnp.float32)
    cases = [
        (ops.zero_gradient, (jnp.ones(3, jnp.int32), 1), TypeError, "old_gradient must be float"),
        (ops.in_place_accumulator, (jnp.ones((2, 3), jnp.int32), f32), TypeError, "old_sum"),
        (ops.in_place_accumulator, (f32, jnp.ones((3, 2))), ValueError, "broadcasts to"),
        (ops.in_place_accumulator, (f32, jnp.ones((3,))), ValueError, "broadcasts to"),
        (ops.in_place_accumulator, (f32, f32, jnp.asarray([1])), TypeError, "must be bool"),
        (ops.in_place_accumulator, (f32, f32, jnp.asarray([True, False])), ValueError,
         "one element"),
        (ops.in_place_accumulator_v2, (f32, jnp.ones((2, 3), jnp.int8)), TypeError, "value"),
        (ops.in_place_accumulator_v2, (f32, jnp.ones((2,))), ValueError, "broadcasts to"),
        (ops.in_place_accumulator_v2, (f32, jnp.ones((2, 1))), ValueError, "broadcasts to"),
        (ops.in_place_accumulator_v2, (f32, f32, jnp.ones(1)), TypeError, "overwrite_flag"),
        (ops.in_place_accumulator_v2, (f32, f32, jnp.zeros((0,), bool)), ValueError,
         "one element"),
        (ops.group, (), ValueError, "at least one input"),
        (ops.pass_through, (), ValueError, "at least one input"),
    ]
    for fn, args, error, text in cases:
        with pytest.raises(error, match=text) as info:
            fn(*args)
        assert f"jaxops.ops.{fn.__name__}" in str(info.value)
        if args:
            with pytest.raises(error, match=text):  # also at trace time
                jax.jit(fn)(*args)


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "ZeroGradient")] is ops.zero_gradient
    assert ops.ORT_OPS[(ms, "InPlaceAccumulator")] is ops.in_place_accumulator
    assert ops.ORT_OPS[(ms, "InPlaceAccumulatorV2")] is ops.in_place_accumulator_v2
    assert ops.ORT_OPS[(ms, "Group")] is ops.group
    assert ops.ORT_OPS[(ms, "PassThrough")] is ops.pass_through
