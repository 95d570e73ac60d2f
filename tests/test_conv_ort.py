"""ConvGrad and MaxPoolGrad against onnxruntime-training 1.19.2 (CPU); the forwards behind
ConvTransposeGrad and ResizeGrad (which ORT runs on CUDA only) against ORT's CPU ConvTranspose
and Resize: the gradients are their exact transposes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from jaxops.ops.conv import conv, conv_transpose
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

# Conv attributes as torch.onnx export writes them (explicit pads, auto_pad NOTSET) and more
CONV = [
    ((2, 4, 5, 5), (6, 2, 3, 3), {"group": 2, "kernel_shape": [3, 3], "strides": [1, 1],
                                      "pads": [0, 0, 0, 0], "dilations": [1, 1]}),
    ((2, 3, 9), (4, 3, 2), {"kernel_shape": [2], "strides": [2], "pads": [1, 0], "dilations": [2]}),
    ((2, 3, 8, 7), (5, 3, 3, 3), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 4, 6, 7), (4, 1, 3, 2), {"group": 4, "strides": [2, 3], "pads": [2, 0, 1, 1],
                                      "dilations": [1, 2]}),
    ((1, 2, 6, 7), (3, 2, 3, 2), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((1, 2, 4, 5, 3), (2, 1, 2, 3, 2), {"group": 2, "pads": [1, 0, 1, 0, 1, 1]}),
    ((2, 8, 8, 8), (16, 8, 1, 1), {}),
]
CONV_IDS = [f"{len(x) - 2}d-{i}" for i, (x, _, _) in enumerate(CONV)]


@pytest.mark.parametrize("xs,ws,attrs", CONV, ids=CONV_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_conv_grad_matches_onnxruntime(rng, xs, ws, attrs, dtype):
    x = rng.standard_normal(xs).astype(dtype)
    w = rng.standard_normal(ws).astype(dtype)
    (y,) = ort_oracle.run_node("Conv", [x, w], domain="", **attrs)
    dy = rng.standard_normal(y.shape).astype(dtype)
    expected = ort_oracle.run_node("ConvGrad", [dy, x, w], out_dtypes=[dtype] * 3, **attrs)
    got = ops.conv_grad(jnp.asarray(dy), jnp.asarray(x), jnp.asarray(w), **attrs)
    # dB sums dY over batch and space: its terms set the scale where the sum cancels (seed
    # 1362817864: dB 0.10 from ~40 terms of ~1, both ORT and jaxops 4-7e-7 off float64)
    bias_scale = np.abs(dy.astype(np.float64)).sum(axis=(0, *range(2, dy.ndim)))
    for g, e, scale in zip(got, expected, (None, None, bias_scale)):
        assert g.dtype == dtype and g.shape == e.shape
        assert_close(g, e.astype(np.float64), dtype, ulps=32 if dtype == np.float16 else 16,
                     scale=scale)


@pytest.mark.parametrize("xs,ws,attrs", CONV + [
    ((1, 2, 6, 7), (3, 2, 3, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 3]}),
    ((1, 2, 7, 6), (3, 2, 2, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 2]})],
    ids=CONV_IDS + ["same_upper", "same_lower"])
def test_conv_forward_matches_onnxruntime(rng, xs, ws, attrs):
    # the forward conv_grad transposes; ORT's CPU ConvGrad ignores auto_pad SAME_* (it reads
    # uninitialised memory there), so SAME_* gradients are checked through this forward
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    (expected,) = ort_oracle.run_node("Conv", [x, w], domain="", **attrs)
    assert_close(conv(x, w, **attrs), expected.astype(np.float64), np.float32, ulps=16)


CONV_T = [
    ((2, 4, 3, 3), (4, 3, 3, 3), {"group": 2, "strides": [2, 2]}),
    ((1, 2, 4), (2, 3, 3), {"strides": [2], "pads": [1, 2], "output_padding": [1]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "output_shape": [8, 7]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "output_shape": [6, 5]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [2, 1], "auto_pad": "SAME_UPPER", "output_shape": [9, 3]}),
    ((1, 2, 4, 3), (2, 3, 3, 2), {"strides": [3, 1], "dilations": [2, 2], "pads": [4, 0, 1, 3]}),
    ((1, 2, 2, 3, 2), (2, 2, 2, 2, 2), {"strides": [1, 2, 2], "pads": [0, 1, 0, 0, 1, 1]}),
]


@pytest.mark.parametrize("xs,ws,attrs", CONV_T, ids=[str(a) for _, _, a in CONV_T])
def test_conv_transpose_grad_is_the_transpose_of_onnxruntime(rng, xs, ws, attrs):
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    (y,) = ort_oracle.run_node("ConvTranspose", [x, w], domain="", **attrs)
    assert_close(conv_transpose(x, w, **attrs), y.astype(np.float64), np.float32, ulps=16)
    # <dY, ConvTranspose(X, W)> = <dX, X> = <dW, W>: ConvTransposeGrad is ORT's adjoint
    dy = rng.standard_normal(y.shape)
    dx, dw, db = ops.conv_transpose_grad(dy, x.astype(np.float64), w.astype(np.float64), **attrs)
    inner = float(np.sum(dy * y))
    np.testing.assert_allclose(float(jnp.sum(dx * x)), inner, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(dw * w)), inner, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy.sum(axis=(0,) + tuple(range(2, dy.ndim))), rtol=1e-12)


RESIZE = [((2, 3, 4, 5), (8, 10), "half_pixel", True), ((2, 3, 4, 5), (8, 10), "half_pixel", False),
          ((1, 2, 4, 5), (7, 9), "align_corners", False), ((1, 2, 4, 5), (7, 13), "half_pixel", False),
          ((1, 2, 6, 5), (3, 2), "half_pixel", False), ((1, 2, 6, 5), (3, 2), "align_corners", False),
          ((1, 2, 3, 3), (7, 5), "half_pixel", True), ((1, 1, 4, 4), (1, 1), "align_corners", False)]


@pytest.mark.parametrize("xs,out,ctm,use_scales", RESIZE, ids=str)
def test_resize_grad_is_the_adjoint_of_onnxruntime(rng, xs, out, ctm, use_scales):
    x = rng.standard_normal(xs).astype(np.float32)
    attrs = {"mode": "linear", "coordinate_transformation_mode": ctm}
    if use_scales:
        scales = np.array([1, 1, out[0] / xs[2], out[1] / xs[3]], np.float32)
        (y,) = ort_oracle.run_node("Resize", [x, None, scales], domain="", opset=13, **attrs)
    else:
        scales = None
        sizes = np.array(xs[:2] + out, np.int64)
        (y,) = ort_oracle.run_node("Resize", [x, None, None, sizes], domain="", opset=13, **attrs)
    dy = rng.standard_normal(y.shape)
    dx = ops.resize_grad(dy, x.astype(np.float64), None, scales, **attrs)
    np.testing.assert_allclose(float(jnp.sum(dx * x)), float(np.sum(dy * y)), rtol=1e-5, atol=1e-5)
    # and entry by entry: dX[i] = <dY, Resize(e_i)>, i.e. the Jacobian's transpose
    e = np.zeros(xs, np.float32)
    e.flat[min(7, e.size - 1)] = 1
    inputs = [e, None, scales] if use_scales else [e, None, None, sizes]
    (col,) = ort_oracle.run_node("Resize", inputs, domain="", opset=13, **attrs)
    np.testing.assert_allclose(float(dx.reshape(-1)[min(7, e.size - 1)]), float(np.sum(dy * col)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [1, 1]},  # overlapping windows: indices repeat
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1},  # applied row-major, as ORT does
], ids=str)
def test_max_pool_grad_matches_onnxruntime(rng, attrs):
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    y, idx = ort_oracle.run_node("MaxPool", [x], out_dtypes=[np.float32, np.int64], domain="",
                                 **attrs)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    (expected,) = ort_oracle.run_node("MaxPoolGrad", [dy, idx], domain="", out_shapes=[x.shape],
                                      **attrs)
    got = ops.max_pool_grad(jnp.asarray(dy), jnp.asarray(idx), x_shape=x.shape, **attrs)
    assert_close(got, expected.astype(np.float64), np.float32, ulps=4)
    if set(attrs) == {"kernel_shape", "strides"}:  # and it is max pooling's gradient
        window = (1, 1, *attrs["kernel_shape"])
        pool = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window,
                                               (1, 1, *attrs["strides"]), "VALID")
        g = jax.vjp(pool, jnp.asarray(x))[1](jnp.asarray(dy))[0]
        assert_close(got, g, np.float32, ulps=4)


@pytest.mark.parametrize("name", ["deeplabv3_ts", "mobilenetv3_dynamo"])
def test_corpus_jitted_forward_matches_onnxruntime(rng, name):
    """program.jit() of a corpus convolution network's forward (its weights constants: the
    CPU's channels-last convolutions, dilated taps over padding dropped, dense 3x3s and the
    7x7 stem by the CPU kernel) gives ORT's InferenceSession outputs on fresh random images."""
    from pathlib import Path

    import onnxruntime

    from jaxops.onnx import load
    path = Path(__file__).parent / "data" / "corpus" / name / "forward.onnx"
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,) = sess.get_inputs()
    x = rng.standard_normal(inp.shape).astype(np.float32)
    (want,) = sess.run(None, {inp.name: x})
    program = load(str(path))
    forward = program.jit()
    if name.startswith("deeplab") and jax.default_backend() == "cpu":
        # of its 13 convolutions none is XLA's on the CPU: the 7x7 stem and nine 3x3s take
        # the CPU kernel (ops.conv_cpu), the 1x1s matmuls, with the weights constant or
        # traced (a graph without ConvGrad: channels last either way)
        for text in (jax.jit(program).lower(program.params, x).as_text(),
                     forward.lower(x).as_text()):
            assert text.count("stablehlo.convolution") == 0
            assert text.count("custom_call @jaxops_conv_nhwc") == 10
    got = np.asarray(forward(x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
