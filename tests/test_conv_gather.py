"""The channels-last convolution's gathered patch matrix (ops.conv._gathered_patches): an
image stem's (few input channels, K > 1 taps) im2col by one gather on the CPU inference path
(windowed_conv's channels_last form). Same values as XLA's
convolution, gradients of any order through the slices' transposes (no scatter), and only
where it is chosen."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from jaxops.ops import conv
from jaxops.ops.conv import windowed_conv

# (x shape, w shape, strides, padding, dilations): each takes the gather
STEMS = [
    ((2, 3, 9, 8), (5, 3, 3, 3), (2, 2), [(1, 1), (1, 0)], (1, 1)),    # MobileNetV3-like stem
    ((2, 2, 7), (4, 2, 3), (1,), [(2, 1)], (2,)),                       # 1-D, dilated
    ((1, 1, 5, 4, 6), (3, 1, 2, 3, 2), (2, 1, 1), [(1, 0), (0, 1), (1, 1)], (1, 2, 1)),
    ((3, 3, 6, 5), (4, 3, 2, 2), (1, 2), [(0, 2), (3, 1)], (2, 1)),     # pad past a tap's reach
]
IDS = ["2d-stem", "1d-dilated", "3d", "wide-pad"]


def xla_conv(x, w, strides, padding, dilations):
    sp = "DHW"[-(x.ndim - 2):]
    return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilations,
                                    dimension_numbers=("NC" + sp, "OI" + sp, "NC" + sp),
                                    precision=lax.Precision.HIGHEST)


def stem(case):
    return lambda x, w: windowed_conv(x, w, *case[2:], 1, channels_last=True)


def inputs(case, dtype=jnp.float64, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(case[0]), dtype),
            jnp.asarray(rng.standard_normal(case[1]), dtype))


@pytest.mark.parametrize("case", STEMS, ids=IDS)
def test_values_match_xla_and_take_the_gather(case):
    x, w = inputs(case)
    jaxpr = str(jax.make_jaxpr(stem(case))(x, w))
    assert "gather" in jaxpr and "concatenate" not in jaxpr
    np.testing.assert_allclose(jax.jit(stem(case))(x, w), xla_conv(x, w, *case[2:]),
                               rtol=1e-13, atol=1e-13)
    x32, w32 = inputs(case, jnp.float32)
    got = stem(case)(x32, w32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, xla_conv(x32, w32, *case[2:]), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", STEMS[:3], ids=IDS[:3])
def test_gradients_any_order_without_scatter(case):
    x, w = inputs(case)
    f = stem(case)
    check_grads(f, (x, w), order=2, modes=("fwd", "rev"))
    grad = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(x, w)
    assert "scatter" not in str(grad)  # dX is the slices' transpose (pads and adds)
    dx, dw = jax.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: (xla_conv(x, w, *case[2:]) ** 2).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, want[1], rtol=1e-12, atol=1e-12)


def test_vmap_and_reduced_precision():
    case = STEMS[0]
    f = stem(case)
    (x0, w0), (x1, _) = inputs(case), inputs(case, seed=1)
    got = jax.jit(jax.vmap(f, (0, None)))(jnp.stack([x0, x1]), w0)
    for k, x in enumerate((x0, x1)):
        np.testing.assert_allclose(got[k], xla_conv(x, w0, *case[2:]), rtol=1e-13, atol=1e-13)
    for dtype in (jnp.float16, jnp.bfloat16):
        x, w = inputs(case, dtype)
        out = f(x, w)
        want = xla_conv(x.astype(jnp.float32), w.astype(jnp.float32), *case[2:]).astype(dtype)
        assert out.dtype == dtype  # accumulated in f32, rounded once
        np.testing.assert_allclose(np.float32(out), np.float32(want),
                                   rtol=float(jnp.finfo(dtype).eps))


@pytest.mark.parametrize("x_shape,w_shape,lhs_dilation,taken", [
    ((2, 3, 32, 32), (16, 3, 3, 3), None, True),      # the corpus's stems
    ((8, 3, 224, 224), (16, 3, 3, 3), None, True),    # any size
    ((2, 16, 8, 8), (16, 16, 1, 1), None, False),     # 1x1: the input as it lies
    ((2, 4, 8, 8), (8, 4, 3, 3), None, False),        # C * K = 36 > 32
    ((2, 3, 8, 8), (4, 3, 3, 3), (2, 2), False),      # lhs-dilated
    ((1 << 16, 3, 128, 128), (4, 3, 3, 3), None, False),  # beyond int32 indices
])
def test_chosen_for_stems_only(x_shape, w_shape, lhs_dilation, taken):
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    n = len(x_shape) - 2
    assert conv._gather_patches(x, w_shape[2:], lhs_dilation or (1,) * n) is taken


def test_grouped_keeps_the_slices():
    case = ((2, 4, 6, 6), (4, 2, 3, 3), (2, 2), [(1, 1), (1, 1)], (1, 1))  # C * K = 36
    x, w = inputs(case)
    f = lambda x, w: windowed_conv(x, w, *case[2:], 2, channels_last=True)
    assert "gather" not in str(jax.make_jaxpr(f)(x, w))
    small = ((2, 2, 6, 6), (4, 1, 3, 3), (1, 1), [(1, 1), (1, 1)], (1, 1))  # depthwise
    xs, ws = inputs(small)
    g = lambda x, w: windowed_conv(x, w, *small[2:], 2, channels_last=True)
    assert "gather" not in str(jax.make_jaxpr(g)(xs, ws))
