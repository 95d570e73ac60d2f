"""The transformation matrix of every public op, from its spec (jaxops/_src/spec.py): jit,
vmap with every in_axes pattern, vmap of grad, check_grads order 2 (fwd and rev), and a
dim-0-sharded input on 4 CPU devices that stays sharded with no all-gather. An op without a
matrix row must say why (`no_matrix`)."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import op_matrix as matrix
from jaxops import ops

ROWS = sorted((name, spec) for name, spec in ops.SPECS.items() if spec.matrix is not None)
IDS = [name for name, _ in ROWS]


def _fn(spec):
    """The op with the row's keywords fixed, taking the row's made inputs positionally: they
    fill the inputs the keywords leave, in order, passed by name (so a static input such as
    GatherGrad's leading `shape` can be a keyword)."""
    fn, fixed = getattr(ops, spec.name), dict(spec.matrix.attrs)
    if spec.variadic is not None:
        return functools.partial(fn, **fixed)
    names = [i.name for i in spec.inputs if i.name not in fixed]

    def call(*args):
        return fn(**dict(zip(names, args)), **fixed)
    return call


def _skip_if(spec, what):
    if not getattr(spec.matrix, what):
        pytest.skip(f"{spec.name}: {spec.matrix.skip}")


def test_every_op_has_a_row_or_a_reason():
    for name, spec in ops.SPECS.items():
        assert spec.matrix is not None or spec.no_matrix.strip(), name
        assert spec.matrix is None or spec.matrix.skip or (spec.matrix.shard and spec.matrix.vmap)


@pytest.mark.parametrize("name,spec", ROWS, ids=IDS)
def test_jit_matches_eager(rng, name, spec):
    matrix.check_jit(rng, _fn(spec), spec.matrix.make)


@pytest.mark.parametrize("name,spec", ROWS, ids=IDS)
def test_vmap(rng, name, spec):
    _skip_if(spec, "vmap")
    matrix.check_vmap(rng, _fn(spec), spec.matrix.make, (3, 4))


@pytest.mark.parametrize("name,spec", [r for r in ROWS if r[1].matrix.grad],
                         ids=[n for n, s in ROWS if s.matrix.grad])
def test_vmap_of_grad(rng, name, spec):
    _skip_if(spec, "vmap")
    matrix.check_vmap_of_grad(rng, _fn(spec), spec.matrix.make, spec.matrix.grad, (2, 3))


@pytest.mark.parametrize("name,spec", [r for r in ROWS if r[1].matrix.grad],
                         ids=[n for n, s in ROWS if s.matrix.grad])
def test_check_grads_order2(rng, name, spec):
    matrix.check_grads_order2(rng, _fn(spec), spec.matrix.make, spec.matrix.grad, (2, 3),
                              eps=spec.matrix.eps)


@pytest.mark.parametrize("name,spec", ROWS, ids=IDS)
def test_sharded_input_is_not_gathered(rng, name, spec):
    _skip_if(spec, "shard")
    matrix.check_sharded(rng, _fn(spec), spec.matrix.make, P("x"), (8, 4))


@pytest.mark.parametrize("name,spec", ROWS, ids=IDS)
def test_errors_name_the_op(rng, name, spec):
    """A float input given as int32, and an unknown keyword, are TypeErrors naming the op."""
    fn = _fn(spec)
    args = list(spec.matrix.make(rng, (2, 3), jnp.float32))
    made = [i for i in spec.inputs if i.name not in spec.matrix.attrs]
    floats = [k for k, i in enumerate(made[:len(args)]) if i.kind == "float"]
    if floats:
        args[floats[0]] = jnp.ones(jnp.shape(args[floats[0]]), jnp.int32)
        with pytest.raises(TypeError, match=f"jaxops.ops.{name}: "):
            fn(*args)
    with pytest.raises(TypeError, match=f"jaxops.ops.{name}: "):
        getattr(ops, name)(*args, not_an_attribute=1)


@pytest.mark.parametrize("name,spec", [r for r in ROWS if r[1].kernel is not None],
                         ids=[n for n, s in ROWS if s.kernel is not None])
def test_disable_runs_the_reference(rng, name, spec, monkeypatch):
    """JAXOPS_DISABLE=<name> traces no jaxops primitive and gives the kernel's values."""
    args = spec.matrix.make(rng, (2, 3), jnp.float64)
    fast = _fn(spec)(*args)
    assert "jaxops_" in str(jax.make_jaxpr(_fn(spec))(*args))
    monkeypatch.setenv("JAXOPS_DISABLE", name)
    assert "jaxops_" not in str(jax.make_jaxpr(_fn(spec))(*args))
    matrix.assert_tree_close(_fn(spec)(*args), fast, rtol=1e-9, atol=1e-12)
