"""SoftmaxGrad, SoftmaxGrad_13, LogSoftmaxGrad, LogSoftmaxGrad_13 and jaxops.nn.(log_)softmax."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import ops
from jaxops.reference import softmax as ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices

# (name, op, through_end, log)
OPS = [
    ("softmax_grad", ops.softmax_grad, True, False),
    ("softmax_grad_13", ops.softmax_grad_13, False, False),
    ("log_softmax_grad", ops.log_softmax_grad, True, True),
    ("log_softmax_grad_13", ops.log_softmax_grad_13, False, True),
]
OP_IDS = [o[0] for o in OPS]
SHAPES_AXES = [((7,), 0), ((5, 33), -1), ((5, 33), 0), ((4, 6, 9), 1), ((3, 4, 5, 6), -2),
               ((2, 3, 130, 2), 2), ((16, 1000), 1), ((1, 1), 0), ((0, 5), 1)]


def make_inputs(rng, shape, axis, log, dtype, through_end):
    """dY ~ N(0,1); Y a real (log-)softmax output over the op's reduced dims."""
    logits = rng.standard_normal(shape)
    dims = ref.reduced_axes(len(shape), axis, through_end)
    m = logits.max(axis=dims, keepdims=True) if logits.size else 0
    e = np.exp(logits - m)
    y = e / e.sum(axis=dims, keepdims=True)
    y = np.log(y) if log else y
    dy = rng.standard_normal(shape)
    return jnp.asarray(dy, dtype), jnp.asarray(y, dtype)


def f64_reference(dy, y, axis, through_end, log):
    """The op in float64 on the same (rounded) inputs."""
    fn = ref.log_softmax_grad if log else ref.softmax_grad
    return fn(jnp.asarray(dy, jnp.float64), jnp.asarray(y, jnp.float64), axis, through_end)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,axis", SHAPES_AXES)
def test_matches_reference(rng, name, op, through_end, log, dtype, shape, axis):
    dy, y = make_inputs(rng, shape, axis, log, dtype, through_end)
    out = op(dy, y, axis=axis)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, f64_reference(dy, y, axis, through_end, log), dtype)
    # the reference module itself agrees (it is the JAXOPS_DISABLE fallback)
    fn = ref.log_softmax_grad if log else ref.softmax_grad
    assert_close(fn(dy, y, axis, through_end), f64_reference(dy, y, axis, through_end, log), dtype)


def test_default_axes():
    axis = lambda op: op.spec.attrs["axis"]
    assert axis(ops.softmax_grad) == axis(ops.log_softmax_grad) == 1
    assert axis(ops.softmax_grad_13) == axis(ops.log_softmax_grad_13) == -1


def test_pre13_sums_through_the_end(rng):
    # the pre-13 op on [2,3,4] axis 1 equals the _13 op on the [2,12] flattening
    dy, y = make_inputs(rng, (2, 3, 4), 1, False, jnp.float64, True)
    flat = ops.softmax_grad_13(dy.reshape(2, 12), y.reshape(2, 12), axis=1)
    np.testing.assert_allclose(ops.softmax_grad(dy, y, axis=1), flat.reshape(2, 3, 4), rtol=1e-12)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
def test_jit_matches_eager(rng, name, op, through_end, log):
    dy, y = make_inputs(rng, (6, 40), 1, log, jnp.float32, through_end)
    jitted = jax.jit(functools.partial(op, axis=1))
    np.testing.assert_array_equal(jitted(dy, y), op(dy, y, axis=1))
    assert f"jaxops_{name}" in str(jax.make_jaxpr(jitted)(dy, y))


VMAP_AXES = [(0, 0), (1, 1), (2, 0), (0, None), (None, 0), (None, 1), (-1, -1)]


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
@pytest.mark.parametrize("in_axes", VMAP_AXES, ids=str)
@pytest.mark.parametrize("axis", [0, -1])
def test_vmap(rng, name, op, through_end, log, in_axes, axis):
    core = (4, 5)  # per-example shape
    batch = 3
    def batched(a, ax):
        if ax is None:
            return a
        return jnp.moveaxis(jnp.stack([a] * batch) + jnp.arange(batch).reshape(-1, 1, 1) * 0.1,
                            0, ax)
    dy, y = make_inputs(rng, core, axis, log, jnp.float64, through_end)
    args = (batched(dy, in_axes[0]), batched(y, in_axes[1]))
    out = jax.vmap(functools.partial(op, axis=axis), in_axes=in_axes)(*args)
    fn = functools.partial(ref.log_softmax_grad if log else ref.softmax_grad, axis=axis,
                           through_end=through_end)
    expected = jax.vmap(fn, in_axes=in_axes)(*args)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
def test_vmap_of_grad(rng, name, op, through_end, log):
    dy, y = make_inputs(rng, (3, 4, 5), -1, log, jnp.float64, through_end)
    w = jnp.asarray(rng.standard_normal((4, 5)))
    def loss(impl, dy, y):
        return jnp.sum(jnp.sin(impl(dy, y, axis=-1)) * w)
    fn = functools.partial(ref.log_softmax_grad if log else ref.softmax_grad,
                           through_end=through_end)
    for argnums in (0, 1, (0, 1)):
        for in_axes in ((0, 0), (0, None), (None, 0)):
            args = (dy if in_axes[0] == 0 else dy[0], y if in_axes[1] == 0 else y[0])
            got = jax.vmap(jax.grad(functools.partial(loss, op), argnums), in_axes)(*args)
            want = jax.vmap(jax.grad(functools.partial(loss, fn), argnums), in_axes)(*args)
            jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12),
                         got, want)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
@pytest.mark.parametrize("shape,axis", [((3, 5), 1), ((2, 3, 4), 1), ((2, 3, 4), -1)])
def test_check_grads_order2(rng, name, op, through_end, log, shape, axis):
    dy, y = make_inputs(rng, shape, axis, log, jnp.float64, through_end)
    check_grads(functools.partial(op, axis=axis), (dy, y), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("fn,jax_fn,kernel", [
    (jaxops.nn.softmax, jax.nn.softmax, "jaxops_softmax_grad_13"),
    (jaxops.nn.log_softmax, jax.nn.log_softmax, "jaxops_log_softmax_grad_13"),
])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_nn(rng, fn, jax_fn, kernel, axis):
    x = jnp.asarray(rng.standard_normal((4, 6, 5)))
    w = jnp.asarray(rng.standard_normal((4, 6, 5)))
    np.testing.assert_allclose(fn(x, axis), jax_fn(x, axis=axis), rtol=1e-12)
    loss = lambda f: lambda x: jnp.sum(jnp.cos(f(x, axis)) * w)
    grad = jax.jit(jax.grad(loss(fn)))
    np.testing.assert_allclose(grad(x), jax.grad(loss(lambda x, a: jax_fn(x, axis=a)))(x),
                               rtol=1e-10, atol=1e-12)
    assert kernel in str(jax.make_jaxpr(jax.grad(loss(fn)))(x))  # backward runs the kernel
    check_grads(lambda x: fn(x, axis), (x,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_nn_grad_dtypes(rng, dtype):
    x = jnp.asarray(rng.standard_normal((8, 33)), dtype)
    for fn, jax_fn in ((jaxops.nn.softmax, jax.nn.softmax),
                       (jaxops.nn.log_softmax, jax.nn.log_softmax)):
        g = jax.grad(lambda x: jnp.sum(fn(x)[:, :3].astype(jnp.float32)))(x)
        x64 = jnp.asarray(x, jnp.float64)
        e = jax.grad(lambda x: jnp.sum(jax_fn(x)[:, :3]))(x64)
        assert g.dtype == dtype
        assert_close(g, e, dtype, ulps=16)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
@pytest.mark.parametrize("spec", [P("x"), P("x", None, None), P(None, "x")], ids=str)
def test_sharded_input_is_not_gathered(rng, name, op, through_end, log, spec):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    axis = -1 if not through_end else 2  # reduce over dims the spec leaves whole
    dy, y = make_inputs(rng, (8, 4, 6), axis, log, jnp.float32, through_end)
    sharding = NamedSharding(mesh, spec)
    dy_s, y_s = jax.device_put(dy, sharding), jax.device_put(y, sharding)
    fn = jax.jit(functools.partial(op, axis=axis))
    hlo = fn.lower(dy_s, y_s).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = fn(dy_s, y_s)
    assert out.sharding.spec[:len(spec)] == tuple(spec)[:len(out.sharding.spec)]
    np.testing.assert_allclose(out, op(dy, y, axis=axis), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
def test_sharded_reduced_axis_stays_correct(rng, name, op, through_end, log):
    # sharding the reduced dim forces a gather: the result must still be right
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    dy, y = make_inputs(rng, (4, 8), -1, log, jnp.float32, through_end)
    sharding = NamedSharding(mesh, P(None, "x"))
    out = jax.jit(functools.partial(op, axis=-1))(jax.device_put(dy, sharding),
                                                  jax.device_put(y, sharding))
    np.testing.assert_allclose(out, op(dy, y, axis=-1), rtol=1e-6, atol=1e-7)


def test_sharded_grad_of_nn_softmax(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 32)), jnp.float32),
                       NamedSharding(mesh, P("x", None)))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jaxops.nn.softmax(x) ** 2)))
    assert "all-gather" not in grad.lower(x).compile().as_text()
    assert grad(x).sharding.spec[0] == "x"


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
def test_bad_input(name, op, through_end, log):
    f32 = jnp.ones((2, 3), jnp.float32)
    cases = [
        ((jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32)), {}, TypeError, "float16"),
        ((f32, jnp.ones((2, 3), jnp.float64)), {}, TypeError, "share one dtype"),
        ((f32, jnp.ones((3, 2), jnp.float32)), {}, ValueError, "share one shape"),
        ((jnp.float32(1), jnp.float32(1)), {"axis": 0}, ValueError, "rank >= 1"),
        ((f32, f32), {"axis": 2}, ValueError, "out of range"),
        ((f32, f32), {"axis": -3}, ValueError, "out of range"),
        ((f32, f32), {"axis": 1.0}, TypeError, "axis must be an int"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            op(*args, **kwargs)
        assert f"jaxops.ops.{name}" in str(info.value)
        with pytest.raises(error, match=text):  # also at trace time under jit
            jax.jit(functools.partial(op, **kwargs))(*args)


def test_disable_routes_to_reference(rng, monkeypatch):
    dy, y = make_inputs(rng, (4, 9), -1, False, jnp.float32, False)
    # a fresh function each time: the switch is read when a function is traced
    trace = lambda: str(jax.make_jaxpr(lambda a, b: ops.softmax_grad_13(a, b))(dy, y))
    for value in ("all", "log_softmax_grad, softmax_grad_13"):
        monkeypatch.setenv("JAXOPS_DISABLE", value)
        jaxpr = trace()
        assert "jaxops_softmax_grad_13" not in jaxpr
        np.testing.assert_allclose(ops.softmax_grad_13(dy, y), ref.softmax_grad(dy, y, -1, False),
                                   rtol=1e-6)
    monkeypatch.setenv("JAXOPS_DISABLE", "log_softmax_grad")
    assert "jaxops_softmax_grad_13" in trace()


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "SoftmaxGrad")] is ops.softmax_grad
    assert ops.ORT_OPS[(ms, "SoftmaxGrad_13")] is ops.softmax_grad_13
    assert ops.ORT_OPS[(ms, "LogSoftmaxGrad")] is ops.log_softmax_grad
    assert ops.ORT_OPS[(ms, "LogSoftmaxGrad_13")] is ops.log_softmax_grad_13


# Long rows and tall columns: the CUDA kernels switch to shared-memory / cluster variants here
LARGE = [((3, 50257), -1), ((2, 70001), -1), ((130, 8192), -1), ((300, 12000), -1),
         ((16, 4096, 64), 1), ((2, 16384, 64), 1), ((4, 3000, 33), 1), ((1, 20000, 3), 1),
         ((2, 5, 9000), 1)]


@pytest.mark.parametrize("name,op,through_end,log", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,axis", LARGE)
def test_large_shapes(rng, name, op, through_end, log, dtype, shape, axis):
    dy, y = make_inputs(rng, shape, axis, log, dtype, through_end)
    out = op(dy, y, axis=axis)
    # sums over tens of thousands of terms: allow for f32 summation-order differences
    assert_close(out, f64_reference(dy, y, axis, through_end, log), dtype, ulps=64)
