"""Collectives against numpy references of ORT's semantics, on 8 forced CPU devices or, under
JAX_PLATFORMS=cuda, on every GPU of the machine (NCCL; tests that need a mesh of another
size skip there)."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FLOAT_DTYPES, assert_close, on_cpu_devices, world
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jaxops import ops

WORLD = world(8)


def _mesh(shape=None, names=("data",)):
    shape = shape or (WORLD,)
    if math.prod(shape) < 2:
        pytest.skip("a collective needs 2 devices")
    devices = on_cpu_devices(math.prod(shape))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


def _per_rank(fn, mesh, *stacked):
    """Runs fn on every rank; stacked[i][r] is rank r's operand i. Returns outputs stacked
    the same way (leading dim = rank)."""
    axes = mesh.axis_names
    spec = P(axes)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in stacked]

    def body(*xs):
        out = fn(*[x[0] for x in xs])
        return jax.tree.map(lambda y: y[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(placed),
                                 out_specs=spec))(*placed)


def _owners(sizes, world):
    per_rank = max(1, math.ceil(sum(sizes) / (world * 32))) * 32
    starts = np.cumsum([0] + sizes[:-1])
    return [s // per_rank for s in starts], per_rank


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_reduce_sums_every_input(rng, dtype):
    mesh = _mesh()
    a = rng.standard_normal((WORLD, 3, 5)).astype(dtype)
    b = rng.standard_normal((WORLD, 7)).astype(dtype)
    ra, rb = _per_rank(lambda x, y: ops.nccl_all_reduce(x, y), mesh, a, b)
    for r in range(WORLD):
        assert_close(ra[r], a.astype(np.float64).sum(0), dtype, ulps=16)
        assert_close(rb[r], b.astype(np.float64).sum(0), dtype, ulps=16)


def test_all_reduce_is_one_collective(rng):
    mesh = _mesh()
    xs = [rng.standard_normal((WORLD, n)).astype(np.float32) for n in (3, 64, 5)]
    spec = P("data")
    f = jax.jit(jax.shard_map(lambda *v: ops.nccl_all_reduce(*v), mesh=mesh,
                              in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    hlo = f.lower(*[jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]).compile().as_text()
    ops_ = [line for line in hlo.splitlines() if re.search(r"all-reduce(-start)?\(", line)]
    assert len(ops_) == 1, ops_  # XLA combines the variadic psum into one all-reduce


@pytest.mark.parametrize("sizes", [[5, 7, 3], [32, 32, 20, 12, 32, 32], [1], [64] * 8])
def test_all_gather_takes_each_tensor_from_its_owner(rng, sizes):
    mesh = _mesh()
    xs = [rng.standard_normal((WORLD, n)).astype(np.float32) for n in sizes]
    owners, _ = _owners(sizes, WORLD)
    outs = _per_rank(lambda *v: ops.nccl_all_gather(*v), mesh, *xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for i, (x, out) in enumerate(zip(xs, outs)):
        for r in range(WORLD):
            np.testing.assert_array_equal(out[r], x[owners[i]], err_msg=f"tensor {i} rank {r}")


@pytest.mark.parametrize("sizes", [[5, 7, 3], [32, 32, 20, 12, 32, 32], [64] * 8])
def test_reduce_scatter_sums_own_tensors_copies_the_rest(rng, sizes):
    mesh = _mesh()
    xs = [rng.standard_normal((WORLD, n)) for n in sizes]
    owners, _ = _owners(sizes, WORLD)
    outs = _per_rank(lambda *v: ops.nccl_reduce_scatter(*v), mesh, *xs)
    for i, (x, out) in enumerate(zip(xs, outs)):
        for r in range(WORLD):
            want = x.sum(0) if owners[i] == r else x[r]
            np.testing.assert_allclose(out[r], want, rtol=1e-12, err_msg=f"tensor {i} rank {r}")


def test_straddling_tensor_is_refused(rng):
    mesh = _mesh()
    xs = [rng.standard_normal((WORLD, n)).astype(np.float32) for n in (20, 30)]  # 2nd spans 20..49
    with pytest.raises(ValueError, match="straddles"):
        _per_rank(lambda *v: ops.nccl_all_gather(*v), mesh, *xs)


def test_megatron_f_and_g_gradients(rng):
    """f: identity forward, gradient summed over "model"; g: sum forward, gradient passed
    through (as in Megatron, where what follows g is the same on every model rank)."""
    mesh = _mesh((2, 4), ("data", "model"))
    x = rng.standard_normal((2, 4, 6))
    w_varying = rng.standard_normal((2, 4, 6))
    w_replicated = rng.standard_normal((2, 6))
    xs, ws, wr = P("data", "model"), P("data", "model"), P("data")
    place = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))

    def run(fn, w, w_spec):
        pick = (lambda w: w[0, 0]) if w_spec == ws else (lambda w: w[0])

        def body(x, w):
            loss = lambda x: jnp.sum(fn(x[0, 0]) * pick(w))
            return jax.grad(loss)(x), fn(x[0, 0])[None, None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, w_spec),
                                     out_specs=(xs, xs)))(place(x, xs), place(w, w_spec))

    gf, yf = run(ops.megatron_f, w_varying, ws)
    np.testing.assert_allclose(yf, x)
    np.testing.assert_allclose(gf, np.broadcast_to(w_varying.sum(1, keepdims=True), x.shape),
                               rtol=1e-12)
    gg, yg = run(lambda v: ops.megatron_g(v, group_type=1), w_replicated, wr)
    np.testing.assert_allclose(yg, np.broadcast_to(x.sum(1, keepdims=True), x.shape), rtol=1e-12)
    np.testing.assert_allclose(gg, np.broadcast_to(w_replicated[:, None], x.shape))


def _adasum_reference(grads):
    grads = [g.astype(np.float64) for g in grads]
    distance = 1
    while distance < len(grads):
        new = []
        for r, a in enumerate(grads):
            b = grads[r ^ distance]
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1 - dot / (2 * aa) if aa > 0 else 1.0
            cb = 1 - dot / (2 * bb) if bb > 0 else 1.0
            new.append(ca * a + cb * b)
        grads, distance = new, distance * 2
    return grads[0]


def test_adasum_matches_reference_and_ranks_agree(rng):
    mesh = _mesh()
    a = rng.standard_normal((WORLD, 33))
    b = rng.standard_normal((WORLD, 4))
    b[-1] = 0  # a zero gradient keeps coefficient 1
    ra, rb = _per_rank(lambda x, y: ops.adasum_all_reduce(x, y), mesh, a, b)
    np.testing.assert_allclose(ra[0], _adasum_reference(list(a)), rtol=1e-10)
    np.testing.assert_allclose(rb[0], _adasum_reference(list(b)), rtol=1e-10)
    for r in range(WORLD):  # every rank holds the same bits
        np.testing.assert_array_equal(ra[r], ra[0])
    # two identical gradients: adasum gives the gradient itself, not twice it
    same = np.broadcast_to(a[:1], a.shape)
    np.testing.assert_allclose(_per_rank(ops.adasum_all_reduce, mesh, same)[0], a[0], rtol=1e-12)


def test_adasum_refuses_non_power_of_two_and_hierarchical(rng):
    mesh = _mesh((6,), ("data",))
    with pytest.raises(ValueError, match="power of two"):
        _per_rank(ops.adasum_all_reduce, mesh, rng.standard_normal((6, 3)))
    with pytest.raises(ValueError, match="reduce_algo 2"):
        _per_rank(lambda x: ops.adasum_all_reduce(x, reduce_algo=2), _mesh(), rng.standard_normal((WORLD, 3)))


# jax 0.8 cannot transpose all_gather's transpose (a TypeError inside jax), fixed later
_OLD_JAX = jax.__version_info__[:2] < (0, 9)
ORDER = {"adasum_all_reduce": 1, **({"nccl_all_gather": 1, "nccl_reduce_scatter": 1} if _OLD_JAX else {})}


@pytest.mark.parametrize("name", ["nccl_all_reduce", "nccl_all_gather", "nccl_reduce_scatter",
                                  "adasum_all_reduce"])
def test_check_grads(rng, name):
    mesh = _mesh()
    fn = getattr(ops, name)
    x = rng.standard_normal((WORLD, 5))
    y = rng.standard_normal((WORLD, 20))
    f = lambda x, y: _per_rank(lambda a, b: fn(a, b), mesh, x, y)
    check_grads(f, (x, y), order=ORDER.get(name, 2), modes=["rev"])


def test_vmap_inside_shard_map(rng):
    mesh = _mesh()
    x = rng.standard_normal((WORLD, 3, 4))
    out = _per_rank(jax.vmap(ops.nccl_all_reduce), mesh, x)
    np.testing.assert_allclose(out[-1], x.sum(0), rtol=1e-12)
    # unbatched operand next to a batched one
    y = rng.standard_normal((WORLD, 4))
    out = _per_rank(lambda a, b: jax.vmap(ops.nccl_all_reduce, in_axes=(0, None))(a, b)[1],
                    mesh, x, y)
    np.testing.assert_allclose(out[2], np.broadcast_to(y.sum(0), (3, 4)), rtol=1e-12)


def test_group_axes_mapping(rng):
    mesh = _mesh((WORLD,), ("batch",))
    x = rng.standard_normal((WORLD, 3))
    with pytest.raises(ValueError, match="'data' is not bound"):
        _per_rank(ops.nccl_all_reduce, mesh, x)
    with ops.group_axes({0: "batch"}):
        out = _per_rank(ops.nccl_all_reduce, mesh, x)
    np.testing.assert_allclose(out[0], x.sum(0), rtol=1e-12)
    out = _per_rank(lambda v: ops.nccl_all_reduce(v, axis_name="batch"), mesh, x)
    np.testing.assert_allclose(out[-1], x.sum(0), rtol=1e-12)
    with pytest.raises(ValueError, match="group_type 7"):
        _per_rank(lambda v: ops.nccl_all_reduce(v, group_type=7), mesh, x)


def test_bad_input(rng):
    mesh = _mesh()
    with pytest.raises(TypeError, match=r"nccl_all_reduce: input\[0\] must be float"):
        _per_rank(ops.nccl_all_reduce, mesh, np.ones((WORLD, 3), np.int32))
    with pytest.raises(TypeError, match="one buffer of one type"):
        _per_rank(ops.nccl_all_gather, mesh, np.ones((WORLD, 3), np.float32), np.ones((WORLD, 3)))
    with pytest.raises(ValueError, match="at least one input"):
        ops.nccl_all_reduce()


def test_ort_ops_table():
    for op in ("NcclAllReduce", "NcclAllGather", "NcclReduceScatter", "MegatronF", "MegatronG",
               "AdasumAllReduce"):
        assert ("com.microsoft", op) in ops.ORT_OPS
