"""Ops ORT's gradient builder writes beyond the CUDA registry: SinGrad (and cos_grad),
AveragePoolGrad, FusedMatMul, BroadcastGradientArgs; against independent numpy references."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close
from jaxops import ops


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


# ---- sin_grad / cos_grad

@pytest.mark.parametrize("name,fn,expect", [
    ("sin_grad", ops.sin_grad, lambda dy, x: dy * np.cos(x)),
    ("cos_grad", ops.cos_grad, lambda dy, x: -dy * np.sin(x))])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4), (0,)], ids=str)
def test_trig_grads(rng, name, fn, expect, dtype, shape):
    dy, x = _normal(rng, shape, dtype), _normal(rng, shape, dtype) * 3
    out = fn(dy, x)
    assert out.dtype == dtype and out.shape == shape
    want = expect(np.asarray(dy, np.float64), np.asarray(x, np.float64))
    assert_close(out, want, dtype, ulps=4)


# ---- average_pool_grad: every dY element spread over the input positions of its window

def _avg_pool_grad_loops(dy, x_shape, kernel, strides, pads, count_include_pad):
    """Loops over windows; pads = (begin..., end...) with ceil_mode's extension already in
    the end pads where the caller wants it. The forward divides by the full kernel size
    (count_include_pad=1) or by the real positions the window covers."""
    n = len(kernel)
    dx = np.zeros(x_shape, np.float64)
    for b, c in itertools.product(range(dy.shape[0]), range(dy.shape[1])):
        for out in itertools.product(*[range(d) for d in dy.shape[2:]]):
            starts = [o * s - p for o, s, p in zip(out, strides, pads[:n])]
            cover = [range(max(st, 0), min(st + k, size))
                     for st, k, size in zip(starts, kernel, x_shape[2:])]
            cells = list(itertools.product(*cover))
            div = np.prod(kernel) if count_include_pad else len(cells)
            for cell in cells:
                dx[(b, c) + cell] += dy[(b, c) + out] / div
    return dx


POOLS = [  # (x_shape, attrs, explicit pads for the loop reference)
    ((2, 3, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2]), [0, 0, 0, 0]),
    ((2, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), [1, 1, 1, 1]),
    ((1, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                        count_include_pad=1), [1, 1, 1, 1]),
    ((1, 2, 5, 6), dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 1, 0]), [0, 1, 1, 0]),
    ((1, 2, 7), dict(kernel_shape=[3], strides=[2], pads=[1, 0]), [1, 0]),
    ((1, 2, 4, 5, 6), dict(kernel_shape=[2, 2, 2], strides=[1, 2, 2]), [0] * 6),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), [0, 0, 1, 1]),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1, count_include_pad=1),
     [0, 0, 1, 1]),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
     [0, 0, 1, 1]),
    ((1, 1, 6, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER"),
     [1, 1, 0, 0]),
    ((1, 1, 6, 5), dict(kernel_shape=[3, 2], strides=[1, 1], auto_pad="VALID"), [0] * 4),
]


def _dy_shape(x_shape, attrs, pads):
    n = len(x_shape) - 2
    strides = attrs.get("strides", [1] * n)
    return x_shape[:2] + tuple(
        (size + pads[i] + pads[n + i] - k) // s + 1
        for i, (size, k, s) in enumerate(zip(x_shape[2:], attrs["kernel_shape"], strides)))


@pytest.mark.parametrize("x_shape,attrs,pads", POOLS, ids=[str(p[1]) for p in POOLS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_average_pool_grad(rng, x_shape, attrs, pads, dtype):
    dy = _normal(rng, _dy_shape(x_shape, attrs, pads), dtype)
    out = ops.average_pool_grad(dy, x_shape=x_shape, **attrs)
    assert out.dtype == dtype and out.shape == x_shape
    n = len(x_shape) - 2
    want = _avg_pool_grad_loops(np.asarray(dy, np.float64), x_shape, attrs["kernel_shape"],
                                attrs.get("strides", [1] * n), pads,
                                attrs.get("count_include_pad", 0))
    assert_close(out, want, dtype, ulps=8)


def test_average_pool_grad_takes_batch_from_dy(rng):
    dy = _normal(rng, (3, 2, 2, 2), jnp.float32)
    assert ops.average_pool_grad(dy, x_shape=(1, 2, 4, 4), kernel_shape=[2, 2],
                                 strides=[2, 2]).shape == (3, 2, 4, 4)


def test_average_pool_grad_bad_input():
    dy = jnp.ones((1, 1, 3, 3))
    kw = dict(x_shape=(1, 1, 6, 6), kernel_shape=[2, 2], strides=[2, 2])
    for bad, error, text in [
            (dict(x_shape=(1, 1, 8, 8)), ValueError, "does not match"),
            (dict(kernel_shape=[2]), ValueError, "agree in rank"),
            (dict(strides=[0, 2]), ValueError, "positive"),
            (dict(pads=[1, 1]), ValueError, "pads must hold"),
            (dict(auto_pad="SAME"), ValueError, "unknown auto_pad"),
            (dict(dilations=[2, 2]), ValueError, "dilations"),
            (dict(x_shape=(1, 2, 6, 6)), ValueError, "channels")]:
        with pytest.raises(error, match=f"jaxops.ops.average_pool_grad: .*{text}"):
            ops.average_pool_grad(dy, **{**kw, **bad})
    with pytest.raises(TypeError, match="must be float16"):
        ops.average_pool_grad(jnp.ones((1, 1, 3, 3), jnp.int32), **kw)


# ---- fused_matmul

MATMULS = [((3, 4), (4, 5), {}), ((3, 4), (4, 5), {"alpha": 0.5}),
           ((2, 4, 3), (2, 5, 4), {"transA": 1, "transB": 1}),
           ((2, 3, 4), (4, 5), {}),
           ((2, 3, 4), (3, 4, 5), {"transBatchA": 1}),
           ((3, 2, 4), (5, 3, 4), {"transBatchB": 1, "transB": 1})]


def _np_fused_matmul(a, b, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    def prep(x, t, tb):
        if tb and x.ndim > 2:
            x = np.transpose(x, list(range(1, x.ndim - 1)) + [0, x.ndim - 1])
        return np.swapaxes(x, -1, -2) if t else x
    return alpha * np.matmul(prep(a, transA, transBatchA), prep(b, transB, transBatchB))


@pytest.mark.parametrize("a_shape,b_shape,attrs", MATMULS, ids=[str(m) for m in MATMULS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_fused_matmul(rng, a_shape, b_shape, attrs, dtype):
    a, b = _normal(rng, a_shape, dtype), _normal(rng, b_shape, dtype)
    out = ops.fused_matmul(a, b, **attrs)
    want = _np_fused_matmul(np.asarray(a, np.float64), np.asarray(b, np.float64), **attrs)
    assert out.dtype == dtype
    k = (a_shape[-2] if attrs.get("transA") else a_shape[-1])
    assert_close(out, want, dtype, ulps=4 * k, scale=_np_fused_matmul(
        np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)), **attrs))


def test_fused_matmul_bad_input():
    with pytest.raises(ValueError, match="jaxops.ops.fused_matmul: inner dims"):
        ops.fused_matmul(jnp.ones((3, 4)), jnp.ones((5, 4)))
    with pytest.raises(TypeError, match="jaxops.ops.fused_matmul: .*share one dtype"):
        ops.fused_matmul(jnp.ones((3, 4)), jnp.ones((4, 2), jnp.float16))
    with pytest.raises(TypeError, match="jaxops.ops.fused_matmul: alpha"):
        ops.fused_matmul(jnp.ones((3, 4)), jnp.ones((4, 2)), alpha="2")


# ---- broadcast_gradient_args

@pytest.mark.parametrize("a,b,axes_a,axes_b", [
    ([2, 3, 4], [4], [], [1, 0]), ([2, 1, 4], [3, 1], [1], [2, 0]), ([1, 3], [1, 3], [], []),
    ([5], [2, 3, 5], [1, 0], []), ([2, 3], [], [], [1, 0]), ([], [], [], []),
    ([3, 1, 1], [1, 1, 1], [], [0]), ([0, 3], [1, 3], [], [0])])
def test_broadcast_gradient_args(a, b, axes_a, axes_b):
    got_a, got_b = ops.broadcast_gradient_args(np.array(a, np.int64), np.array(b, np.int64))
    assert got_a.dtype == got_b.dtype == np.int64
    assert got_a.tolist() == axes_a and got_b.tolist() == axes_b
    # summing a broadcast gradient over them leaves each operand's own size
    full = np.ones(np.broadcast_shapes(tuple(a), tuple(b)))
    assert full.sum(axis=tuple(got_a)).size == np.prod(a)
    assert full.sum(axis=tuple(got_b)).size == np.prod(b)


def test_broadcast_gradient_args_bad_input():
    op = "jaxops.ops.broadcast_gradient_args: "
    with pytest.raises(ValueError, match=f"{op}.* do not broadcast"):
        ops.broadcast_gradient_args([2, 3], [4, 3])
    with pytest.raises(TypeError, match=f"{op}a_shape must be a 1-D sequence of ints"):
        ops.broadcast_gradient_args(np.ones((2, 2), np.int64), [1])
    with pytest.raises(TypeError, match=f"{op}a_shape must be static"):
        jax.jit(ops.broadcast_gradient_args)(jnp.array([2, 3]), jnp.array([3]))
    with pytest.raises(ValueError, match=f"{op}a_shape has a negative dim"):
        ops.broadcast_gradient_args([2, -1], [1])
    with pytest.raises(TypeError, match=f"{op}.*unexpected keyword"):
        ops.broadcast_gradient_args([2], [2], axis=0)


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[("", "SinGrad")] is ops.sin_grad
    assert ops.ORT_OPS[("", "AveragePoolGrad")] is ops.average_pool_grad
    assert ops.ORT_OPS[(ms, "FusedMatMul")] is ops.fused_matmul
    assert ops.ORT_OPS[(ms, "BroadcastGradientArgs")] is ops.broadcast_gradient_args
