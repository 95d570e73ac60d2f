"""The CPU kernel of channels-last max pools (ffi/include/jaxops/pool.h): x [N, H, W, C] f32 ->
[N, OH, OW, C], one FFI call.

The importer's MaxPool without Indices takes it on the CPU where the graph has no ConvGrad (an
inference forward, whose convolutions run channels last): XLA:CPU ran such a pool as one loop
fusion of a strided slice a tap at ~0.8 ns an output element; the kernel reads each tap as a
run of C floats (16 at a time on AVX-512). Not a public op: its derivatives are the reference's
(the handler gives it those of the slices it replaces), and it lowers as the reference off the
CPU.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src import geometry, taps
from jaxops._src.op import Factors, Op

# The kernel's code (pool.h's Isa): a name or 0 -> the attribute's value.
ISAS = {0: 0, "best": 0, "generic": 1, "avx2": 2, "avx512": 3}
MAX_TAPS = 64  # pool.h's kMaxTaps


def _shape(x, *, kernel, strides, dilations, padding, isa=0):
    if x.dtype != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"x [N, H, W, C] must have rank 4, got shape {x.shape}")
    if len(kernel) != 2 or min(kernel) < 1 or kernel[0] * kernel[1] > MAX_TAPS:
        raise ValueError(f"the window {kernel} must be 2-D with 1 to {MAX_TAPS} taps")
    if min(*strides, *dilations) < 1 or min(p for pair in padding for p in pair) < 0:
        raise ValueError(f"strides {strides} and dilations {dilations} must be >= 1 and "
                         f"padding {padding} >= 0")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")
    out = geometry.conv_out_sizes(x.shape[1:3], kernel, strides, dilations, padding)
    if min(out) < 1:
        raise ValueError(f"the window ({kernel}, dilations {dilations}) is larger than the "
                         f"padded input ({x.shape[1:3]}, padding {padding})")
    return jax.ShapeDtypeStruct((x.shape[0], *out, x.shape[3]), jnp.float32)


def _reference(x, *, kernel, strides, dilations, padding, isa=0):
    # the max over one strided slice of x padded with -inf a tap (lax.reduce_window's max has
    # no derivative with dilations)
    out = geometry.conv_out_sizes(x.shape[1:3], kernel, strides, dilations, padding)
    return functools.reduce(jnp.maximum, taps.tap_slices(
        x, -jnp.inf, kernel, strides, dilations, out, [lo for lo, _ in padding], 1))


def _batch(op, args, dims, **params):
    (x,), (dx,) = args, dims
    x = jnp.moveaxis(x, dx, 0)  # the batch joins the images
    y = op.bind(x.reshape(-1, *x.shape[2:]), **params)
    return y.reshape(*x.shape[:2], *y.shape[1:]), 0


def _ffi_attrs(x, *, kernel, strides, dilations, padding, isa=0):
    (kh, kw), (sh, sw), (dh, dw), ((ph, _), (pw, _)) = kernel, strides, dilations, padding
    return {name: np.int64(v) for name, v in zip(
        ("kh", "kw", "sh", "sw", "dh", "dw", "ph", "pw", "isa"),
        (kh, kw, sh, sw, dh, dw, ph, pw, ISAS[isa]))}


def _factors(x, **params):
    # images and channels shard; the window's rows and columns stay whole
    return Factors((("n", "h", "w", "c"),), (("n", "oh", "ow", "c"),), ("h", "w", "oh", "ow"))


max_pool_nhwc_op = Op("max_pool_nhwc", shape=_shape, reference=_reference, batch=_batch,
                      target="jaxops_max_pool_nhwc", ffi_attrs=_ffi_attrs, factors=_factors,
                      xla_when=lambda platform, *args, **params: platform != "cpu")


def max_pool_nhwc(x, kernel, strides, dilations, padding, isa=0):
    """y [N, OH, OW, C]: the max of each window's taps that lie inside x [N, H, W, C] (f32;
    padding ((lo, hi), (lo, hi)), every pad >= 0; a window with no tap inside: -inf; NaN
    propagates). `isa` picks the kernel's code (ISAS; one the CPU lacks: the best below it):
    the tests run every path."""
    return max_pool_nhwc_op(x, kernel=tuple(kernel), strides=tuple(strides),
                            dilations=tuple(dilations), padding=tuple(map(tuple, padding)),
                            isa=isa)


def applies(x, kernel, strides, dilations, padding) -> bool:
    """Whether MaxPool's CPU path takes the kernel for x [N, C, H, W]: 2-D windows of at most
    MAX_TAPS taps, floats (computed in f32: exact), pads >= 0."""
    return (x.ndim == 4 and x.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
            and len(kernel) == 2 and int(np.prod(kernel)) <= MAX_TAPS
            and min(p for pair in padding for p in pair) >= 0)


def max_pool_nchw(x, kernel, strides, dilations, padding):
    """The kernel in ONNX's layout: x [N, C, H, W] -> [N, C, OH, OW] in x's dtype."""
    y = max_pool_nhwc(jnp.transpose(x.astype(jnp.float32), (0, 2, 3, 1)), kernel, strides,
                      dilations, padding)
    return jnp.transpose(y, (0, 3, 1, 2)).astype(x.dtype)


__all__: list[str] = []  # the MaxPool handler's, not a jaxops.ops function
