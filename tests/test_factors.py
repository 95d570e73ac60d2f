"""The sharding core on small meshes: Factors' Shardy rule, how operand shardings assign mesh
axes to factors, the psum axes of summed factors, and the multi-tensor optimizers' factors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import on_cpu_devices
from jaxops import ops
from jaxops._src.op import Factors
from jaxops.ops.optim import _ListFactors, _tensor_factors


@pytest.fixture
def mesh():
    return Mesh(np.array(on_cpu_devices(4)).reshape(2, 2), ("x", "y"))


def _ns(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def _specs(shardings):
    return [tuple(s.spec) for s in shardings]


ROWS = Factors(operands=(("r", "c"), ("r",)), results=(("r", "c"),), replicated=("c",))


def test_rule_is_einsum_like_with_replicated_factors():
    assert ROWS.rule() == ("r c, r -> r c", {"need_replication_factors": ("c",)})
    scalar = Factors(operands=((), ("a",)), results=(("a",),))
    assert scalar.rule() == (", a -> a", {"need_replication_factors": ()})


def test_replicated_factor_is_never_sharded(mesh):
    args, results = ROWS.shardings(mesh, [_ns(mesh, "x", "y"), _ns(mesh)])
    assert _specs(args) == [("x", None), ("x",)] and _specs(results) == [("x", None)]
    assert ROWS._assign([_ns(mesh, "x", "y"), _ns(mesh)]) == {"r": "x"}


def test_first_operand_to_shard_a_factor_wins(mesh):
    # operand 0 leaves r unsharded, operand 1 shards it; a later conflicting spec is ignored
    f = Factors(operands=(("r", "k"), ("r",), ("r", "k")), results=(("r", "k"),))
    assigned = f._assign([_ns(mesh, None, "x"), _ns(mesh, "y"), _ns(mesh, "x", "y")])
    assert assigned == {"k": "x", "r": "y"}
    args, results = f.shardings(mesh, [_ns(mesh, None, "x"), _ns(mesh, "y"), _ns(mesh)])
    assert _specs(args) == [("y", "x"), ("y",), ("y", "x")] and _specs(results) == [("y", "x")]


def test_a_mesh_axis_goes_to_one_factor_only(mesh):
    # a and b both ask for "x": a, seen first, takes it, and b stays replicated
    f = Factors(operands=(("a",), ("b",)), results=(("a", "b"),))
    assert f._assign([_ns(mesh, "x"), _ns(mesh, "x")]) == {"a": "x"}
    _, results = f.shardings(mesh, [_ns(mesh, "x"), _ns(mesh, "x")])
    assert _specs(results) == [("x", None)]


def test_axis_tuples_are_assigned_whole_and_block_their_axes(mesh):
    f = Factors(operands=(("a", "b"), ("b",)), results=(("a", "b"),))
    assert f._assign([_ns(mesh, ("x", "y")), _ns(mesh, "y")]) == {"a": ("x", "y")}
    # one axis of the tuple already taken: the tuple is refused as a whole
    assert f._assign([_ns(mesh, None, "y"), _ns(mesh)]) == {"b": "y"}
    g = Factors(operands=(("b",), ("a",)), results=(("a",),))
    assert g._assign([_ns(mesh, "y"), _ns(mesh, ("x", "y"))]) == {"b": "y"}


def test_short_specs_and_specless_shardings_leave_factors_unassigned(mesh):
    f = Factors(operands=(("a", "b", "c"), ("d",)), results=(("a", "b", "c"),))
    single = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    assert f._assign([_ns(mesh, "x"), single]) == {"a": "x"}
    assert f._assign([None, _ns(mesh, "y")]) == {"d": "y"}
    args, results = f.shardings(mesh, [_ns(mesh, "x"), single])
    assert _specs(args) == [("x", None, None), (None,)]


SUMS = Factors(operands=(("g", "r", "c"), ("g", "c")),
               results=(("g", "r", "c"), ("g", "c"), ("c",)), replicated=("c",), summed=("r",))


def test_psum_axes_of_results_that_lack_a_summed_factor(mesh):
    assert SUMS.psum_axes([_ns(mesh, "x", "y"), _ns(mesh)]) == [(), ("y",), ("y",)]
    assert SUMS.psum_axes([_ns(mesh, None, ("x", "y")), _ns(mesh)]) == [(), ("x", "y"), ("x", "y")]


def test_no_psum_when_the_summed_factor_is_whole(mesh):
    assert SUMS.psum_axes([_ns(mesh, "x"), _ns(mesh)]) == [(), (), ()]
    assert SUMS.psum_axes([_ns(mesh), _ns(mesh)]) == [(), (), ()]
    # the replicated column factor takes no axis, so it adds no psum either
    assert SUMS.psum_axes([_ns(mesh, None, None, "x"), _ns(mesh)]) == [(), (), ()]


def test_list_factors_shard_each_tensor_alone(mesh):
    # lr, then two tensors in two lists (weights, gradients); results: flag, then new weights
    f = _tensor_factors([jnp.ones(1), jnp.ones((4, 2)), jnp.ones((6,))], 1, 2, 2, (0, 1))
    assert isinstance(f, _ListFactors) and f.scalars == ("s0_0",)
    # tensor 0 by its gradient's "y", tensor 1 by its weight's "y" too: each keeps its own
    specs = [_ns(mesh), _ns(mesh), _ns(mesh, "y"), _ns(mesh, "y", None), _ns(mesh)]
    args, results = f.shardings(mesh, specs)
    assert _specs(args) == [(), ("y", None), ("y",), ("y", None), ("y",)]
    assert _specs(results) == [(), ("y", None), ("y",)]


def test_list_factors_keep_scalars_replicated(mesh):
    # a sharded scalar operand (its factors marked in `scalars`) does not shard anything
    f = _ListFactors(operands=(("lr",), ("w",), ("w",)), results=(("lr",), ("w",)),
                     scalars=("lr",))
    args, results = f.shardings(mesh, [_ns(mesh, "x"), _ns(mesh), _ns(mesh, "y")])
    assert _specs(args) == [(), ("y",), ("y",)] and _specs(results) == [(), ("y",)]
    unmarked = _ListFactors(operands=f.operands, results=f.results)
    assert _specs(unmarked.shardings(mesh, [_ns(mesh, "x"), _ns(mesh), _ns(mesh)])[1]) == \
        [("x",), ()]


def test_sgd_tensors_sharded_on_different_axes(mesh, rng):
    """Through the kernel on a 2x2 mesh: each tensor keeps its own mesh axis, no gathers."""
    ws = [rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(8).astype(np.float32)]
    gs = [rng.standard_normal(w.shape).astype(np.float32) for w in ws]
    sh = [_ns(mesh, "x", "y"), _ns(mesh, "y")]
    lr = jnp.asarray([0.5], np.float32)
    put = lambda xs: [jax.device_put(x, s) for x, s in zip(xs, sh)]
    fn = jax.jit(lambda w, g: ops.sgd_optimizer_v2(lr, w, g))
    hlo = fn.lower(put(ws), put(gs)).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    _, new = fn(put(ws), put(gs))
    for n, w, g, s in zip(new, ws, gs, sh):
        assert n.sharding.spec == s.spec
        np.testing.assert_allclose(n, w - 0.5 * g, rtol=1e-6)
