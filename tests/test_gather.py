"""GatherGrad, GatherElementsGrad, GatherNDGrad, SliceGrad and jaxops.nn.gather/embedding."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import ops
from jaxops.reference import gather as ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices


def matrix(cases):
    """Every case in f32; f64, f16 and bf16 each on every third case (a full cross product
    would compile hundreds of programs)."""
    out = [pytest.param(*c, jnp.float32, id=f"{c}-f32") for c in cases]
    for k, (dtype, name) in enumerate(zip(FLOAT_DTYPES[1:], DTYPE_IDS[1:])):
        out += [pytest.param(*c, dtype, id=f"{c}-{name}") for c in cases[k::3]]
    return out


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float64))


def random_float(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def random_indices(rng, shape, size, dtype=np.int32, bad=True):
    """Indices with duplicates, negatives and (when `bad`) out-of-range ones."""
    lo, hi = (-size - 3, size + 3) if bad else (-size, size)
    return jnp.asarray(rng.integers(lo, hi, shape), dtype)


def np_wrap(k, size):
    k = k + size if k < 0 else k
    return k if 0 <= k < size else None


def np_gather_grad(shape, idx, dy, axis):
    """float64 oracle: a loop over index positions."""
    outer, size, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    idx = np.asarray(idx).reshape(-1)
    dy = f64(dy).reshape(outer, idx.size, inner)
    out = np.zeros((outer, size, inner))
    for p, k in enumerate(idx):
        k = np_wrap(int(k), size)
        if k is not None:
            out[:, k] += dy[:, p]
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# GatherGrad

# (shape, axis, indices shape)
GG_CASES = [((6, 4), 0, (9,)), ((5, 3, 4), 1, (2, 3)), ((4, 7), 1, (11,)), ((4, 7), -1, ()),
            ((3, 50, 16), 1, (40,)), ((33, 24), 0, (64,)), ((2, 3, 5, 8), 2, (4, 2)),
            ((5, 8), 0, (0,)), ((1,), 0, (5,))]


@pytest.mark.parametrize("shape,axis,ishape,dtype", matrix(GG_CASES))
def test_gather_grad_matches_reference(rng, shape, axis, ishape, dtype):
    a = axis % len(shape)
    index_dtype = np.int64 if len(ishape) % 2 else np.int32  # both kinds over the cases
    idx = random_indices(rng, ishape, shape[a], index_dtype)
    dy = random_float(rng, shape[:a] + ishape + shape[a + 1:], dtype)
    out = ops.gather_grad(shape, idx, dy, axis=axis)
    assert out.dtype == dtype and out.shape == shape
    expected = np_gather_grad(shape, idx, dy, a)
    assert_close(out, expected, dtype)
    assert_close(ref.gather_grad(shape, idx, dy, axis), expected, dtype)


def test_gather_grad_static_shape_forms(rng):
    idx = jnp.array([1, 1, 0])
    dy = random_float(rng, (3, 2), jnp.float32)
    want = ops.gather_grad((3, 2), idx, dy)
    for shape in ([3, 2], np.array([3, 2], np.int64), jnp.array([3, 2])):
        np.testing.assert_array_equal(ops.gather_grad(shape, idx, dy), want)
    assert ops.gather_grad.spec.attrs == {"axis": 0}


def test_gather_grad_drops_out_of_range(rng):
    # indices V, -V-1 and far away add nothing anywhere; -1 wraps to V-1
    idx = jnp.array([4, -5, 1000, -1, 2, -1000], jnp.int32)
    dy = random_float(rng, (6, 3), jnp.float64)
    out = np.asarray(ops.gather_grad((4, 3), idx, dy))
    expected = np.zeros((4, 3))
    expected[3] = dy[3]
    expected[2] = dy[4]
    np.testing.assert_array_equal(out, expected)
    # all dropped: zeros
    np.testing.assert_array_equal(ops.gather_grad((4, 3), jnp.full((6,), 9), dy), 0)


@pytest.mark.parametrize("disable", [False, True], ids=["kernel", "reference"])
def test_int64_indices_beyond_int32_are_dropped(rng, monkeypatch, disable):
    """x64 on: an int64 index such as 2**32 + 1 is out of range and dropped on every path.
    (Narrowed to int32 before the range check it became 1 and added gradient to row 1.)"""
    if disable:
        monkeypatch.setenv("JAXOPS_DISABLE", "all")
    far = [2**32 + 1, -(2**32) + 1, 2**62]  # int32 casts: 1, 1, 0
    dy = random_float(rng, (2, 3), jnp.float64)
    # gather_elements_grad: element [0, 0] of dY goes to row 2, the far ones nowhere
    idx = jnp.array([[2, far[0], far[1]], [far[2], far[0], 2]], jnp.int64)
    out = np.asarray(ops.gather_elements_grad(dy, (4, 3), idx, axis=0))
    expected = np.zeros((4, 3))
    expected[2, 0], expected[2, 2] = dy[0, 0], dy[1, 2]
    np.testing.assert_array_equal(out, expected)
    # gather_nd_grad: one component far out of range drops the whole tuple
    idx = jnp.array([[1, 2], [far[0], 0], [0, far[1]], [3, far[2]]], jnp.int64)
    upd = random_float(rng, (4,), jnp.float64)
    out = np.asarray(ops.gather_nd_grad((4, 3), idx, upd))
    expected = np.zeros((4, 3))
    expected[1, 2] = upd[0]
    np.testing.assert_array_equal(out, expected)
    # vmap(gather_grad) with batched indices (the fold into one range of rows)
    idx = jnp.array([[0, far[0]], [far[1], 3]], jnp.int64)
    dy = random_float(rng, (2, 2, 3), jnp.float64)
    out = np.asarray(jax.vmap(lambda i, g: ops.gather_grad((4, 3), i, g))(idx, dy))
    expected = np.zeros((2, 4, 3))
    expected[0, 0], expected[1, 3] = dy[0, 0], dy[1, 1]
    np.testing.assert_array_equal(out, expected)
    # and vmap over the elements/nd ops
    idx = jnp.array([[[far[0], 1, 2]], [[0, far[2], 1]]], jnp.int64)
    dy = random_float(rng, (2, 1, 3), jnp.float64)
    out = np.asarray(jax.vmap(lambda g, i: ops.gather_elements_grad(g, (4, 3), i))(dy, idx))
    want = jax.vmap(lambda g, i: ref.gather_elements_grad(g, (4, 3), i))(dy, idx)
    np.testing.assert_array_equal(out, want)
    assert out[0, 1, 0] == 0 and out[1, 1, 1] == 0  # the far ones stayed out of row 1


def test_gather_grad_is_deterministic(rng):
    # heavy duplicates in a skewed distribution: the same bits every run
    n, v, d = 3000, 37, 40
    ids = np.minimum(rng.zipf(1.3, n) - 1, v - 1).astype(np.int32)
    dy = random_float(rng, (n, d), jnp.float32)
    fn = jax.jit(lambda i, g: ops.gather_grad((v, d), i, g))
    first = np.asarray(fn(ids, dy))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(ids, dy)), first)
    assert_close(first, np_gather_grad((v, d), ids, dy, 0), jnp.float32, ulps=64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gather_grad_long_runs(rng, dtype):
    # On CUDA a run of 2P or more rows (P = 32..256, about N / V) is summed in pieces of P over
    # several blocks: long runs of a few pieces (P = 256) and of many (P = 32, with a remainder),
    # among short ones; inner 1, 9 (not vectorised) and 64
    for shape, n, long in (((5, 64), 1500, 900), ((3, 1), 1200, 900), ((2, 9), 1100, 800),
                           ((300, 64), 2000, 1517)):
        ids = rng.integers(0, shape[0], n).astype(np.int32)
        ids[:long] = 1
        ids = rng.permutation(ids)
        dy = random_float(rng, (n, shape[1]), dtype)
        out = ops.gather_grad(shape, ids, dy)
        assert_close(out, np_gather_grad(shape, ids, dy, 0), dtype, ulps=32)


def test_gather_grad_writes_every_row(rng):
    # CUDA writes each dX row once (zeros where no index points) instead of zero-filling dX
    # first: a donated NaN buffer of dX's shape, which the output may reuse, must not show through
    v, d, n = 300, 64, 500
    ids = jnp.asarray(rng.integers(-40, 40, n), jnp.int32)  # most rows get no index
    dy = random_float(rng, (n, d), jnp.float32)
    fn = jax.jit(lambda buf, i, g: ops.gather_grad((v, d), i, g), donate_argnums=0)
    want = np_gather_grad((v, d), ids, dy, 0)
    for _ in range(3):
        out = np.asarray(fn(jnp.full((v, d), jnp.nan, jnp.float32), ids, dy))
        assert_close(out, want, jnp.float32, ulps=32)


def test_gather_grad_jit(rng):
    idx = random_indices(rng, (7,), 5)
    dy = random_float(rng, (3, 7, 2), jnp.float32)
    fn = jax.jit(lambda i, g: ops.gather_grad((3, 5, 2), i, g, axis=1))
    np.testing.assert_array_equal(fn(idx, dy), ops.gather_grad((3, 5, 2), idx, dy, axis=1))
    assert "jaxops_gather_grad" in str(jax.make_jaxpr(fn)(idx, dy))


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None), (1, 2), (None, 1)], ids=str)
@pytest.mark.parametrize("axis", [0, 1])
def test_gather_grad_vmap(rng, in_axes, axis):
    shape, batch = (5, 4), 3
    ishape = (6,)
    dshape = shape[:axis] + ishape + shape[axis + 1:]
    idx = random_indices(rng, (batch, *ishape) if in_axes[0] is not None else ishape, shape[axis])
    dy = random_float(rng, (batch, *dshape) if in_axes[1] is not None else dshape, jnp.float64)
    if in_axes[0] not in (None, 0):
        idx = jnp.moveaxis(idx, 0, in_axes[0])
    if in_axes[1] not in (None, 0):
        dy = jnp.moveaxis(dy, 0, in_axes[1])
    fn = lambda i, g: ops.gather_grad(shape, i, g, axis=axis)
    got = jax.vmap(fn, in_axes=in_axes)(idx, dy)
    want = jax.vmap(lambda i, g: ref.gather_grad(shape, i, g, axis), in_axes=in_axes)(idx, dy)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_gather_grad_vmap_of_grad(rng):
    idx = random_indices(rng, (3, 6), 5)
    dy = random_float(rng, (3, 6, 4), jnp.float64)
    w = random_float(rng, (5, 4), jnp.float64)
    loss = lambda impl: lambda i, g: jnp.sum(jnp.sin(impl((5, 4), i, g)) * w)
    for in_axes in ((0, 0), (None, 0), (0, None)):
        i = idx if in_axes[0] == 0 else idx[0]
        g = dy if in_axes[1] == 0 else dy[0]
        got = jax.vmap(jax.grad(loss(ops.gather_grad), 1), in_axes)(i, g)
        want = jax.vmap(jax.grad(loss(ref.gather_grad), 1), in_axes)(i, g)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,axis,ishape", [((5, 3), 0, (7,)), ((3, 4, 2), 1, (2, 3))],
                         ids=str)
def test_gather_grad_check_grads_order2(rng, shape, axis, ishape):
    idx = random_indices(rng, ishape, shape[axis])
    dy = random_float(rng, shape[:axis] + ishape + shape[axis + 1:], jnp.float64)
    check_grads(lambda g: ops.gather_grad(shape, idx, g, axis=axis), (dy,), order=2,
                modes=("fwd", "rev"))
    # reverse mode runs the kernel's transpose (a gather) and, one order up, the kernel again
    g2 = jax.grad(lambda g: jnp.sum(jax.grad(
        lambda h: jnp.sum(ops.gather_grad(shape, idx, h, axis=axis) ** 3))(g) ** 2))
    assert "jaxops_gather_grad" in str(jax.make_jaxpr(g2)(dy))


@pytest.mark.parametrize("spec", [P("x"), P("x", None, None), P(None, None, "x")], ids=str)
def test_gather_grad_sharded_is_not_gathered(rng, spec):
    # dY [8, N, 8] with the index axis 1: sharding the outer or inner dim needs no gather
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    idx = random_indices(rng, (6,), 5)
    dy = random_float(rng, (8, 6, 8), jnp.float32)
    fn = jax.jit(lambda i, g: ops.gather_grad((8, 5, 8), i, g, axis=1))
    dy_s = jax.device_put(dy, NamedSharding(mesh, spec))
    hlo = fn.lower(idx, dy_s).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = fn(idx, dy_s)
    assert out.sharding.spec[:len(spec)] == tuple(spec)[:len(out.sharding.spec)]
    # sums of f32 terms in another order: within a few ulps of the terms' magnitudes
    assert_close(out, ops.gather_grad((8, 5, 8), idx, dy, axis=1), jnp.float32,
                 scale=np_gather_grad((8, 5, 8), idx, np.abs(dy), 1))


def test_gather_grad_sharded_index_axis_stays_correct(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    idx = random_indices(rng, (8,), 5)
    dy = random_float(rng, (8, 3), jnp.float32)
    fn = jax.jit(lambda i, g: ops.gather_grad((5, 3), i, g))
    out = fn(jax.device_put(idx, NamedSharding(mesh, P("x"))),
             jax.device_put(dy, NamedSharding(mesh, P("x", None))))
    # each shard sums its own rows first: another f32 order than one device's. A sum of k
    # terms in any order is within (k - 1) eps of the sum of their magnitudes (plus its own
    # rounding); a relative bound failed where the terms cancelled (CI: 2e-6 off at 0.0147)
    rows = [np_wrap(int(i), 5) for i in np.asarray(idx)]
    k = np.bincount([r for r in rows if r is not None], minlength=5)[:, None]
    magnitude = np_gather_grad((5, 3), idx, np.abs(np.asarray(dy)), 0)
    exact = np_gather_grad((5, 3), idx, dy, 0)
    eps = np.finfo(np.float32).eps
    assert np.all(np.abs(np.asarray(out) - exact) <= (np.maximum(k - 1, 0) + 1) * eps * magnitude)


def test_gather_grad_bad_input():
    f32 = jnp.ones((3, 2), jnp.float32)
    i32 = jnp.zeros((3,), jnp.int32)
    cases = [
        (((4, 2), i32, jnp.ones((3, 2), jnp.int32)), {}, TypeError, "float16"),
        (((4, 2), jnp.zeros((3,), jnp.float32), f32), {}, TypeError, "int32 or int64"),
        (((4, 2), jnp.zeros((4,), jnp.int32), f32), {}, ValueError, "dY must have shape"),
        (((4, 3), i32, f32), {}, ValueError, "dY must have shape"),
        (((4, 2), i32, f32), {"axis": 2}, ValueError, "out of range"),
        (((4, 2), i32, f32), {"axis": 1.0}, TypeError, "axis must be an int"),
        (((), i32, f32), {}, ValueError, "rank >= 1"),
        (((4.5, 2.0), i32, f32), {}, TypeError, "1-D sequence of ints"),
        ((((4, 2),), i32, f32), {}, TypeError, "1-D"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.gather_grad(*args, **kwargs)
        assert "jaxops.ops.gather_grad" in str(info.value)
    # a traced shape cannot fix the output shape
    with pytest.raises(TypeError, match="jaxops.ops.gather_grad: shape must be static"):
        jax.jit(lambda s: ops.gather_grad(s, i32, f32))(jnp.array([4, 2]))


def test_disable_routes_to_reference(rng, monkeypatch):
    idx = random_indices(rng, (7,), 5)
    dy = random_float(rng, (7, 3), jnp.float32)
    trace = lambda: str(jax.make_jaxpr(lambda i, g: ops.gather_grad((5, 3), i, g))(idx, dy))
    for value in ("all", "softmax_grad, gather_grad"):
        monkeypatch.setenv("JAXOPS_DISABLE", value)
        assert "jaxops_gather_grad" not in trace()
        assert_close(ops.gather_grad((5, 3), idx, dy), np_gather_grad((5, 3), idx, dy, 0),
                     jnp.float32, scale=np_gather_grad((5, 3), idx, np.abs(dy), 0))
    monkeypatch.setenv("JAXOPS_DISABLE", "softmax_grad")
    assert "jaxops_gather_grad" in trace()


@pytest.mark.parametrize("name,call", [
    ("gather_elements_grad", lambda i, g: ops.gather_elements_grad(g, (5, 3), i[:, None] % 5)),
    ("gather_nd_grad", lambda i, g: ops.gather_nd_grad((5, 3), i[:, None], g)),
])
def test_disable_composites(rng, monkeypatch, name, call):
    idx = random_indices(rng, (7,), 5)
    dy = random_float(rng, (7, 3), jnp.float32) if name == "gather_nd_grad" else \
        random_float(rng, (7, 1), jnp.float32)
    want, scale = call(idx, dy), call(idx, jnp.abs(dy))  # a scatter-add: |dy| sums the terms
    monkeypatch.setenv("JAXOPS_DISABLE", name)
    assert "jaxops_gather_grad" not in str(jax.make_jaxpr(call)(idx, dy))
    assert_close(call(idx, dy), want, jnp.float32, scale=scale)


# ---------------------------------------------------------------------------------------------
# GatherElementsGrad


def np_gather_elements_grad(dy, shape, idx, axis):
    out = np.zeros(shape)
    dy, idx = f64(dy), np.asarray(idx)
    for pos in np.ndindex(*dy.shape):
        k = np_wrap(int(idx[pos]), shape[axis])
        if k is not None:
            target = list(pos)
            target[axis] = k
            out[tuple(target)] += dy[pos]
    return out


EL_CASES = [((5, 4), (7, 4), 0), ((5, 4), (3, 6), 1), ((5, 4), (2, 3), -1),
            ((3, 4, 5), (3, 2, 9), 2), ((3, 4, 5), (6, 4, 5), 0), ((6,), (10,), 0)]


@pytest.mark.parametrize("shape,dshape,axis,dtype", matrix(EL_CASES))
def test_gather_elements_grad_matches_reference(rng, shape, dshape, axis, dtype):
    a = axis % len(shape)
    idx = random_indices(rng, dshape, shape[a], np.int64 if dtype == jnp.float64 else np.int32)
    dy = random_float(rng, dshape, dtype)
    out = ops.gather_elements_grad(dy, shape, idx, axis=axis)
    assert out.dtype == dtype and out.shape == shape
    expected = np_gather_elements_grad(dy, shape, idx, a)
    assert_close(out, expected, dtype)
    assert_close(ref.gather_elements_grad(dy, shape, idx, axis), expected, dtype)


def test_gather_elements_grad_transforms(rng):
    shape, dshape = (4, 5), (3, 5)
    idx = random_indices(rng, (2, *dshape), 4)
    dy = random_float(rng, (2, *dshape), jnp.float64)
    fn = lambda g, i: ops.gather_elements_grad(g, shape, i, axis=0)
    want = jax.vmap(lambda g, i: ref.gather_elements_grad(g, shape, i, 0))(dy, idx)
    np.testing.assert_allclose(jax.vmap(fn)(dy, idx), want, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.vmap(fn, (0, None)))(dy, idx[0]),
                               jax.vmap(lambda g: ref.gather_elements_grad(g, shape, idx[0]))(dy),
                               rtol=1e-12)
    check_grads(lambda g: fn(g, idx[0]), (dy[0],), order=2, modes=("fwd", "rev"))
    assert "jaxops_gather_grad" in str(jax.make_jaxpr(fn)(dy[0], idx[0]))


def test_gather_elements_grad_bad_input():
    f32, i32 = jnp.ones((2, 3), jnp.float32), jnp.zeros((2, 3), jnp.int32)
    cases = [
        ((jnp.ones((2, 3), jnp.int32), (4, 3), i32), {}, TypeError, "float16"),
        ((f32, (4, 3), jnp.zeros((2, 3), jnp.float32)), {}, TypeError, "int32 or int64"),
        ((f32, (4, 3), jnp.zeros((3, 2), jnp.int32)), {}, ValueError, "share one shape"),
        ((f32, (4, 3, 1), i32), {}, ValueError, "rank of shape"),
        ((f32, (4, 2), i32), {}, ValueError, "must not exceed"),
        ((f32, (4, 3), i32), {"axis": 2}, ValueError, "out of range"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.gather_elements_grad(*args, **kwargs)
        assert "jaxops.ops.gather_elements_grad" in str(info.value)


# ---------------------------------------------------------------------------------------------
# GatherNDGrad


def np_gather_nd_grad(shape, idx, upd, b):
    out = np.zeros(shape)
    idx, upd = np.asarray(idx), f64(upd)
    for pos in np.ndindex(*idx.shape[:-1]):
        comps = [np_wrap(int(c), shape[b + j]) for j, c in enumerate(idx[pos])]
        if None not in comps:
            out[tuple(pos[:b]) + tuple(comps)] += upd[pos]
    return out


# (shape, indices shape, batch_dims)
ND_CASES = [((5, 4), (6, 1), 0), ((5, 4), (6, 2), 0), ((4, 3, 5), (2, 3, 2), 0),
            ((3, 4, 5), (3, 6, 1), 1), ((2, 3, 4, 5), (2, 3, 4, 1), 2), ((3, 4), (5, 0), 0),
            ((2, 5, 3), (2, 7, 2), 1)]


@pytest.mark.parametrize("shape,ishape,b,dtype", matrix(ND_CASES))
def test_gather_nd_grad_matches_reference(rng, shape, ishape, b, dtype):
    k = ishape[-1]
    idx = np.zeros(ishape, np.int64)
    for j in range(k):
        idx[..., j] = rng.integers(-shape[b + j] - 2, shape[b + j] + 2, ishape[:-1])
    upd = random_float(rng, ishape[:-1] + shape[b + k:], dtype)
    out = ops.gather_nd_grad(shape, jnp.asarray(idx), upd, batch_dims=b)
    assert out.dtype == dtype and out.shape == shape
    expected = np_gather_nd_grad(shape, idx, upd, b)
    assert_close(out, expected, dtype)
    assert_close(ref.gather_nd_grad(shape, jnp.asarray(idx), upd, b), expected, dtype)


def test_gather_nd_grad_transforms(rng):
    shape = (4, 3, 2)
    idx = jnp.asarray(rng.integers(0, 3, (2, 5, 2)), jnp.int32)
    upd = random_float(rng, (2, 5, 2), jnp.float64)
    fn = lambda i, u: ops.gather_nd_grad(shape, i, u)
    want = jax.vmap(lambda i, u: ref.gather_nd_grad(shape, i, u))(idx, upd)
    np.testing.assert_allclose(jax.jit(jax.vmap(fn))(idx, upd), want, rtol=1e-12)
    check_grads(lambda u: fn(idx[0], u), (upd[0],), order=2, modes=("fwd", "rev"))


def test_gather_nd_grad_bad_input():
    i64 = jnp.zeros((3, 1), jnp.int32)
    f32 = jnp.ones((3, 4), jnp.float32)
    cases = [
        (((5, 4), i64, jnp.ones((3, 4), jnp.int32)), {}, TypeError, "float16"),
        (((5, 4), jnp.zeros((3, 1), jnp.float32), f32), {}, TypeError, "int32 or int64"),
        (((5, 4), jnp.zeros((3, 3), jnp.int32), f32), {}, ValueError, "exceeds rank"),
        (((5, 4), i64, jnp.ones((3, 5), jnp.float32)), {}, ValueError, "update must have shape"),
        (((5, 4), i64, f32), {"batch_dims": 2}, ValueError, "batch_dims"),
        (((5, 4), i64, jnp.ones((3,), jnp.float32)), {"batch_dims": 1}, ValueError, "batch dims"),
        (((5, 4), jnp.int32(0), f32), {}, ValueError, "rank >= 1"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.gather_nd_grad(*args, **kwargs)
        assert "jaxops.ops.gather_nd_grad" in str(info.value)


# ---------------------------------------------------------------------------------------------
# SliceGrad

# (shape, starts, ends, axes, steps)
SLICES = [
    ((6, 5), [1, 0], [4, 5], None, None),
    ((6, 5), [-4], [-1], [1], None),
    ((6, 5), [0, 1], [100, 4], [0, 1], [2, 2]),
    ((6, 5), [5], [-100], [0], [-2]),
    ((6, 5), [-1, 4], [0, 0], [-2, -1], [-1, -3]),
    ((4, 3, 5), [1, -10], [3, 10], [2, 0], [1, 3]),
    ((4, 3, 5), [2], [2], [1], None),   # empty
    ((7,), [-100], [100], None, [3]),
    ((7,), [6], [-8], None, [-1]),
]


def np_slice(shape, starts, ends, axes, steps):
    where = [slice(None)] * len(shape)
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for a, s, e, st in zip(axes, starts, ends, steps):
        n = shape[a]
        if st < 0 and e < -n:
            e = None  # ONNX clamps ends to -1 ("before the first element") walking backwards
        where[a] = slice(s, e, st)
    return tuple(where)


@pytest.mark.parametrize("shape,starts,ends,axes,steps,dtype", matrix(SLICES))
def test_slice_grad_matches_numpy(rng, shape, starts, ends, axes, steps, dtype):
    where = np_slice(shape, starts, ends, axes, steps)
    dshape = np.zeros(shape)[where].shape
    dy = random_float(rng, dshape, dtype)
    out = ops.slice_grad(dy, shape, starts, ends, axes, steps)
    expected = np.zeros(shape)
    expected[where] = f64(dy)
    assert out.dtype == dtype
    np.testing.assert_array_equal(f64(out), expected)
    np.testing.assert_array_equal(f64(ref.slice_grad(dy, shape, starts, ends, axes, steps)),
                                  expected)


def test_slice_grad_is_a_pad(rng):
    # negative steps on two axes: pure XLA, no scatter (jit, vmap, check_grads and sharding:
    # tests/test_op_matrix.py)
    args = ((6, 5), [5, 0], [-100, 5], [0, 1], [-2, 2])
    dy = random_float(rng, (3, 3), jnp.float64)
    fn = lambda g: ops.slice_grad(g, *args)
    np.testing.assert_array_equal(fn(dy), ref.slice_grad(dy, *args))
    assert "scatter" not in jax.jit(fn).lower(dy).as_text()


def test_slice_grad_bad_input():
    f32 = jnp.ones((2, 3), jnp.float32)
    cases = [
        ((f32, (4, 3), [0], [2, 3]), {}, ValueError, "one length"),
        ((f32, (4, 3), [0], [2]), {"axes": [0, 1]}, ValueError, "length of starts"),
        ((f32, (4, 3), [0, 0], [2, 3]), {"axes": [0, 0]}, ValueError, "repeat"),
        ((f32, (4, 3), [0], [2]), {"axes": [2]}, ValueError, "out of range"),
        ((f32, (4, 3), [0], [2]), {"steps": [0]}, ValueError, "nonzero"),
        ((f32, (4, 3), [0], [3]), {}, ValueError, "sliced shape"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.slice_grad(*args, **kwargs)
        assert "jaxops.ops.slice_grad" in str(info.value)
    with pytest.raises(TypeError, match="jaxops.ops.slice_grad: starts must be static"):
        jax.jit(lambda s: ops.slice_grad(f32, (4, 3), s, [2]))(jnp.array([0]))


# ---------------------------------------------------------------------------------------------
# nn.gather / nn.embedding


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_nn_gather(rng, axis):
    x = random_float(rng, (5, 6, 4), jnp.float64)
    a = axis % 3
    idx = random_indices(rng, (3, 2), x.shape[a], bad=False)
    np.testing.assert_array_equal(jaxops.nn.gather(x, idx, axis), jnp.take(x, idx, axis=axis))
    w = random_float(rng, jnp.take(x, idx, axis=axis).shape, jnp.float64)
    loss = lambda f: lambda x: jnp.sum(jnp.cos(f(x)) * w)
    grad = jax.jit(jax.grad(loss(lambda x: jaxops.nn.gather(x, idx, axis))))
    np.testing.assert_allclose(grad(x), jax.grad(loss(lambda x: jnp.take(x, idx, axis=axis)))(x),
                               rtol=1e-12, atol=1e-12)
    assert "jaxops_gather_grad" in str(jax.make_jaxpr(grad)(x))  # backward runs the kernel
    check_grads(lambda x: jaxops.nn.gather(x, idx, axis), (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_nn_embedding(rng, dtype):
    table = random_float(rng, (11, 8), dtype)
    ids = jnp.asarray(rng.integers(0, 11, (4, 6)), jnp.int32)
    out = jaxops.nn.embedding(table, ids)
    np.testing.assert_array_equal(f64(out), f64(table)[np.asarray(ids)])
    g = jax.grad(lambda t: jnp.sum(jaxops.nn.embedding(t, ids).astype(jnp.float64) ** 2))(table)
    assert g.dtype == dtype
    t64 = f64(table)
    expected = np_gather_grad((11, 8), ids, 2 * t64[np.asarray(ids)], 0)
    assert_close(g, expected, dtype, ulps=16)


def test_nn_embedding_vmap_of_grad_and_out_of_range(rng):
    table = random_float(rng, (7, 3), jnp.float64)
    ids = jnp.array([[0, 6, -1, 7], [2, 2, -8, 100]])  # 7, -8, 100: out of range
    out = jax.vmap(jaxops.nn.embedding, (None, 0))(table, ids)
    np.testing.assert_array_equal(out[0, 3], 0)
    np.testing.assert_array_equal(out[0, 2], table[6])
    g = jax.vmap(jax.grad(lambda t, i: jnp.sum(jaxops.nn.embedding(t, i))), (None, 0))(table, ids)
    expected = np.zeros((2, 7, 3))
    for b, row in enumerate(np.asarray(ids)):
        for k in row:
            if np_wrap(int(k), 7) is not None:
                expected[b, np_wrap(int(k), 7)] += 1
    np.testing.assert_array_equal(g, expected)


def test_sharded_grad_of_embedding(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    table = jax.device_put(random_float(rng, (10, 16), jnp.float32),
                           NamedSharding(mesh, P(None, "x")))
    ids = jnp.asarray(rng.integers(0, 10, (12,)), jnp.int32)
    grad = jax.jit(jax.grad(lambda t: jnp.sum(jaxops.nn.embedding(t, ids) ** 2)))
    assert "all-gather" not in grad.lower(table).compile().as_text()
    g = grad(table)
    assert g.sharding.spec[1] == "x"
    np.testing.assert_allclose(g, np_gather_grad((10, 16), ids, 2 * f64(table)[np.asarray(ids)],
                                                 0), rtol=1e-5)


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "GatherGrad")] is ops.gather_grad
    assert ops.ORT_OPS[(ms, "GatherElementsGrad")] is ops.gather_elements_grad
    assert ops.ORT_OPS[(ms, "GatherNDGrad")] is ops.gather_nd_grad
    assert ops.ORT_OPS[(ms, "SliceGrad")] is ops.slice_grad


# ---------------------------------------------------------------------------------------------
# Large shapes on the GPU: many chunks, long Zipf runs, 16-byte vectors; the same bits each run


def np_gather_grad_fast(v, ids, dy):
    out = np.zeros((v, dy.shape[1]))
    k = np.where(ids < 0, ids + v, ids)
    keep = (k >= 0) & (k < v)
    np.add.at(out, k[keep], f64(dy)[keep])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("v,d,n,zipf", [(50304, 64, 16384, 1.2), (1024, 256, 65536, None),
                                        (7, 1000, 20000, None), (3000, 1, 40000, 1.1)], ids=str)
def test_gather_grad_large_on_gpu(rng, dtype, v, d, n, zipf):
    if jax.default_backend() != "gpu":
        pytest.skip("runs on the GPU (JAX_PLATFORMS=cuda)")
    ids = (np.minimum(rng.zipf(zipf, n) - 1, v + 5) if zipf else rng.integers(-v, v + 5, n))
    ids = jnp.asarray(ids, jnp.int32)
    dy = random_float(rng, (n, d), dtype)
    fn = jax.jit(lambda i, g: ops.gather_grad((v, d), i, g))
    first = np.asarray(fn(ids, dy).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(fn(ids, dy).astype(jnp.float32)), first)
    assert_close(first, np_gather_grad_fast(v, np.asarray(ids), dy), dtype, ulps=64)
