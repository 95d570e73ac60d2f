"""The transformation checks every XLA-coded op gets (jit, vmap with every in_axes pattern,
vmap of grad, check_grads order 2, a sharded input that stays sharded), for an op given as
fn(*args) and maker(rng, shape, dtype) -> args; argnums are the float operands."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.test_util import check_grads

from helpers import on_cpu_devices


def call(maker, rng, shape, dtype=jnp.float64):
    if "name" in getattr(maker, "keywords", {}):
        return maker(rng, shape=shape, dtype=dtype)
    return maker(rng, shape, dtype)


def _batch(maker, rng, core, n=3):
    """n examples of the op's inputs at `core`, stacked on a new axis 0."""
    examples = [call(maker, rng, core) for _ in range(n)]
    return [jnp.stack(xs) for xs in zip(*examples)]


def assert_tree_close(got, want, **kw):
    kw = {"rtol": 1e-10, "atol": 1e-12, **kw}
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **kw), got, want)


def _stack(trees):
    return jax.tree.map(lambda *e: jnp.stack(e), *trees)


def check_jit(rng, fn, maker, shape=(4, 6)):
    args = call(maker, rng, shape, jnp.float32)
    assert_tree_close(jax.jit(fn)(*args), fn(*args), rtol=1e-5, atol=1e-4)  # fusion rounds differently


def check_vmap(rng, fn, maker, core):
    """Batch axis 0, 1 and -1 on every operand, and each operand unbatched in turn."""
    args = _batch(maker, rng, core)
    n = len(args)
    stacked = _stack([fn(*[a[k] for a in args]) for k in range(3)])
    patterns = [(0,) * n, (1,) * n, (-1,) * n]
    if n > 1:
        patterns += [tuple(None if i == j else 0 for i in range(n)) for j in range(n)]
    for in_axes in patterns:
        batched = [a[0] if ax is None else jnp.moveaxis(a, 0, ax) for a, ax in zip(args, in_axes)]
        got = jax.vmap(fn, in_axes=in_axes)(*batched)
        if None in in_axes:  # the unbatched operand is example 0 for everyone
            j = in_axes.index(None)
            want = _stack([fn(*[args[i][0] if i == j else args[i][k] for i in range(n)])
                           for k in range(3)])
        else:
            want = stacked
        assert_tree_close(got, want)


def _float_leaves(out):
    """The outputs gradients flow through (an op's int outputs, such as sizes, have none)."""
    return [o for o in jax.tree.leaves(out) if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]


def _grad_of(fn, argnums):
    def grad(*a):  # the gradient of a scalar loss w.r.t. the op's float operands
        def loss(*floats):
            full = list(a)
            for i, x in zip(argnums, floats):
                full[i] = x
            return sum(jnp.sum(jnp.sin(o)) for o in _float_leaves(fn(*full)))
        return jax.grad(loss, tuple(range(len(argnums))))(*[a[i] for i in argnums])
    return grad


def check_vmap_of_grad(rng, fn, maker, argnums, core):
    args = _batch(maker, rng, core)
    grad = _grad_of(fn, argnums)
    assert_tree_close(jax.vmap(grad)(*args), _stack([grad(*[a[k] for a in args])
                                                     for k in range(3)]))
    if len(args) == 1:
        return
    # an unbatched first operand, as vmap(grad) meets shared inputs
    got = jax.vmap(grad, in_axes=(None,) + (0,) * (len(args) - 1))(args[0][0], *args[1:])
    assert_tree_close(jax.tree.map(lambda g: g[1], got),
                      grad(args[0][0], *[a[1] for a in args[1:]]))


def check_grads_order2(rng, fn, maker, argnums, shape, eps=None):
    args = list(call(maker, rng, shape))

    def f(*floats):
        full = list(args)
        for i, x in zip(argnums, floats):
            full[i] = x
        return _float_leaves(fn(*full))
    check_grads(f, tuple(args[i] for i in argnums), order=2, modes=("fwd", "rev"), eps=eps)


def check_sharded(rng, fn, maker, spec, shape):
    """Operands whose dim 0 is shape[0] are sharded by `spec` on 4 CPU devices: no gather
    in the compiled program, the first output stays sharded on dim 0, values unchanged."""
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    args = call(maker, rng, shape, jnp.float32)
    sharding = NamedSharding(mesh, spec)
    placed = [jax.device_put(a, sharding) if a.shape[:1] == shape[:1] else a for a in args]
    jitted = jax.jit(fn)
    hlo = jitted.lower(*placed).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = jax.tree.leaves(jitted(*placed))
    assert out[0].sharding.spec[:1] == ("x",)
    # XLA's f32 tanh/erf differ slightly fused and unfused: O(1) outputs, so an absolute bound
    assert_tree_close(out, jax.tree.leaves(fn(*args)), rtol=1e-5, atol=1e-4)
