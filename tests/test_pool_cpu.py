"""The CPU max pool kernel (jaxops/ops/pool_cpu.py, ffi/include/jaxops/pool.h): the reference's
values (lax.reduce_window) on fresh inputs with every code path the CPU has, channels that
leave partial vectors, strides, dilations, pads that leave windows partly or wholly outside x,
NaN and infinities; jit, vmap, gradients of any order (the reference's), sharding by images and
channels, clear errors; and the MaxPool handler takes it only in graphs without ConvGrad."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.test_util import check_grads
from onnx import helper

from helpers import on_cpu_devices
from jaxops.onnx import load
from jaxops.ops import pool_cpu
from onnx_build import model, vi

# (x [N, H, W, C], kernel, strides, dilations, padding)
CASES = [
    ((2, 16, 16, 64), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),   # DeepLabV3's, ResNet's
    ((1, 7, 9, 37), (2, 3), (1, 2), (2, 1), ((0, 2), (1, 1))),     # asymmetric, 37 channels
    ((3, 5, 5, 100), (5, 5), (3, 3), (1, 1), ((2, 3), (2, 3))),    # past 64 channels
    ((2, 4, 6, 1), (3, 3), (1, 1), (2, 2), ((2, 2), (2, 2))),      # one channel, dilated
    ((1, 3, 3, 20), (2, 2), (1, 1), (1, 1), ((3, 0), (0, 3))),     # windows wholly in the pads
    ((2, 9, 9, 48), (8, 8), (1, 1), (1, 1), ((0, 0), (0, 0))),     # 64 taps
]
IDS = ["stem_pool", "asymmetric", "wide", "c1_dilated", "outside", "64_taps"]
ISAS = ["best", "generic", "avx2", "avx512"]


def _params(case):
    return dict(kernel=case[1], strides=case[2], dilations=case[3], padding=case[4])


def _x(case, seed=0, special=False):
    x = np.random.default_rng(seed).standard_normal(case[0]).astype(np.float32)
    if special:  # a NaN, infinities, in some windows only
        flat = x.reshape(-1)
        flat[[3, 40 % flat.size, 77 % flat.size]] = [np.nan, np.inf, -np.inf]
    return jnp.asarray(x)


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_the_reference_and_is_one_ffi_call(case, isa, special):
    x = _x(case, seed=hash(case) % 1000, special=special)
    f = jax.jit(lambda x: pool_cpu.max_pool_nhwc(x, **_params(case), isa=isa))
    got, want = np.asarray(f(x)), np.asarray(pool_cpu._reference(x, **_params(case)))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # a max is exact; NaN where the reference's is
    if special:
        assert np.isnan(got).any() and np.isposinf(got).any()
    if case[0] == (1, 3, 3, 20):
        assert np.isneginf(got).any()  # a window without a tap inside
    hlo = f.lower(x).compile().as_text()
    assert hlo.count("jaxops_max_pool_nhwc") >= 1 and "reduce-window" not in hlo


def test_vmap_every_pattern_and_vmap_grad():
    case = CASES[1]
    xb = jnp.stack([_x(case, seed=s) for s in range(3)])
    f = lambda x: pool_cpu.max_pool_nhwc(x, **_params(case))
    ref = lambda x: pool_cpu._reference(x, **_params(case))
    np.testing.assert_array_equal(jax.vmap(f)(xb), jax.vmap(ref)(xb))
    np.testing.assert_array_equal(jax.vmap(f, 4, 1)(jnp.moveaxis(xb, 0, 4)),
                                  jnp.moveaxis(jax.vmap(ref)(xb), 0, 1))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(xb)
    gr = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(ref(x)))))(xb)
    assert float(jnp.abs(g).max()) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-6, atol=1e-6)


def test_gradients_any_order():
    case = CASES[0]
    # distinct values far apart: the finite differences do not move a window's max
    x = jnp.asarray(np.random.default_rng(1).permutation(144).reshape(1, 6, 6, 4), jnp.float32)
    check_grads(lambda x: pool_cpu.max_pool_nhwc(x, **_params(case)), (x,), order=2,
                modes=("fwd", "rev"), eps=1e-2)


@pytest.mark.parametrize("spec", [PartitionSpec("x"), PartitionSpec(None, None, None, "x")],
                         ids=["images", "channels"])
def test_sharded_without_gather(spec):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    case = CASES[0]
    x = jnp.concatenate([_x(case), _x(case, seed=1)])  # 4 images, 64 channels
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x: pool_cpu.max_pool_nhwc(x, **_params(case)))
    hlo = f.lower(placed).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "jaxops_max_pool_nhwc" in hlo
    out = f(placed)
    assert out.sharding.spec == spec
    np.testing.assert_array_equal(out, pool_cpu._reference(x, **_params(case)))


@pytest.mark.parametrize("shape, dtype, params, error, match", [
    ((2, 8, 8, 4), jnp.float64, {}, TypeError, "float32"),
    ((2, 8, 8, 4), jnp.int32, {}, TypeError, "float32"),
    ((8, 8, 4), jnp.float32, {}, ValueError, "rank 4"),
    ((2, 8, 8, 4), jnp.float32, {"kernel": (9, 8)}, ValueError, "1 to 64 taps"),
    ((2, 8, 8, 4), jnp.float32, {"kernel": (0, 3)}, ValueError, "1 to 64 taps"),
    ((2, 8, 8, 4), jnp.float32, {"kernel": (3,)}, ValueError, "2-D"),
    ((2, 8, 8, 4), jnp.float32, {"strides": (0, 1)}, ValueError, ">= 1"),
    ((2, 8, 8, 4), jnp.float32, {"padding": ((-1, 0), (0, 0))}, ValueError, ">= 0"),
    ((2, 2, 2, 4), jnp.float32, {"padding": ((0, 0), (0, 0))}, ValueError, "larger than"),
    ((2, 8, 8, 4), jnp.float32, {"isa": "sse"}, ValueError, "isa"),
])
def test_bad_input_is_a_clear_error(shape, dtype, params, error, match):
    p = {"kernel": (3, 3), "strides": (1, 1), "dilations": (1, 1),
         "padding": ((1, 1), (1, 1)), **params}
    with pytest.raises(error, match=match) as e:
        pool_cpu.max_pool_nhwc(jnp.zeros(shape, dtype), **p)
    assert "max_pool_nhwc" in str(e.value)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_max_pool_nchw_in_every_float(dtype):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 9, 9)), dtype)
    got = pool_cpu.max_pool_nchw(x, (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1)))
    want = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                                 ((0, 0), (0, 0), (1, 1), (1, 1)))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _graph(with_conv_grad):
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1])]
    outputs = ["y"]
    if with_conv_grad:  # a training graph's gradient op (its convolutions stay NCHW)
        nodes.append(helper.make_node("ConvGrad", ["y", "y", "w"], ["dx", "dw"],
                                      domain="com.microsoft", kernel_shape=[1, 1]))
        outputs = ["y", "dx"]
    inputs = [vi("x", shape=[2, 8, 16, 16])] + ([vi("w", shape=[8, 8, 1, 1])] if with_conv_grad else [])
    return load(model(nodes, inputs, outputs))


def test_max_pool_handler_takes_it_without_conv_grad():
    x = np.random.default_rng(3).standard_normal((2, 8, 16, 16)).astype(np.float32)
    prog = _graph(False)
    hlo = jax.jit(prog.jit()).lower(x).compile().as_text()
    assert "jaxops_max_pool_nhwc" in hlo
    want = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                                 ((0, 0), (0, 0), (1, 1), (1, 1)))
    np.testing.assert_array_equal(np.asarray(prog.jit()(x)), np.asarray(want))
    train = _graph(True)
    w = np.zeros((8, 8, 1, 1), np.float32)
    assert "jaxops_max_pool_nhwc" not in jax.jit(train.jit()).lower(x, w).compile().as_text()
