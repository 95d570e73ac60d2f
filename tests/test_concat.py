"""ConcatTraining, SplitTraining and jaxops.nn.concat / split."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import ops
from jaxops.reference import concat as ref
from helpers import on_cpu_devices

ALL_DTYPES = [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16, jnp.int8, jnp.int16,
              jnp.int32, jnp.int64, jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64, jnp.bool_]
ALL_IDS = ["f32", "f64", "f16", "bf16", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64",
           "bool"]

# (shapes of the inputs, axis): odd widths and zero-length pieces included
CASES = [
    ([(5,)], 0),
    ([(3,), (4,)], -1),
    ([(2, 3), (2, 5), (2, 1)], 1),
    ([(2, 3), (4, 3)], 0),
    ([(2, 3, 4), (2, 1, 4), (2, 0, 4), (2, 7, 4)], 1),
    ([(2, 3, 4), (2, 3, 5)], -1),
    ([(3, 2, 7), (3, 2, 9)], 2),
    ([(1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)], -3),
    ([(0, 4), (0, 2)], 1),
    ([(4, 1024)] * 8, 1),  # the benchmark's layout, scaled down
]
CASE_IDS = [f"{len(s)}x{'x'.join(map(str, s[0]))}-ax{a}" for s, a in CASES]


def random(rng, shape, dtype):
    if dtype == jnp.bool_:
        return jnp.asarray(rng.random(shape) < 0.5)
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(np.dtype(dtype))
        return jnp.asarray(rng.integers(info.min, info.max, shape, dtype=np.dtype(dtype),
                                        endpoint=True))
    return jnp.asarray(rng.standard_normal(shape) * 100, dtype)


MATRIX = [(d, c) for d, i in zip(ALL_DTYPES, ALL_IDS) for c in
          (CASES if i == "f32" else CASES[4:5] + CASES[9:])]
MATRIX_IDS = [f"{np.dtype(d).name}-{CASE_IDS[CASES.index(c)]}" for d, c in MATRIX]


@pytest.mark.parametrize("dtype,case", MATRIX, ids=MATRIX_IDS)
def test_concat_matches_numpy(rng, dtype, case):
    shapes, axis = case
    xs = [random(rng, s, dtype) for s in shapes]
    out, lengths = ops.concat_training(*xs, axis=axis)
    expected = np.concatenate([np.asarray(x) for x in xs], axis=axis)
    assert out.dtype == dtype and out.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)  # a copy: bit-exact
    assert isinstance(lengths, np.ndarray) and lengths.dtype == np.int64
    np.testing.assert_array_equal(lengths, [s[axis] for s in shapes])
    np.testing.assert_array_equal(np.asarray(ref.concat(*xs, axis=axis)), expected)


@pytest.mark.parametrize("dtype,case", MATRIX, ids=MATRIX_IDS)
def test_split_matches_numpy(rng, dtype, case):
    shapes, axis = case
    sizes = [s[axis] for s in shapes]
    whole = list(shapes[0])
    whole[axis] = sum(sizes)
    x = random(rng, tuple(whole), dtype)
    outs = ops.split_training(x, np.array(sizes, np.int64), axis=axis)
    expected = np.split(np.asarray(x), np.cumsum(sizes)[:-1], axis=axis)
    assert isinstance(outs, tuple) and len(outs) == len(sizes)
    for o, e in zip(outs, expected):
        assert o.dtype == dtype and o.shape == e.shape
        np.testing.assert_array_equal(np.asarray(o), e)


def test_roundtrip_and_split_forms(rng):
    xs = [random(rng, (3, n), jnp.float32) for n in (2, 5, 1)]
    out, lengths = ops.concat_training(*xs, axis=1)
    # per_input_length feeds SplitTraining, as in ORT's gradient graphs; also under jit
    for split in (lengths, tuple(lengths), list(lengths), jnp.asarray(lengths)):
        for a, b in zip(ops.split_training(out, split, axis=1), xs):
            np.testing.assert_array_equal(a, b)
    jitted = jax.jit(lambda *xs: ops.split_training(*ops.concat_training(*xs, axis=-1), axis=-1))
    for a, b in zip(jitted(*xs), xs):
        np.testing.assert_array_equal(a, b)
    # empty split: num_outputs equal parts
    x = random(rng, (6, 4), jnp.float32)
    for split in ([], (), np.zeros((0,), np.int64)):
        parts = ops.split_training(x, split, axis=0, num_outputs=3)
        assert [p.shape for p in parts] == [(2, 4)] * 3
        np.testing.assert_array_equal(jnp.concatenate(parts), x)
    # ORT's split input is required (it may be empty, not absent)
    with pytest.raises(TypeError, match="jaxops.ops.split_training: split is required"):
        ops.split_training(x, None, axis=0, num_outputs=3)


def test_default_axis():
    assert ops.split_training.spec.attrs == {"axis": 0}
    assert ops.split_training.spec.options == {"num_outputs": None}
    with pytest.raises(TypeError, match="concat_training: missing a required argument: 'axis'"):
        ops.concat_training(jnp.ones(2))  # ConcatTraining's axis has no default


def test_many_inputs(rng):
    # more pieces than one CUDA launch's table holds (128)
    xs = [random(rng, (3, 1 + i % 4), jnp.float32) for i in range(300)]
    out, lengths = ops.concat_training(*xs, axis=1)
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=1))
    for a, b in zip(ops.split_training(out, lengths, axis=1), xs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype,width", [(jnp.int8, 3), (jnp.float16, 5), (jnp.float32, 7),
                                         (jnp.float64, 1), (jnp.bfloat16, 4096)])
def test_word_widths(rng, dtype, width):
    # rows and offsets of every alignment: the CUDA kernel picks its word size from them
    xs = [random(rng, (9, width * k), dtype) for k in (1, 2, 3)]
    out, lengths = ops.concat_training(*xs, axis=1)
    np.testing.assert_array_equal(np.asarray(out), np.concatenate([np.asarray(x) for x in xs], 1))
    for a, b in zip(ops.split_training(out, lengths, axis=1), xs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


VMAP_AXES = [(1, 1), (2, 0), (0, None), (None, 1), (-1, -1)]


# axis -1: tests/test_op_matrix.py; here the batch dim lands before the joined one
@pytest.mark.parametrize("in_axes", VMAP_AXES, ids=str)
def test_vmap_concat(rng, in_axes, axis=0):
    a, b = random(rng, (3, 4, 5), jnp.float32), random(rng, (3, 4, 5), jnp.float32)
    args = [x if d is None else jnp.moveaxis(x, 0, d) for x, d in zip((a, b), in_axes)]
    args = [x[0] if d is None else x for x, d in zip(args, in_axes)]
    got = jax.vmap(lambda x, y: ops.concat_training(x, y, axis=axis)[0], in_axes)(*args)
    want = jax.vmap(lambda x, y: jnp.concatenate([x, y], axis), in_axes)(*args)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("in_axis", [0, 1, -1])
def test_vmap_split(rng, in_axis):  # axis -1: tests/test_op_matrix.py
    x = jnp.moveaxis(random(rng, (3, 6, 5), jnp.float32), 0, in_axis)
    got = jax.vmap(lambda x: ops.split_training(x, (4, 2), axis=0), in_axis)(x)
    want = jax.vmap(lambda x: ref.split(x, sizes=(4, 2), axis=0), in_axis)(x)
    jax.tree.map(np.testing.assert_array_equal, got, want)


# ConcatTraining's grad checks stay here: its int64 per_input_length output has no tangent
# check_grads accepts (tests/test_op_matrix.py runs SplitTraining's)
def test_vmap_of_grad(rng):
    a, b = random(rng, (3, 4, 2), jnp.float64), random(rng, (3, 4, 3), jnp.float64)
    w = random(rng, (4, 5), jnp.float64)

    def loss(cat, a, b):
        return jnp.sum(jnp.sin(cat(a, b)) * w)
    mine = lambda a, b: ops.concat_training(a, b, axis=1)[0]
    plain = lambda a, b: jnp.concatenate([a, b], 1)
    for in_axes in ((0, 0), (0, None), (None, 0)):
        args = (a if in_axes[0] == 0 else a[0], b if in_axes[1] == 0 else b[0])
        got = jax.vmap(jax.grad(functools.partial(loss, mine), (0, 1)), in_axes)(*args)
        want = jax.vmap(jax.grad(functools.partial(loss, plain), (0, 1)), in_axes)(*args)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-12), got, want)


@pytest.mark.parametrize("shapes,axis", [([(2, 3, 2), (1, 3, 2)], 0),
                                         ([(2, 2, 1), (2, 2, 3), (2, 2, 2)], -1)])
def test_check_grads_order2(rng, shapes, axis):
    xs = tuple(random(rng, s, jnp.float64) for s in shapes)
    check_grads(lambda *xs: ops.concat_training(*xs, axis=axis)[0], xs, order=2,
                modes=("fwd", "rev"))
    if axis == 0:  # axis -1: tests/test_op_matrix.py
        sizes = tuple(s[axis] for s in shapes)
        whole = ops.concat_training(*xs, axis=axis)[0]
        check_grads(lambda x: ops.split_training(x, sizes, axis=axis), (whole,), order=2,
                    modes=("fwd", "rev"))


def test_reverse_mode_runs_the_other_kernel(rng):
    a, b = random(rng, (3, 2), jnp.float32), random(rng, (3, 4), jnp.float32)
    cat = lambda a, b: jnp.sum(ops.concat_training(a, b, axis=1)[0] ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(cat, (0, 1)))(a, b))
    assert "jaxops_split_training" in jaxpr
    x = random(rng, (3, 6), jnp.float32)
    spl = lambda x: jnp.sum(ops.split_training(x, (2, 4), axis=1)[1] ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(spl))(x))
    assert "jaxops_concat_training" in jaxpr
    # a piece without cotangent gets zeros
    np.testing.assert_array_equal(jax.grad(spl)(x)[:, :2], 0)
    np.testing.assert_allclose(jax.grad(spl)(x)[:, 2:], 2 * x[:, 2:])


def test_nn(rng):
    xs = [random(rng, (4, n, 3), jnp.float64) for n in (2, 1, 5)]
    w = random(rng, (4, 8, 3), jnp.float64)
    np.testing.assert_array_equal(jaxops.nn.concat(xs, 1), jnp.concatenate(xs, 1))
    loss = lambda xs: jnp.sum(jnp.cos(jaxops.nn.concat(xs, axis=1)) * w)
    assert "jaxops_split_training" in str(jax.make_jaxpr(jax.grad(loss))(xs))
    want = jax.grad(lambda xs: jnp.sum(jnp.cos(jnp.concatenate(xs, 1)) * w))(xs)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-12), jax.grad(loss)(xs), want)
    check_grads(lambda *xs: jaxops.nn.concat(xs, axis=1), tuple(xs), order=2, modes=("fwd", "rev"))

    x = jnp.concatenate(xs, 1)
    parts = jaxops.nn.split(x, [2, 1, 5], axis=1)
    assert isinstance(parts, list)
    jax.tree.map(np.testing.assert_array_equal, parts, xs)
    sloss = lambda x: sum(jnp.sum(jnp.sin(p) * (i + 1)) for i, p in enumerate(
        jaxops.nn.split(x, (2, 1, 5), axis=1)))
    assert "jaxops_concat_training" in str(jax.make_jaxpr(jax.grad(sloss))(x))
    check_grads(lambda x: jaxops.nn.split(x, (2, 1, 5), axis=1), (x,), order=2,
                modes=("fwd", "rev"))
    with pytest.raises(ValueError, match="jaxops.nn.split"):
        jaxops.nn.split(x, [], axis=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=str)
def test_grad_dtypes(rng, dtype):
    a, b = random(rng, (3, 2), dtype), random(rng, (3, 5), dtype)
    ga, gb = jax.grad(lambda a, b: jnp.sum(jaxops.nn.concat([a, b], 1).astype(jnp.float32) *
                                           jnp.arange(7.0)), (0, 1))(a, b)
    assert ga.dtype == dtype and gb.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ga, np.float32), np.broadcast_to(np.arange(2.0), (3, 2)))
    np.testing.assert_array_equal(np.asarray(gb, np.float32),
                                  np.broadcast_to(np.arange(2.0, 7.0), (3, 5)))


def test_integer_inputs_under_jvp(rng):
    # ints carry float0 tangents; concat of ints inside a differentiated function works
    a = random(rng, (2, 3), jnp.int32)
    f = lambda x: jnp.sum(x * ops.concat_training(a, a, axis=0)[0].astype(x.dtype))
    np.testing.assert_array_equal(jax.grad(f)(jnp.ones((4, 3))), jnp.concatenate([a, a]))
    _, t = jax.jvp(lambda a: ops.concat_training(a, a, axis=1)[0], (a,),
                   (np.zeros(a.shape, jax.dtypes.float0),))
    assert t.dtype == jax.dtypes.float0 and t.shape == (2, 6)


# dim 0 sharded: tests/test_op_matrix.py
@pytest.mark.parametrize("spec", [P(None, None, "x")], ids=str)
def test_sharded_input_is_not_gathered(rng, spec):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sharding = NamedSharding(mesh, spec)
    xs = [jax.device_put(random(rng, (8, n, 4), jnp.float32), sharding) for n in (3, 5)]
    fn = jax.jit(lambda a, b: ops.concat_training(a, b, axis=1)[0])
    hlo = fn.lower(*xs).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = fn(*xs)
    np.testing.assert_array_equal(out, np.concatenate([np.asarray(x) for x in xs], 1))
    assert out.sharding.spec[:len(spec)] == tuple(spec)[:len(out.sharding.spec)]
    sp = jax.jit(lambda x: ops.split_training(x, (3, 5), axis=1))
    whole = jax.device_put(out, sharding)
    hlo = sp.lower(whole).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    for o, x in zip(sp(whole), xs):
        np.testing.assert_array_equal(o, x)
        assert o.sharding.spec[:len(spec)] == tuple(spec)[:len(o.sharding.spec)]


def test_sharded_grad_is_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sharding = NamedSharding(mesh, P("x", None))
    xs = [jax.device_put(random(rng, (8, n), jnp.float32), sharding) for n in (3, 5)]
    grad = jax.jit(jax.grad(lambda xs: jnp.sum(jaxops.nn.concat(xs, 1) ** 2)))
    assert "all-gather" not in grad.lower(xs).compile().as_text()
    for g, x in zip(grad(xs), xs):
        np.testing.assert_allclose(g, 2 * x, rtol=1e-6)


def test_sharded_concat_axis_stays_correct(rng):
    # sharding the concatenated dim needs it whole: correct, with communication
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sharding = NamedSharding(mesh, P(None, "x"))
    xs = [jax.device_put(random(rng, (3, 8), jnp.float32), sharding) for _ in range(2)]
    out = jax.jit(lambda a, b: ops.concat_training(a, b, axis=1)[0])(*xs)
    np.testing.assert_array_equal(out, np.concatenate([np.asarray(x) for x in xs], 1))
    parts = jax.jit(lambda x: ops.split_training(x, (4, 12), axis=1))(jax.device_put(out, sharding))
    np.testing.assert_array_equal(parts[1], np.asarray(out)[:, 4:])


def test_bad_input():
    f32 = jnp.ones((2, 3), jnp.float32)
    concat_cases = [
        ((), {"axis": 0}, ValueError, "at least one input"),
        ((f32, jnp.ones((2, 3), jnp.float64)), {"axis": 0}, TypeError, "share one dtype"),
        ((f32, jnp.ones((2, 3, 1), jnp.float32)), {"axis": 0}, ValueError, "share one rank"),
        ((f32, jnp.ones((3, 3), jnp.float32)), {"axis": 1}, ValueError, "differ only along"),
        ((f32, f32), {"axis": 2}, ValueError, "out of range"),
        ((f32, f32), {"axis": -3}, ValueError, "out of range"),
        ((f32, f32), {"axis": 1.0}, TypeError, "axis must be an int"),
        ((jnp.float32(1), jnp.float32(1)), {"axis": 0}, ValueError, "rank >= 1"),
        ((jnp.ones(2, jnp.complex64),), {"axis": 0}, TypeError, "unsupported dtype"),
    ]
    for args, kwargs, error, text in concat_cases:
        with pytest.raises(error, match=text) as info:
            ops.concat_training(*args, **kwargs)
        assert "jaxops.ops.concat_training" in str(info.value)
        if args:
            with pytest.raises(error, match=text):  # also at trace time
                jax.jit(lambda *a: ops.concat_training(*a, **kwargs))(*args)
    x = jnp.ones((4, 6), jnp.float32)
    split_cases = [
        ((x, (2, 3)), {"axis": 1}, ValueError, "add up to 5"),
        ((x, (7, -1)), {"axis": 1}, ValueError, ">= 0"),
        ((x, [[2, 4]]), {"axis": 1}, TypeError, "1-D sequence of ints"),
        ((x, [2.0, 4.0]), {"axis": 1}, TypeError, "1-D sequence of ints"),
        ((x, (2, 4)), {"axis": 2}, ValueError, "out of range"),
        ((x, (2, 4)), {"axis": 1, "num_outputs": 3}, ValueError, "num_outputs is 3"),
        ((x, ()), {"axis": 1}, ValueError, "needs num_outputs"),
        ((x, ()), {"axis": 1, "num_outputs": 4}, ValueError, "divide evenly"),
        ((x, ()), {"axis": 1, "num_outputs": 0}, ValueError, ">= 1"),
        ((jnp.ones(2, jnp.complex64), (1, 1)), {}, TypeError, "unsupported dtype"),
    ]
    for args, kwargs, error, text in split_cases:
        with pytest.raises(error, match=text) as info:
            ops.split_training(*args, **kwargs)
        assert "jaxops.ops.split_training" in str(info.value)
    # a traced split cannot give static shapes
    with pytest.raises(TypeError, match="split must be static") as info:
        jax.jit(lambda x, s: ops.split_training(x, s, axis=1))(x, jnp.array([2, 4]))
    assert "jaxops.ops.split_training" in str(info.value)


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "ConcatTraining")] is ops.concat_training
    assert ops.ORT_OPS[(ms, "SplitTraining")] is ops.split_training


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,shapes,axis", [
    (jnp.float32, [(4096, 1024)] * 8, 1),            # the benchmark shape: many blocks a piece
    (jnp.bfloat16, [(4096, 512), (4096, 1536)] * 4, 1),
    (jnp.int8, [(3001, 7), (3001, 1), (3001, 13)], 1),  # 1-byte words
    (jnp.float32, [(700, 3, 5)] * 200, 1),           # two launches of the piece table
])
def test_large_on_gpu(dtype, shapes, axis):
    key = jax.random.key(0)
    xs = [jax.random.randint(k, s, -100, 100).astype(dtype)
          for k, s in zip(jax.random.split(key, len(shapes)), shapes)]
    out, lengths = ops.concat_training(*xs, axis=axis)
    assert bool(jnp.all(out == jnp.concatenate(xs, axis=axis)))
    for a, b in zip(ops.split_training(out, lengths, axis=axis), xs):
        assert bool(jnp.all(a == b))
