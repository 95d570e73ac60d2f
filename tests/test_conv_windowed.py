"""ops.conv.windowed_conv, the grouped/depthwise convolution that jaxops runs on the CPU (ConvGrad,
ConvTransposeGrad, the importer's Conv/ConvTranspose): the same values and gradients as
lax.conv_general_dilated, under jit and vmap; chosen when lowering for the CPU only."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from jaxops import ops
from jaxops.ops.conv import (conv_general, dense_conv_dw, depthwise_conv_dw, grouped_conv_dx,
                             phase_conv, windowed_conv)

# (x shape, w shape, strides, padding, dilations, group, lhs_dilation)
CASES = [
    ((2, 6, 9), (6, 1, 3), (2,), [(1, 2)], (2,), 6, None),                # depthwise 1-D
    ((2, 4, 7, 6), (8, 1, 3, 3), (2, 1), [(1, 1), (0, 2)], (1, 2), 4, None),  # multiplier 2
    ((1, 6, 7, 6), (4, 3, 3, 2), (1, 2), [(2, 0), (1, 1)], (2, 1), 2, None),  # grouped
    ((2, 6, 5, 6), (6, 2, 2, 3), (1, 1), [(1, 1), (2, 1)], (1, 1), 3, (2, 3)),  # lhs-dilated
    ((1, 4, 5, 6), (4, 1, 3, 3), (1, 2), [(-1, 2), (2, -2)], (2, 1), 4, (2, 1)),  # crops
    ((1, 4, 4, 5, 3), (4, 1, 2, 3, 2), (2, 1, 1), [(1, 0), (0, 1), (1, 1)], (1, 1, 2), 4, None),
    ((1, 4, 4, 5, 3), (6, 2, 2, 2, 2), (1, 2, 1), [(0, 0)] * 3, (1, 1, 1), 2, None),
    ((2, 3, 6, 7), (4, 3, 3, 2), (2, 2), [(1, 0), (2, 1)], (1, 1), 1, None),  # dense
    # patchify (strides == kernel, unpadded: _blocks), the last partial block dropped
    ((2, 3, 9, 10), (4, 3, 4, 4), (4, 4), [(0, 0)] * 2, (1, 1), 1, None),
    ((1, 4, 4, 6, 5), (6, 2, 2, 3, 2), (2, 3, 2), [(0, 0)] * 3, (1, 1, 1), 2, None),
]
IDS = [f"{len(c[0]) - 2}d-g{c[5]}-{'ld' if c[6] else 'x'}" for c in CASES]


def xla_conv(x, w, strides, padding, dilations, group, lhs_dilation):
    sp = "DHW"[-(x.ndim - 2):]
    return lax.conv_general_dilated(
        x, w, strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=dilations,
        dimension_numbers=("NC" + sp, "OI" + sp, "NC" + sp), feature_group_count=group,
        precision=lax.Precision.HIGHEST)


def inputs(rng, case, dtype=jnp.float64):
    xs, ws = case[:2]
    return (jnp.asarray(rng.standard_normal(xs), dtype),
            jnp.asarray(rng.standard_normal(ws), dtype))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.float64, 1e-13)],
                         ids=["f32", "f64"])
def test_values_and_gradients_match_xla(rng, case, dtype, tol):
    x, w = inputs(rng, case, dtype)
    ours = lambda x, w: windowed_conv(x, w, *case[2:])
    theirs = lambda x, w: xla_conv(x, w, *case[2:])
    y, vjp = jax.vjp(ours, x, w)
    want, want_vjp = jax.vjp(theirs, x, w)
    assert y.shape == want.shape and y.dtype == want.dtype
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol * scale)
    dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
    for got, exp in zip(vjp(dy), want_vjp(dy)):  # dX, dW: jax's transposes of each
        np.testing.assert_allclose(got, exp, rtol=tol, atol=tol * float(jnp.abs(exp).max()))


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 3, 5)], ids=[IDS[i] for i in (1, 3, 5)])
def test_jit_vmap_and_second_order(rng, case):
    f = lambda x, w: windowed_conv(x, w, *case[2:])
    g = lambda x, w: xla_conv(x, w, *case[2:])
    (x0, w0), (x1, w1) = inputs(rng, case), inputs(rng, case)
    np.testing.assert_allclose(jax.jit(f)(x0, w0), g(x0, w0), rtol=1e-12, atol=1e-12)
    x, w = jnp.stack([x0, x1]), jnp.stack([w0, w1])
    for in_axes in [(0, 0), (0, None), (None, 0)]:
        got = jax.jit(jax.vmap(f, in_axes))(x if in_axes[0] == 0 else x0,
                                            w if in_axes[1] == 0 else w0)
        for k in range(2):
            want = g(x[k] if in_axes[0] == 0 else x0, w[k] if in_axes[1] == 0 else w0)
            np.testing.assert_allclose(got[k], want, rtol=1e-12, atol=1e-12)
    check_grads(f, (x0, w0), order=2, modes=("rev", "fwd"))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_reduced_precision_rounds_once(rng, dtype, channels_last):
    case = CASES[2]
    x, w = inputs(rng, case, dtype)
    got = windowed_conv(x, w, *case[2:], channels_last=channels_last)
    want = xla_conv(x.astype(jnp.float32), w.astype(jnp.float32), *case[2:]).astype(dtype)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=float(jnp.finfo(dtype).eps))


def _lowered(platform, case):
    x, w = inputs(np.random.default_rng(0), case, jnp.float32)
    f = jax.jit(lambda x, w: conv_general(x, w, *case[2:]))
    if platform == "compiled cpu":
        return f.lower(x, w).compile().as_text()
    return f.trace(x, w).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_platform_choice(case):
    """The CPU gets no XLA convolution for a grouped one (its transposes are the slow ones:
    windowed_conv's docstring); CUDA keeps XLA's (cuDNN) and only it; a dense convolution
    stays XLA's everywhere. The branch is picked when lowering: no conditional is compiled."""
    grouped = case[5] > 1
    assert ("convolution" in _lowered("cpu", case)) != grouped
    cuda = _lowered("cuda", case)
    assert "convolution" in cuda and "stablehlo.slice" not in cuda
    assert "conditional" not in _lowered("compiled cpu", case)


def _conv_grad_lowered(xs, ws, outputs, platform="cpu", **attrs):
    x = jax.ShapeDtypeStruct(xs, jnp.float32)
    w = jax.ShapeDtypeStruct(ws, jnp.float32)
    n = len(xs) - 2
    strides = attrs.get("strides") or (1,) * n
    pads = attrs.get("pads") or (0,) * 2 * n
    out = [(i + pads[k] + pads[k + n] - ws[2 + k]) // strides[k] + 1 for k, i in enumerate(xs[2:])]
    dy = jax.ShapeDtypeStruct((xs[0], ws[0], *out), jnp.float32)
    f = jax.jit(lambda *a: ops.conv_grad(*a, outputs=outputs, **attrs))
    return f.trace(dy, x, w).lower(lowering_platforms=(platform,)).as_text()


def test_dense_conv_grad_stays_xla_on_the_cpu():
    """A dense ConvGrad is XLA's convolutions on the CPU too (conv_general's docstring), but
    for the 1x1, image-stem and patchify ones, whose windowed forms are matmuls there, and
    the dW of one with >= 16 input channels (dense_conv_dw: a matmul a tap)."""
    xs, ws = (2, 4, 16, 16), (4, 4, 3, 3)  # 4 channels x 9 taps: no stem
    assert "convolution" in _conv_grad_lowered(xs, ws, (False, True, False))
    assert "convolution" in _conv_grad_lowered(xs, ws, (True, False, False))
    xs, ws = (2, 16, 16, 16), (8, 16, 3, 3)
    dw = _conv_grad_lowered(xs, ws, (False, True, False), pads=[1] * 4)
    assert "convolution" not in dw and dw.count("dot_general") == 9
    assert "convolution" in _conv_grad_lowered(xs, ws, (True, False, False), pads=[1] * 4)
    assert "convolution" in _conv_grad_lowered(xs, ws, (False, True, False), "cuda",
                                               pads=[1] * 4)
    # a 3-channel 7x7 stride-2 stem: dW through phase_conv, over 3 * 2 * 2 phase channels
    xs, ws, attrs = (2, 3, 16, 16), (8, 3, 7, 7), {"strides": [2, 2], "pads": [3] * 4}
    assert "tensor<2x12x11x11xf32>" in _conv_grad_lowered(xs, ws, (False, True, False), **attrs)
    assert "x12x" not in _conv_grad_lowered(xs, ws, (False, True, False), "cuda", **attrs)
    for xs, ws, attrs in [((2, 3, 16, 16), (8, 3, 3, 3), {"strides": [2, 2], "pads": [1] * 4}),
                          ((2, 16, 8, 8), (8, 16, 1, 1), {"strides": [2, 2]}),
                          ((2, 3, 16, 16), (8, 3, 4, 4), {"strides": [4, 4]})]:
        assert "convolution" not in _conv_grad_lowered(xs, ws, (True, True, False), **attrs)
        assert "convolution" in _conv_grad_lowered(xs, ws, (True, True, False), "cuda", **attrs)


# (x shape, kernel, strides, padding, dilations): group-1 geometries for dense_conv_dw
DENSE = [
    ((2, 5, 9), (3,), (2,), [(1, 2)], (2,)),
    ((2, 4, 7, 6), (3, 2), (2, 1), [(1, 0), (0, 2)], (1, 2)),
    ((1, 3, 5, 4, 6), (2, 3, 2), (1, 2, 1), [(1, 1), (0, 1), (2, 0)], (2, 1, 1)),
]


@pytest.mark.parametrize("case", DENSE, ids=["1d", "2d", "3d"])
def test_dense_conv_dw_is_the_transpose(rng, case):
    """dense_conv_dw is jax's transpose in w of XLA's group-1 convolution (strided, padded
    unevenly, dilated, 1-3 spatial dims), and differentiable again."""
    xs, kernel, strides, padding, dilations = case
    x = jnp.asarray(rng.standard_normal(xs))
    w = jnp.zeros((3, xs[1], *kernel))
    y, vjp = jax.vjp(lambda w: xla_conv(x, w, strides, padding, dilations, 1, None), w)
    dy = jnp.asarray(rng.standard_normal(y.shape))
    dw = lambda dy, x: dense_conv_dw(dy, x, kernel, strides, padding, dilations)
    np.testing.assert_allclose(dw(dy, x), vjp(dy)[0], rtol=1e-12, atol=1e-12)
    check_grads(dw, (dy, x), order=2, modes=("rev", "fwd"))


@pytest.mark.parametrize("dense", DENSE, ids=["1d", "2d", "3d"])
def test_phase_conv_is_the_convolution(rng, dense):
    """phase_conv (strides as phase channels) gives XLA's strided convolution and its
    transpose in w (kernels the strides do not divide, uneven pads, 1-3 spatial dims)."""
    xs, kernel, strides, padding, _ = dense
    x = jnp.asarray(rng.standard_normal(xs))
    w = jnp.asarray(rng.standard_normal((3, xs[1], *kernel)))
    want, want_vjp = jax.vjp(lambda w: xla_conv(x, w, strides, padding, (1,) * len(kernel), 1,
                                                None), w)
    got, vjp = jax.vjp(lambda w: phase_conv(x, w, strides, padding), w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    dy = jnp.asarray(rng.standard_normal(want.shape))
    np.testing.assert_allclose(vjp(dy)[0], want_vjp(dy)[0], rtol=1e-12, atol=1e-12)


# (x shape, w shape, strides, pads): dW through dense_conv_dw (16 channels) and phase_conv
ON_CPU = [((2, 16, 9, 8), (6, 16, 3, 3), [2, 1], [1, 0, 2, 1]),
          ((2, 3, 13, 12), (4, 3, 7, 5), [2, 3], [3, 2, 3, 1])]


@pytest.mark.parametrize("case", ON_CPU, ids=["taps", "phases"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float16, 2e-3)],
                         ids=["f64", "f16"])
def test_dense_conv_grad_on_the_cpu(rng, case, dtype, tol):
    """ConvGrad of a 16-channel strided, padded 3x3 convolution (dense_conv_dw) and of a
    3-channel strided 7x5 one (phase_conv) gives jax's gradient of XLA's convolution on the
    CPU (f16 accumulated in f32, rounded once)."""
    xs, ws, strides, pads = case
    _conv_grad_matches_xla(rng, xs, ws, strides, pads, dtype, tol)


def _conv_grad_matches_xla(rng, xs, ws, strides, pads, dtype, tol):
    """ConvGrad's dX and dW (undilated, group 1) against jax's gradient of XLA's convolution
    (f16 against the f32 one: accumulated in f32, rounded once)."""
    n = len(xs) - 2
    x = jnp.asarray(rng.standard_normal(xs), dtype)
    w = jnp.asarray(rng.standard_normal(ws), dtype)
    f32 = lambda a: a.astype(jnp.float32) if dtype == jnp.float16 else a
    padding = list(zip(pads[:n], pads[n:]))
    y, vjp = jax.vjp(lambda x, w: xla_conv(x, w, strides, padding, (1,) * n, 1, None),
                     f32(x), f32(w))
    dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
    dx, dw, _ = jax.jit(lambda *a: ops.conv_grad(*a, strides=strides, pads=pads))(dy, x, w)
    for got, want in zip((dx, dw), vjp(f32(dy))):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.float64(got), np.float64(want), rtol=tol,
                                   atol=tol * float(jnp.abs(want).max()))


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float16, 2e-3)],
                         ids=["f64", "f16"])
def test_small_1d_conv_grad_is_windowed_on_the_cpu(rng, stride, dtype, tol):
    """A small 1-D dense convolution (Whisper's: 16 positions, 16 channels, kernel 3) is
    windowed_conv on the CPU in a training step, its ConvGrad matmuls and pads (no
    lhs-dilated convolution for the strided one's dX), and gives jax's gradient of XLA's
    convolution; a GPU keeps XLA's; a small 2-D one (ResNet's) keeps XLA's on the CPU too
    (_small_patches)."""
    xs, ws, attrs = (2, 16, 16), (32, 16, 3), {"strides": [stride], "pads": [1, 1]}
    lowered = _conv_grad_lowered(xs, ws, (True, True, False), **attrs)
    assert "convolution" not in lowered and "dot_general" in lowered
    assert "convolution" in _conv_grad_lowered(xs, ws, (True, True, False), "cuda", **attrs)
    _conv_grad_matches_xla(rng, xs, ws, [stride], [1, 1], dtype, tol)
    xs, ws = (2, 16, 8, 8), (16, 16, 3, 3)
    assert "convolution" in _conv_grad_lowered(xs, ws, (True, False, False), strides=[2, 2],
                                               pads=[1] * 4)


def test_dense_conv_dw_batch_sharded(rng):
    """dY and X sharded on the batch over 4 CPU devices: dense_conv_dw's dots reduce dW by an
    all-reduce, never gathering the activations."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from helpers import on_cpu_devices
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = jnp.asarray(rng.standard_normal((4, 16, 6, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 16, 3, 3)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, 8, 6, 6)), jnp.float32)
    f = jax.jit(lambda dy, x, w: ops.conv_grad(dy, x, w, pads=[1] * 4, outputs=(False, True, False))[1])
    on = NamedSharding(mesh, PartitionSpec("x"))
    placed = (jax.device_put(dy, on), jax.device_put(x, on), w)
    hlo = f.lower(*placed).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo
    np.testing.assert_allclose(f(*placed), f(dy, x, w), rtol=1e-5, atol=1e-4)


GROUPED = [c for c in CASES if c[5] > 1]


@pytest.mark.parametrize("case", GROUPED, ids=[IDS[CASES.index(c)] for c in GROUPED])
def test_transposes_written_out(rng, case):
    """grouped_conv_dx (and depthwise_conv_dw for a depthwise case) are windowed_conv's
    transposes in x and w (strided, dilated, channel multiplier, lhs-dilated, cropped, 1-3
    spatial dims)."""
    x, w = inputs(rng, case)
    y, vjp = jax.vjp(lambda x, w: windowed_conv(x, w, *case[2:]), x, w)
    dy = jnp.asarray(rng.standard_normal(y.shape))
    want_x, want_w = vjp(dy)
    strides, padding, dilations, group, lhs_dilation = case[2:]
    got_x = grouped_conv_dx(dy, w, x.shape, strides, padding, dilations, group, lhs_dilation)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-12, atol=1e-12)
    if w.shape[1] == 1:
        got_w = depthwise_conv_dw(dy, x, w.shape[2:], strides, padding, dilations, lhs_dilation)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float16, 2e-3)],
                         ids=["f64", "f16"])
def test_depthwise_conv_grad_on_the_cpu(rng, dtype, tol):
    """ConvGrad of a strided depthwise convolution runs the written-out transposes on the CPU
    (no interior padding: jax's transpose of the strided slices pads with it) and gives jax's
    gradient of XLA's convolution, differentiable again."""
    xs, ws = (2, 6, 9, 8), (12, 1, 5, 3)
    attrs = {"group": 6, "strides": [2, 3], "pads": [2, 1, 1, 0]}
    padding = [(2, 1), (1, 0)]
    x = jnp.asarray(rng.standard_normal(xs), dtype)
    w = jnp.asarray(rng.standard_normal(ws), dtype)
    f32 = lambda a: a.astype(jnp.float32) if dtype == jnp.float16 else a
    y, vjp = jax.vjp(lambda x, w: xla_conv(x, w, (2, 3), padding, (1, 1), 6, None), f32(x), f32(w))
    dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
    dx, dw, db = ops.conv_grad(dy, x, w, **attrs)
    for got, want in zip((dx, dw), vjp(f32(dy))):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.float64(got), np.float64(want), rtol=tol,
                                   atol=tol * float(jnp.abs(want).max()))
    f = jax.jit(lambda *a: ops.conv_grad(*a, **attrs))
    text = f.trace(dy, x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "convolution" not in text
    interiors = re.findall(r"interior = (?:array<i64: )?\[?([-\d, ]*)", text)
    assert interiors and not any(set(i.replace(",", " ").split()) - {"0"} for i in interiors)
    if dtype == jnp.float64:
        check_grads(lambda dy, w: ops.conv_grad(dy, x, w, **attrs)[0], (dy, w), order=2,
                    modes=("rev", "fwd"))


def test_depthwise_sum_is_materialized_once(rng):
    """A depthwise windowed_conv ends in lax.optimization_barrier (where this jax can
    differentiate it), so XLA:CPU computes its k-term sum once, not again inside each consumer
    (ConvNeXt's LayerNorm: three times); grouped ones end in a matmul and have none."""
    from jaxops.ops.conv import _barrier_differentiates

    def layer_norm_after(case):
        def f(x, w):
            y = windowed_conv(x, w, *case[2:])
            mean = y.mean(axis=1, keepdims=True)
            return (y - mean) / jnp.sqrt(((y - mean) ** 2).mean(axis=1, keepdims=True) + 1e-5)
        return f

    depthwise, grouped = CASES[1], CASES[2]
    for case, want in ((depthwise, _barrier_differentiates()), (grouped, False)):
        x, w = inputs(rng, case, jnp.float32)
        text = jax.jit(layer_norm_after(case)).lower(x, w).as_text()
        assert ("optimization_barrier" in text) == want, case
    if not _barrier_differentiates():
        pytest.skip("this jax cannot differentiate lax.optimization_barrier")
    x, w = inputs(rng, depthwise)
    check_grads(layer_norm_after(depthwise), (x, w), order=2, modes=["fwd", "rev"])


# ---- channels last (the importer's Conv with a constant weight, on the CPU) ----

@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.float64, 1e-13)],
                         ids=["f32", "f64"])
def test_channels_last_matches_xla(rng, case, dtype, tol):
    """windowed_conv's channels-last form: XLA's values and gradients (depthwise with a
    multiplier, grouped, dense, lhs-dilated, cropped, 1-3 spatial dims)."""
    x, w = inputs(rng, case, dtype)
    y, vjp = jax.vjp(lambda x, w: windowed_conv(x, w, *case[2:], channels_last=True), x, w)
    want, want_vjp = jax.vjp(lambda x, w: xla_conv(x, w, *case[2:]), x, w)
    assert y.shape == want.shape and y.dtype == want.dtype
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol * float(jnp.abs(want).max()))
    dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
    for got, exp in zip(vjp(dy), want_vjp(dy)):
        np.testing.assert_allclose(got, exp, rtol=tol, atol=tol * float(jnp.abs(exp).max()))


def _geometry(rng):
    """A random 1-D or 2-D convolution: maps as small as the dilated kernel or smaller (taps
    that read only padding), strides, uneven pads, group 1, 2 or depthwise."""
    n = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 4]))
    c, o = 4 * int(rng.integers(1, 4)), 4 * int(rng.integers(1, 3))
    kernel = tuple(int(k) for k in rng.integers(1, 5, n))
    dilations = tuple(int(d) for d in rng.integers(1, 7, n))
    strides = tuple(int(s) for s in rng.integers(1, 3, n))
    size = tuple(int(s) for s in rng.integers(1, 9, n))
    padding = [tuple(int(p) for p in rng.integers(0, (k - 1) * d + 2, 2))
               for k, d in zip(kernel, dilations)]
    return (2, c, *size), (o, c // group, *kernel), strides, padding, dilations, group


def test_channels_last_conv_general_random_geometries(rng):
    """conv_general(channels_last=True) lowered for the CPU (taps that read only padding
    dropped, small dense convolutions as channels-last im2col) equals XLA's convolution, on
    fresh random inputs over 60 random geometries (a wrong trimmed pad or tap range moves the
    output)."""
    checked = 0
    while checked < 60:
        xs, ws, strides, padding, dilations, group = _geometry(rng)
        padded = [i + lo + hi for i, (lo, hi) in zip(xs[2:], padding)]
        if any(p < (k - 1) * d + 1 for p, k, d in zip(padded, ws[2:], dilations)):
            continue  # no output
        x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
        w = jnp.asarray(rng.standard_normal(ws), jnp.float32)
        got = jax.jit(lambda x, w: conv_general(
            x, w, strides, padding, dilations, group, dense=True, channels_last=True))(x, w)
        want = xla_conv(x, w, strides, padding, dilations, group, None)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()),
                                   err_msg=str((xs, ws, strides, padding, dilations, group)))
        checked += 1


def test_live_taps():
    """A 3x3 convolution dilated 6 (pad 6) over a 4x4 map reads the input with its centre tap
    only: conv_general's CPU form is then a 1x1 convolution (a matmul over the 16 input
    channels, no 9-tap patches); dilated 2 over it, every tap reads some pixel."""
    from jaxops.ops.conv import _live_taps
    assert _live_taps((4, 4), (3, 3), (1, 1), [(6, 6)] * 2, (6, 6), (4, 4), None) == (
        [(1, 2)] * 2, [(0, 0)] * 2)
    assert _live_taps((4, 4), (3, 3), (1, 1), [(2, 2)] * 2, (2, 2), (4, 4), None) is None
    # the first tap dead only: its begin pad goes, the end pad stays
    assert _live_taps((3,), (3,), (1,), [(4, 2)], (2,), (3,), None) == ([(1, 3)], [(2, 2)])
    x = jax.ShapeDtypeStruct((2, 16, 4, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 16, 3, 3), jnp.float32)
    f = jax.jit(lambda x, w: conv_general(x, w, (1, 1), [(6, 6)] * 2, (6, 6), 1, dense=True,
                                          channels_last=True))
    cpu = f.trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "convolution" not in cpu and "dot_general" in cpu
    assert "tensor<32x16xf32>" in cpu and "144" not in cpu  # [pixels, C] patches, no 9 * C
    cuda = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "convolution" in cuda and "dot_general" not in cuda  # the GPU keeps XLA's


def test_importer_conv_channels_last_where_no_conv_grad_reads_it(rng):
    """The importer's Conv takes the channels-last form (a small dense 3x3 is then a matmul on
    the CPU) where its weight is a constant (program.jit() closes over the params) or the graph
    has no ConvGrad (an eval model, run by Module.eval with the params traced); in a graph
    with a ConvGrad and traced params it stays XLA's convolution. Same values either way;
    CUDA keeps XLA's convolution."""
    from onnx import helper

    from jaxops.onnx import load
    from onnx_build import model
    wv = rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    grad = helper.make_node("ConvGrad", ["y", "x", "w"], ["dx", "dw"], domain="com.microsoft",
                            pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)
    program = load(model([conv], ["x"], ["y"], {"w": wv}))
    training = load(model([conv, grad], ["x"], ["y", "dx"], {"w": wv},
                          domains=["com.microsoft"]))
    x = jnp.asarray(rng.standard_normal((2, 16, 4, 4)), jnp.float32)
    forward = program.jit()
    traced = jax.jit(program)
    cpu = dict(lowering_platforms=("cpu",))  # whatever the default backend
    assert "convolution" not in forward.trace(x).lower(**cpu).as_text()
    assert "convolution" not in traced.trace(program.params, x).lower(**cpu).as_text()
    # the training graph's own Conv (its ConvGrad's transposes are convolutions too): count them
    with_grad = jax.jit(training).trace(training.params, x).lower(**cpu).as_text()
    only_grad = jax.jit(lambda p, x: ops.conv_grad(x[:, :8], x, p["w"], pads=[1, 1, 1, 1])[:2])
    n_grad = only_grad.trace(training.params, x).lower(**cpu).as_text().count("convolution(")
    assert with_grad.count("convolution(") == n_grad + 1
    cuda = forward.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "convolution" in cuda
    want = xla_conv(x, jnp.asarray(wv), (1, 1), [(1, 1)] * 2, (1, 1), 1, None)
    for got in (forward(x), traced(program.params, x), training(training.params, x)[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_channels_last_depthwise_reads_its_constant_weight_as_one_buffer(rng):
    """A depthwise convolution's constant weight (program.jit()'s) reaches XLA as one constant,
    its taps' rows read from it, not one constant a tap (XLA:CPU allocates each constant every
    call); the values are XLA's convolution's."""
    from jaxops.ops.conv import _barrier_differentiates
    x = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), jnp.float32)
    w = np.asarray(rng.standard_normal((16, 1, 3, 3)), np.float32)
    f = jax.jit(lambda x: conv_general(x, jnp.asarray(w), (1, 1), [(1, 1)] * 2, (1, 1), 16,
                                       dense=True, channels_last=True))
    want = xla_conv(x, jnp.asarray(w), (1, 1), [(1, 1)] * 2, (1, 1), 16, None)
    np.testing.assert_allclose(f(x), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    if jax.default_backend() != "cpu":
        return
    constants = f.lower(x).compile().as_text().split("ENTRY")[1].count(" constant(")
    assert constants <= (1 if _barrier_differentiates() else 9)


def test_channels_last_1x1s_transpose_only_at_the_ends(rng):
    """Two channels-last 1x1 convolutions in a row (program.jit()'s constant weights) transpose
    x to channels last once and the result back once: a 1x1's patches are x as it lies, where
    the blocks' unit axes had kept XLA from cancelling the transposes between them (each 1x1
    copied its input twice); the values are XLA's convolutions'."""
    w1 = jnp.asarray(rng.standard_normal((24, 16, 1, 1)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((8, 24, 1, 1)), jnp.float32)
    args = ((1, 1), [(0, 0)] * 2, (1, 1), 1)
    ours = lambda x, w: conv_general(x, w, *args, dense=True, channels_last=True)  # noqa: E731
    theirs = lambda x, w: xla_conv(x, w, *args, None)  # noqa: E731
    f = jax.jit(lambda x: ours(jnp.maximum(ours(x, w1), 0), w2))
    x = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), jnp.float32)
    want = theirs(jnp.maximum(theirs(x, w1), 0), w2)
    np.testing.assert_allclose(f(x), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    if jax.default_backend() == "cpu":
        text = f.lower(x).compile().as_text()
        assert text.count("transpose(") == 2 and text.count(" copy(") == 2, text
