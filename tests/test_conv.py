"""ConvGrad, ConvTransposeGrad, ResizeGrad and MaxPoolGrad (XLA convolutions and scatters)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads

from jaxops import ops
from jaxops.ops.conv import conv, conv_transpose
from jaxops.reference import conv as ref
from jaxops.reference import pool as pool_ref
from jaxops.reference import resize as resize_ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices

# (x shape, w shape, Conv attributes): 1-D/2-D/3-D, groups, strides, dilations, pads, auto_pad
CONV = [
    ((2, 4, 9), (6, 2, 3), {"group": 2, "strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((2, 3, 6, 7), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "kernel_shape": [3, 2]}),
    ((1, 4, 7, 6), (4, 1, 3, 3), {"group": 4, "strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 7, 6), (3, 2, 2, 3), {"strides": [2, 2], "dilations": [2, 1], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 5, 6), (3, 2, 3, 3), {"strides": [2, 2], "auto_pad": "VALID"}),
    ((1, 2, 4, 5, 3), (2, 1, 2, 3, 2), {"group": 2, "pads": [1, 0, 1, 0, 1, 1]}),
]
# (x shape, w shape [C_in, C_out/group, k...], ConvTranspose attributes)
CONV_T = [
    ((2, 4, 3, 3), (4, 3, 3, 3), {"group": 2, "strides": [2, 2]}),
    ((1, 2, 4), (2, 3, 3), {"strides": [2], "pads": [1, 2], "output_padding": [1]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "output_shape": [8, 7]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [3, 1], "dilations": [2, 2], "pads": [4, 0, 1, 3]}),
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2), {"strides": [1, 2, 2]}),
]
CONV_IDS = [f"{len(x) - 2}d-{'-'.join(a)}" for x, _, a in CONV]
CONV_T_IDS = [f"{len(x) - 2}d-{'-'.join(a)}" for x, _, a in CONV_T]


def conv_inputs(rng, forward, xs, ws, attrs, dtype):
    x = jnp.asarray(rng.standard_normal(xs), dtype)
    w = jnp.asarray(rng.standard_normal(ws), dtype)
    y = jax.eval_shape(functools.partial(forward, **attrs), x, w)
    return jnp.asarray(rng.standard_normal(y.shape), dtype), x, w


GRAD_OPS = [("conv_grad", ops.conv_grad, conv, ref.conv_grad, CONV, CONV_IDS),
            ("conv_transpose_grad", ops.conv_transpose_grad, conv_transpose,
             ref.conv_transpose_grad, CONV_T, CONV_T_IDS)]
MATRIX = [(name, op, fwd, r, *case) for name, op, fwd, r, cases, _ in GRAD_OPS for case in cases]
MATRIX_IDS = [f"{name}-{i}" for name, *_, cases, ids in GRAD_OPS for i in ids]


@pytest.mark.parametrize("name,op,forward,reference,xs,ws,attrs", MATRIX, ids=MATRIX_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_matches_reference(rng, name, op, forward, reference, xs, ws, attrs, dtype):
    if dtype in (jnp.float16, jnp.bfloat16) and len(xs) != 4:
        pytest.skip("f16/bf16 run on the 2-D cases only (CPU test time)")
    dy, x, w = conv_inputs(rng, forward, xs, ws, attrs, dtype)
    got = op(dy, x, w, **attrs)
    f64 = [jnp.asarray(a, jnp.float64) for a in (dy, x, w)]
    for g, e, like in zip(got, reference(*f64, **attrs), (x, w, w[:, 0])):
        assert g.dtype == dtype
        # sums of up to ~100 products: a few dozen ulps in f16/bf16
        assert_close(g, e, dtype, ulps=32)
    assert got[0].shape == x.shape and got[1].shape == w.shape
    assert got[2].shape == (dy.shape[1],)


@pytest.mark.parametrize("name,op,forward,reference,xs,ws,attrs", MATRIX[:2] + MATRIX[6:8],
                         ids=MATRIX_IDS[:2] + MATRIX_IDS[6:8])
def test_outputs_keyword(rng, name, op, forward, reference, xs, ws, attrs):
    dy, x, w = conv_inputs(rng, forward, xs, ws, attrs, jnp.float32)
    full = op(dy, x, w, **attrs)
    for wanted in [(True, False, False), (False, True, False), (False, False, True),
                   (True, False, True)]:
        got = op(dy, x, w, outputs=wanted, **attrs)
        for g, f, want in zip(got, full, wanted):
            assert (g is None) != want
            if want:
                np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-5)
    # only the wanted gradient is computed: dX alone is one convolution (a grouped one also
    # carries its CPU lowering, windowed_conv's transpose, as a platform branch: jax 0.8 keeps
    # both branches in the jaxpr)
    closed = jax.make_jaxpr(lambda *a: op(*a, outputs=(True, False, False), **attrs))(dy, x, w)
    assert str(closed).count("conv_general_dilated") == 1
    # no dB: no sum over the batch axis (a CPU branch's windowed transpose sums other axes)
    assert not any(e.primitive.name == "reduce_sum" and 0 in e.params["axes"]
                   for e in _eqns(closed.jaxpr))


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside its equations (branches, pjit)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


# the transformation tests are slow on CPU (eager convolutions): one case per spatial rank.
# tests/test_op_matrix.py runs every transformation (and a batch-sharded dY/X) on a 2-D
# strided, padded, dilated case of each op; these add grouped, depthwise SAME_UPPER and 1-D
# ConvTranspose geometries (group > 1 cannot be in the matrix row: XLA gathers a batch-sharded
# grouped convolution)
TRANSFORM = [0, 2, 7]


@pytest.mark.parametrize("name,op,forward,reference,xs,ws,attrs", [MATRIX[i] for i in TRANSFORM],
                         ids=[MATRIX_IDS[i] for i in TRANSFORM])
def test_jit_vmap_grads(rng, name, op, forward, reference, xs, ws, attrs):
    fn = functools.partial(op, **attrs)
    examples = [conv_inputs(rng, forward, xs, ws, attrs, jnp.float64) for _ in range(2)]
    dy, x, w = (jnp.stack(t) for t in zip(*examples))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12),
                 jax.jit(fn)(dy[0], x[0], w[0]), fn(dy[0], x[0], w[0]))
    for in_axes in [(1, 1, 0), (0, 0, None), (None, 0, 0)]:
        args = [a[0] if ax is None else jnp.moveaxis(a, 0, ax)
                for a, ax in zip((dy, x, w), in_axes)]
        got = jax.vmap(fn, in_axes=in_axes)(*args)
        for k in range(2):
            pick = [a[0] if ax is None else a[k] for a, ax in zip((dy, x, w), in_axes)]
            jax.tree.map(lambda g, e: np.testing.assert_allclose(g[k], e, rtol=1e-10, atol=1e-10),
                         got, fn(*pick))
    loss = lambda dy, x, w: sum(jnp.sum(jnp.sin(o)) for o in fn(dy, x, w))
    got = jax.vmap(jax.grad(loss, (0, 1, 2)))(dy, x, w)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g[1], e, rtol=1e-10, atol=1e-10),
                 got, jax.grad(loss, (0, 1, 2))(dy[1], x[1], w[1]))
    check_grads(fn, (dy[0], x[0], w[0]), order=2, modes=("rev",))


@pytest.mark.parametrize("name,op,forward", [g[:3] for g in GRAD_OPS], ids=[g[0] for g in GRAD_OPS])
@pytest.mark.parametrize("varying", ["dY", "X", "W"])
def test_inside_shard_map_with_replicated_operands(rng, name, op, forward, varying):
    """Per-device grads where only one operand differs between devices (the others are
    replicated, as a shared dY or weights are in a data-parallel step)."""
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    attrs = {"strides": [2, 2]}
    ws = (4, 3, 3, 3) if name == "conv_grad" else (3, 2, 3, 3)
    args = dict(zip(("dY", "X", "W"), conv_inputs(rng, forward, (2, 3, 6, 6), ws, attrs,
                                                  jnp.float32)))
    stacked = jnp.stack([args[varying] * (k + 1) for k in range(4)])
    specs = tuple(P("x") if k == varying else P() for k in ("dY", "X", "W"))

    def per_device(dy, x, w):
        one = {"dY": dy, "X": x, "W": w}
        one[varying] = one[varying][0]
        return tuple(g[None] for g in op(one["dY"], one["X"], one["W"], **attrs))
    f = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P("x"))
    got = f(*[stacked if k == varying else args[k] for k in ("dY", "X", "W")])
    for k in range(4):
        want = op(*[stacked[k] if n == varying else args[n] for n in ("dY", "X", "W")], **attrs)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g[k], e, rtol=1e-5, atol=1e-5),
                     got, want)


def test_conv_bad_input():
    x, w, dy = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3)), jnp.ones((1, 3, 3, 3))
    cases = [
        (lambda: ops.conv_grad(dy, x.astype(jnp.int32), w), TypeError, "X must be float"),
        (lambda: ops.conv_grad(dy, x.astype(jnp.float32), w), TypeError, "share one dtype"),
        (lambda: ops.conv_grad(dy, x[0, 0], w), ValueError, "N, C and 1 to 3 spatial"),
        (lambda: ops.conv_grad(dy, x, w[:, :1]), ValueError, "channels do not match"),
        (lambda: ops.conv_grad(dy, x, w, group=2), ValueError, "channels do not match"),
        (lambda: ops.conv_grad(dy[:, :, :2], x, w), ValueError, "forward output's shape"),
        (lambda: ops.conv_grad(dy, x, w, strides=[1]), ValueError, "strides must have 2"),
        (lambda: ops.conv_grad(dy, x, w, kernel_shape=[2, 2]), ValueError, "kernel_shape"),
        (lambda: ops.conv_grad(dy, x, w, auto_pad="SAME"), ValueError, "auto_pad must be"),
        (lambda: ops.conv_grad(dy, x, w, pads=[-1, 0, 0, 0]), ValueError, "pads >= 0"),
        (lambda: ops.conv_grad(dy, x, w, outputs=(True,)), TypeError, "3 bools"),
        (lambda: ops.conv_transpose_grad(dy, x, w), ValueError, "channels do not match"),
        (lambda: ops.conv_transpose_grad(x, dy, w, output_padding=[3, 0]),
         ValueError, "output_padding"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text) as info:
            call()
        assert "jaxops.ops.conv" in str(info.value)


# ---- ResizeGrad ----
RESIZE = [((2, 3, 4, 5), (8, 10), "half_pixel", True), ((1, 2, 4, 5), (7, 13), "half_pixel", False),
          ((1, 2, 4, 5), (7, 9), "align_corners", False), ((1, 2, 6, 5), (3, 2), "half_pixel", False),
          ((1, 1, 4, 4), (1, 1), "align_corners", False)]


def resize_case(rng, xs, out, ctm, use_scales, dtype):
    x = jnp.asarray(rng.standard_normal(xs), dtype)
    dy = jnp.asarray(rng.standard_normal(xs[:2] + out), dtype)
    scales = np.array([1, 1, out[0] / xs[2], out[1] / xs[3]], np.float32) if use_scales else None
    return dy, x, scales


@pytest.mark.parametrize("xs,out,ctm,use_scales", RESIZE, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_resize_grad_matches_reference(rng, xs, out, ctm, use_scales, dtype):
    dy, x, scales = resize_case(rng, xs, out, ctm, use_scales, dtype)
    got = ops.resize_grad(dy, x, None, scales, mode="linear", coordinate_transformation_mode=ctm)
    assert got.dtype == dtype and got.shape == x.shape
    sh = None if scales is None else tuple(float(s) for s in scales[2:])
    expected = resize_ref.resize_grad(jnp.asarray(dy, jnp.float64), jnp.asarray(x, jnp.float64),
                                      ctm == "align_corners", sh)
    # weights are f32 in the op (as in ORT's kernel): f32-level agreement at best
    assert_close(got, expected, dtype if dtype != jnp.float64 else jnp.float32, ulps=16)


def test_resize_grad_traced_scales(rng):
    # jit, vmap, vmap(grad), check_grads and sharding: tests/test_op_matrix.py
    dy, x, _ = resize_case(rng, (2, 3, 4, 5), (7, 9), "half_pixel", False, jnp.float64)
    fn = functools.partial(ops.resize_grad, mode="linear")
    scales = jnp.asarray([1, 1, 7 / 4, 9 / 5], jnp.float32)  # a traced scales input works
    np.testing.assert_allclose(jax.jit(fn)(dy, x, None, scales), fn(dy, x), rtol=1e-5, atol=1e-6)


def test_resize_grad_bad_input():
    dy, x = jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 2, 2))
    cases = [({"mode": "nearest"}, "mode='linear'"),
             ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, "half_pixel"),
             ({"mode": "linear", "antialias": 1}, "antialias"),
             ({"mode": "linear", "axes": [2, 3]}, "axes")]
    for kw, text in cases:
        with pytest.raises(ValueError, match=text):
            ops.resize_grad(dy, x, **kw)
    with pytest.raises(ValueError, match="jaxops.ops.resize_grad: dY and X must be NCHW"):
        ops.resize_grad(dy[0], x[0], mode="linear")
    with pytest.raises(ValueError, match="scales must be 4 floats"):
        ops.resize_grad(dy, x, None, np.ones(2, np.float32), mode="linear")
    with pytest.raises(TypeError, match="jaxops.ops.resize_grad: X must be float"):
        ops.resize_grad(dy, x.astype(jnp.int32), mode="linear")


# ---- MaxPoolGrad ----
def max_pool_with_indices(x, k, s):
    """MaxPool over [N, C, H, W] with ORT's storage_order=0 flat indices, in numpy."""
    n, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    y, idx = np.zeros((n, c, oh, ow)), np.zeros((n, c, oh, ow), np.int64)
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    win = x[a, b, i * s:i * s + k, j * s:j * s + k]
                    r, q = np.unravel_index(np.argmax(win), win.shape)
                    y[a, b, i, j] = win[r, q]
                    idx[a, b, i, j] = ((a * c + b) * h + i * s + r) * w + j * s + q
    return y, idx


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_max_pool_grad(rng, dtype):
    x = rng.standard_normal((2, 3, 6, 6))
    _, idx = max_pool_with_indices(x, 3, 1)  # overlapping windows: indices repeat
    dy = jnp.asarray(rng.standard_normal(idx.shape), dtype)
    got = ops.max_pool_grad(dy, idx, x_shape=x.shape, kernel_shape=[3, 3], strides=[1, 1])
    assert got.dtype == dtype and got.shape == x.shape
    expected = pool_ref.max_pool_grad(jnp.asarray(dy, jnp.float64), jnp.asarray(idx), x.shape)
    assert_close(got, expected, dtype)
    # it is the gradient of max pooling
    pool = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 1, 1),
                                           "VALID")
    g = jax.vjp(pool, jnp.asarray(x))[1](jnp.asarray(dy, jnp.float64))[0]
    assert_close(got, g, dtype)


def test_max_pool_grad_rules(rng):
    dy = jnp.ones((1, 1, 2, 2), jnp.float32)
    idx = jnp.asarray([[[[0, 3], [8, 15]]]])
    out = ops.max_pool_grad(dy, idx, x_shape=(1, 1, 4, 4))
    np.testing.assert_array_equal(out.reshape(-1), np.isin(np.arange(16), [0, 3, 8, 15]))
    # out-of-range indices (ORT: out-of-bounds writes) are dropped, never wrapped or clamped
    bad = jnp.asarray([[[[-1, 16], [5, 100]]]])
    out = ops.max_pool_grad(dy, bad, x_shape=(1, 1, 4, 4))
    np.testing.assert_array_equal(out.reshape(-1), np.arange(16) == 5)
    # dim 0 comes from dY, as in ORT
    assert ops.max_pool_grad(dy, idx, x_shape=(7, 1, 4, 4)).shape == (1, 1, 4, 4)
    # jit, vmap, vmap(grad), check_grads: tests/test_op_matrix.py
    fn = functools.partial(ops.max_pool_grad, x_shape=(1, 1, 4, 4))
    for call, error, text in [
            (lambda: fn(dy, idx.astype(jnp.float32)), TypeError, "Indices must be int32 or int64"),
            (lambda: fn(dy, idx[..., :1]), ValueError, "share one shape"),
            (lambda: ops.max_pool_grad(dy, idx, x_shape=(4, 4)), ValueError, "x_shape"),
            (lambda: ops.max_pool_grad(dy, idx), TypeError, "missing a required argument"),
            (lambda: ops.max_pool_grad(dy, idx, x_shape=(1, 1, 4, 4), bogus=1), TypeError,
             "unexpected keyword argument 'bogus'")]:
        with pytest.raises(error, match=text) as info:
            call()
        assert "jaxops.ops.max_pool_grad" in str(info.value)


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "ConvGrad")] is ops.conv_grad
    assert ops.ORT_OPS[(ms, "ConvTransposeGrad")] is ops.conv_transpose_grad
    assert ops.ORT_OPS[(ms, "ResizeGrad")] is ops.resize_grad
    assert ops.ORT_OPS[("", "MaxPoolGrad")] is ops.max_pool_grad
