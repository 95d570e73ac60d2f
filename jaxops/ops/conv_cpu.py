"""The CPU kernel of small inference convolutions (ffi/include/jaxops/conv.h): x [N, H, W, C] by w
[KH, KW, C / groups, O], f32, one FFI call.

conv_general takes it for the channels-last convolutions of an inference forward on the CPU (the
importer's Conv where no ConvGrad follows: `program.jit()`, the ORT-API Module's eval): XLA:CPU
ran them in several thunks each (pad, slices, concatenate, dot, transposes) or through its
generic convolution, at well below the core's FMA peak; the kernel multiplies a few output
pixels' patch rows (contiguous runs in NHWC, read in place or packed) by 16-channel weight
panels in registers (6 pixels x 16 channels on AVX2, 12 x 32 on AVX-512, picked at run time), skipping
the taps that read only pads where that saves work (a dilated 3x3 on a small map). Not a public
op: its own derivatives are the reference's (XLA's convolution; conv_general gives it those of
the form it replaces), and it lowers as XLA's convolution off the CPU.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import geometry
from jaxops._src.op import Factors, Op, batch_at_front
from jaxops.cpu import kernel_threads, xla_threads

_DIMS = ("NHWC", "HWIO", "NHWC")
# The kernel's tile code (conv.h's Isa): a name or 0 -> the attribute's value.
ISAS = {0: 0, "best": 0, "generic": 1, "avx2": 2, "avx512": 3}


PANEL = 16  # output channels a weight panel (conv.h's kCols)


def pack_weights(w, groups=1):
    """w [KH, KW, C / groups, O] as the kernel's weight panels, [groups, panels, KH,
    KW * C / groups, 16] (each group's O / groups outputs in panels of 16, the last one
    zero-filled): what conv.h packs every call, done once where w is a constant (XLA folds
    it)."""
    kh, kw, cg, o = w.shape
    og = o // groups
    panels = -(-og // PANEL)
    w = w.reshape(kh, kw * cg, groups, og)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, 0), (0, panels * PANEL - og)))
    return jnp.transpose(w.reshape(kh, kw * cg, groups, panels, PANEL), (2, 3, 0, 1, 4))


def unpack_weights(panels, cg, o):
    """pack_weights' inverse: [KH, KW, cg, o]."""
    groups, count, kh, kwc, _ = panels.shape
    w = jnp.transpose(panels, (2, 3, 0, 1, 4)).reshape(kh, kwc, groups, count * PANEL)
    return w[..., :o // groups].reshape(kh, kwc // cg, cg, o)


def _kernel_shape(x, w, scale, groups):
    """(KH, KW, O) of w, as given or packed (rank 5, O from scale), checked against x."""
    if x.ndim != 4 or w.ndim not in (4, 5):
        raise ValueError(f"x [N, H, W, C] must have rank 4 and w [KH, KW, C, O] rank 4 (or 5: "
                         f"packed), got shapes {x.shape} and {w.shape}")
    if not isinstance(groups, int) or groups < 1 or x.shape[3] % groups:
        raise ValueError(f"groups {groups} must divide x's input channels {x.shape[3]}")
    cg = x.shape[3] // groups
    if w.ndim == 4:
        if w.shape[2] * groups != x.shape[3] or w.shape[3] % groups:
            raise ValueError(f"w's input channels {w.shape[2]} x groups {groups} must be x's "
                             f"{x.shape[3]}, and groups must divide its outputs {w.shape[3]}")
        return w.shape[0], w.shape[1], w.shape[3]
    o = scale.shape[0] if scale.ndim == 1 else -1
    if (o < 0 or o % groups or w.shape[0] != groups or w.shape[3] % cg or w.shape[4] != PANEL
            or w.shape[1] != -(-(o // groups) // PANEL)):
        raise ValueError(f"packed w {w.shape} must be pack_weights' panels of [KH, KW, {cg}, O] "
                         f"for {groups} groups, O = scale's {scale.shape}")
    return w.shape[2], w.shape[3] // cg, o


def _shape(x, w, scale, shift, *, strides, dilations, padding, groups=1, affine=0,
           lo=-np.inf, hi=np.inf, isa=0, threads=1):
    if any(a.dtype != jnp.float32 for a in (x, w, scale, shift)):
        raise TypeError(f"x, w, scale and shift must be float32, got {x.dtype}, {w.dtype}, "
                        f"{scale.dtype} and {shift.dtype}")
    kh, kw, o = _kernel_shape(x, w, scale, groups)
    if scale.shape != (o,) or shift.shape != (o,):
        raise ValueError(f"scale and shift must be [O] = [{o}], got {scale.shape} "
                         f"and {shift.shape}")
    if not lo <= hi:  # (NaN included)
        raise ValueError(f"the clamp needs lo <= hi, got {lo} and {hi}")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if min(*strides, *dilations) < 1 or min(p for pair in padding for p in pair) < 0:
        raise ValueError(f"strides {strides} and dilations {dilations} must be >= 1 and "
                         f"padding {padding} >= 0")
    out = geometry.conv_out_sizes(x.shape[1:3], (kh, kw), strides, dilations, padding)
    if min(out) < 1:
        raise ValueError(f"the window ({(kh, kw)}, dilations {dilations}) is larger than "
                         f"the padded input ({x.shape[1:3]}, padding {padding})")
    return jax.ShapeDtypeStruct((x.shape[0], *out, o), jnp.float32)


def _clamp(y, lo, hi):
    """y clamped to [lo, hi] as the kernel's epilogue does it: NaN stays NaN."""
    if lo != -np.inf:
        y = jnp.where(y < lo, jnp.asarray(lo, y.dtype), y)
    if hi != np.inf:
        y = jnp.where(y > hi, jnp.asarray(hi, y.dtype), y)
    return y


def _reference(x, w, scale, shift, *, strides, dilations, padding, groups=1, affine=0,
               lo=-np.inf, hi=np.inf, isa=0, threads=1):
    if w.ndim == 5:
        w = unpack_weights(w, x.shape[3] // groups, scale.shape[0])
    y = lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilations,
                                 dimension_numbers=_DIMS, feature_group_count=groups,
                                 precision=lax.Precision.HIGHEST)
    if affine == 1:
        y = y * scale + shift
    elif affine == 2:
        y = y + shift
    return _clamp(y, lo, hi)


def _batch(op, args, dims, **params):
    x, dx = args[0], dims[0]
    if all(d is None for d in dims[1:]):  # the batch joins the images
        x = jnp.moveaxis(x, dx, 0)
        y = op.bind(x.reshape(-1, *x.shape[2:]), *args[1:], **params)
        return y.reshape(*x.shape[:2], *y.shape[1:]), 0
    return lax.map(lambda ops: op.bind(*ops, **params), tuple(batch_at_front(args, dims))), 0


def _ffi_attrs(x, w, scale, shift, *, strides, dilations, padding, groups=1, affine=0,
               lo=-np.inf, hi=np.inf, isa=0, threads=1):
    (sh, sw), (dh, dw), ((ph, _), (pw, _)) = strides, dilations, padding
    ints = {name: np.int64(v) for name, v in zip(
        ("sh", "sw", "dh", "dw", "ph", "pw", "groups", "affine", "isa", "threads"),
        (sh, sw, dh, dw, ph, pw, groups, int(affine), ISAS[isa], threads))}
    return {**ints, "lo": np.float32(lo), "hi": np.float32(hi)}


def _factors(x, w, scale, shift, *, groups=1, **params):
    # images and output channels shard; the window and the summed channels stay whole, and
    # so do grouped outputs (a shard of them would not hold whole groups' worth)
    # (the replicated factors in the order they first appear: Shardy wants them sorted);
    # packed weights: only the images shard (a panel mixes output channels)
    if w.ndim == 5:
        return Factors((("n", "h", "w", "c"), ("g", "p", "kh", "kwc", "l"), ("o",), ("o",)),
                       (("n", "oh", "ow", "o"),),
                       ("h", "w", "c", "g", "p", "kh", "kwc", "l", "o", "oh", "ow"))
    if groups == 1:
        return Factors((("n", "h", "w", "c"), ("kh", "kw", "c", "o"), ("o",), ("o",)),
                       (("n", "oh", "ow", "o"),), ("h", "w", "c", "kh", "kw", "oh", "ow"))
    return Factors((("n", "h", "w", "c"), ("kh", "kw", "cg", "o"), ("o",), ("o",)),
                   (("n", "oh", "ow", "o"),), ("h", "w", "c", "kh", "kw", "cg", "o", "oh", "ow"))


conv_nhwc_op = Op("conv_nhwc", shape=_shape, reference=_reference, batch=_batch,
                  target="jaxops_conv_nhwc", ffi_attrs=_ffi_attrs, factors=_factors,
                  xla_when=lambda platform, *args, **params: platform != "cpu")


def conv_nhwc(x, w, strides, dilations, padding, groups=1, scale=None, shift=None,
              lo=-np.inf, hi=np.inf, isa=0, out_channels=None, threads=1):
    """y [N, OH, OW, O] = clamp(x [N, H, W, C] (*) w [KH, KW, C / groups, O] * scale + shift,
    lo, hi), f32 (w may come as pack_weights(w, groups), rank 5, with O as out_channels),
    padding ((lo, hi), (lo, hi)) with every pad >= 0 (output channel j reads the input
    channels of group j // (O / groups); scale and shift [O]: a folded BatchNormalization,
    shift alone: a bias, neither: none; lo, hi: a Relu's or Clip's bounds). `isa` picks the
    kernel's tile code (ISAS; 0: the best the CPU has, a higher one than it has falls back to
    the best below): the tests run every path."""
    if scale is not None and shift is None:
        raise ValueError("jaxops.ops.conv_nhwc: scale comes with a shift")
    affine = 0 if shift is None else 1 if scale is not None else 2
    o = jnp.shape(w)[-1] if jnp.ndim(w) else 0
    if jnp.ndim(w) == 5:
        if not isinstance(out_channels, int) or out_channels < 0:
            raise ValueError(f"jaxops.ops.conv_nhwc: packed weights need out_channels, got "
                             f"{out_channels!r}")
        o = out_channels
    elif out_channels is not None and out_channels != o:
        raise ValueError(f"jaxops.ops.conv_nhwc: out_channels {out_channels!r} is not w's {o}")
    if not affine:  # (not read: the kernel skips the affine step)
        scale, shift = jnp.ones((o,), jnp.float32), jnp.zeros((o,), jnp.float32)
    elif affine == 2:  # (the scale operand is not read: shift's own buffer, no new constant)
        scale = shift
    return conv_nhwc_op(x, w, scale, shift, strides=tuple(strides), dilations=tuple(dilations),
                        padding=tuple(map(tuple, padding)), groups=int(groups), affine=affine,
                        lo=float(lo), hi=float(hi), isa=isa, threads=threads)


# The convolutions (FLOPs) above which the kernel runs on as many threads as XLA:CPU has
# (the calling thread and the process's helper threads, a thread for each 2 MFLOP: conv.h),
# wherever it runs; below it, on one where the program runs on XLA's own pool
# (kernel_threads()). ResNet's eval (a 3-channel 7x7
# stem of 154 MFLOP and a 38 MFLOP 3x3 on 128x128 images) 1.83-1.95 -> 1.60-1.66 ms at 2
# threads, 2.28 -> 1.94 ms on one core (-ts and -dynamo, in-process A/B, 2026-12-04), where
# XLA's own convolution took them.
MAX_FLOPS = 1 << 24


def large(x_shape, w_shape, strides, dilations, padding, group) -> bool:
    """Whether a 2-D convolution of x [N, C, H, W] by w [O, C / group, KH, KW] takes more
    than MAX_FLOPS."""
    out = [(size + lo + hi - (k - 1) * d - 1) // s + 1 for size, k, s, d, (lo, hi)
           in zip(x_shape[2:], w_shape[2:], strides, dilations, padding)]
    flops = 2 * x_shape[0] * math.prod(out) * w_shape[0] * (x_shape[1] // group) \
        * math.prod(w_shape[2:])
    return flops > MAX_FLOPS


def applies(x, w_shape, strides, dilations, group, padding, lhs_dilation) -> bool:
    """Whether conv_general's channels-last CPU path takes the kernel for x [N, C, H, W] and
    w [O, C / group, KH, KW] (ONNX layouts): 2-D, f32 or narrower floats (computed in f32),
    pads >= 0, no input dilation, group 1 or groups of >= 4 output channels, patch rows of
    > 16 values; not where a matmul of x as it lies does better (1x1, non-overlapping
    windows).
    DeepLabV3's forward (a 3-channel 7x7 stem and 3x3s on 4x4 and 8x8 maps) ran 0.81-0.87x the
    time with it, one core (2026-11-25, interleaved A/B); with the 1x1s too, MobileNetV3's ran
    ~1.13x. Grouped ones (windowed_conv's im2col per group before): RegNetX-002's 0.33-0.56x
    the time, ResNeXt-like 4-channel groups 0.22-0.60x, the corpus's RegNet 0.69-0.78x; a
    3-channel 3x3 stem 0.82-0.84x, a 1-channel 5x5 0.89x, but a 1-channel 3x3 1.28x the time
    of its gather and matmul (one core, 2026-11-28)."""
    kernel = tuple(w_shape[2:])
    return ((group == 1 or w_shape[0] // group >= 4) and x.ndim == 4 and len(w_shape) == 4
            and x.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
            and kernel != (1, 1) and x.shape[1] // group * math.prod(kernel) > 16
            and not (tuple(strides) == kernel and all(d == 1 for d in dilations)
                     and all(p == (0, 0) for p in padding))
            and min(p for pair in padding for p in pair) >= 0
            and (lhs_dilation is None or all(d == 1 for d in lhs_dilation)))


def conv_nchw(x, w, strides, dilations, padding, groups=1, scale=None, shift=None,
              lo=-np.inf, hi=np.inf, constant_w=False):
    """The kernel in ONNX layouts: x [N, C, H, W], w [O, C / groups, KH, KW] -> [N, O, OH, OW]
    in x's dtype (f16/bf16 computed in f32, rounded once); the epilogue as conv_nhwc's.
    constant_w: w is a constant of the program (program.jit()'s closed-over params), so its
    panels are packed here, where XLA folds them, not by the kernel each call (DeepLabV3's
    forward: its 13 kernel convolutions pack 112K weights a call). As many threads as
    jaxops.cpu.kernel_threads() allows (ORT's session at its defaults runs its convolutions on
    every core), and for one above MAX_FLOPS as many as XLA:CPU has (xla_threads())."""
    dtype = x.dtype
    o = w.shape[0]
    threads = kernel_threads()
    if large(x.shape, w.shape, strides, dilations, padding, groups):
        threads = max(threads, xla_threads())
    xt = jnp.transpose(x.astype(jnp.float32), (0, 2, 3, 1))
    wt = jnp.transpose(w.astype(jnp.float32), (2, 3, 1, 0))
    if constant_w:
        wt = pack_weights(wt, groups)
    f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)
    y = conv_nhwc(xt, wt, strides, dilations, padding, groups, f32(scale), f32(shift), lo, hi,
                  out_channels=o if constant_w else None, threads=threads)
    return jnp.transpose(y, (0, 3, 1, 2)).astype(dtype)


__all__: list[str] = []  # conv_general's, not jaxops.ops functions
