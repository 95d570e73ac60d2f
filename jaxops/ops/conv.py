"""Convolution gradients (com.microsoft ConvGrad, ConvTransposeGrad) as XLA code (on the CPU,
depthwise ones through a C++ kernel), and conv_general, the convolution the importer's Conv
uses too.

ConvGrad(dY, X, W) and ConvTransposeGrad(dY, X, W) carry the forward op's attributes
(auto_pad, dilations, group, kernel_shape, pads, strides; ConvTranspose adds output_padding
and output_shape), for 1-D, 2-D and 3-D convolutions (NC... layout, W as ONNX lays it out).
Their three outputs (dX, dW, dB) are all optional in ORT: the keyword `outputs` (one bool
per output, ORT order, default all True) says which are wanted; an unwanted output is
returned as None and never computed. dX and dW are the transposes of the forward
convolution (`jax.linear_transpose`): on a GPU XLA's own convolution-backward convolutions;
lowered for the CPU, where XLA's grouped convolutions are slow, grouped convolutions are
transposes of windowed_conv (slices and matmuls) instead, and so are the dense ones that
windowed_conv runs faster there (conv_general's dense: 1x1, image stems, patchify); a
grouped one's dX there and a depthwise one's dW are written out (grouped_conv_dx,
depthwise_conv_dw), faster than jax's transposes, and so is a dense one's dW with >= 16
input channels (dense_conv_dw: XLA:CPU's filter-gradient convolution is its slowest) or a
strided one's with fewer (phase_conv's transpose). dB = sum of dY over batch and spatial
dims. On the CPU, stride-1 2-D depthwise convolutions with traced weights (a training step's)
and their dX and dW are a C++ kernel instead (depthwise_cpu). f16/bf16 convolve with f32
accumulation and are rounded once.

Being XLA code, both ops support jit, vmap, gradients of any order and sharding (a
batch-sharded dY/X gives dW and dB by an all-reduce, never an all-gather) with no extra rules,
except that XLA's SPMD partitioner all-gathers a batch-sharded operand of a grouped
convolution on a GPU (group > 1; jax 0.12, as for a plain lax.conv_general_dilated forward).
"""
import dataclasses
import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxops._src import geometry, rules
from jaxops._src.derivatives import with_derivatives_of
from jaxops._src.compat import mark_varying, varying_axes
from jaxops._src.spec import Matrix, define
from jaxops.ops import conv_cpu, depthwise_cpu

_AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")


def _ints(label, value, n, default):
    if value is None:
        return (default,) * n
    try:
        out = tuple(rules.integer(label, i) for i in value)
    except TypeError:
        raise TypeError(f"{label} must be a sequence of ints, got {value!r}") from None
    if len(out) != n:
        raise ValueError(f"{label} must have {n} entries, got {len(out)}")
    return out


def _auto_pad(auto_pad):
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in _AUTO_PADS:
        raise ValueError(f"auto_pad must be one of {_AUTO_PADS}, got {auto_pad!r}")
    return auto_pad


class _Attrs:
    """The Conv/ConvTranspose attributes, checked against X and W (plain TypeError/ValueError:
    the op's public function names the op)."""

    def __init__(self, X, W, *, auto_pad, dilations, group, kernel_shape, pads, strides,
                 transpose):
        if X.ndim not in (3, 4, 5):
            raise ValueError(f"X must be N, C and 1 to 3 spatial dims, got shape {X.shape}")
        if W.ndim != X.ndim:
            raise ValueError(f"W must have X's rank {X.ndim}, got shape {W.shape}")
        n = X.ndim - 2
        self.n = n
        self.auto_pad = _auto_pad(auto_pad)
        self.group = rules.integer("group", group)
        self.dilations = _ints("dilations", dilations, n, 1)
        self.strides = _ints("strides", strides, n, 1)
        self.pads = _ints("pads", pads, 2 * n, 0)
        self.kernel = tuple(W.shape[2:])
        if kernel_shape is not None and _ints("kernel_shape", kernel_shape, n, 0) != self.kernel:
            raise ValueError(f"kernel_shape {tuple(kernel_shape)} differs from W's spatial "
                             f"shape {self.kernel}")
        if self.group < 1 or min(self.strides + self.dilations) < 1 or min(self.pads) < 0:
            raise ValueError("group, strides and dilations must be >= 1 and pads >= 0")
        c_in = X.shape[1]
        w_in = W.shape[0] if transpose else W.shape[1] * self.group
        if c_in != w_in or c_in % self.group or W.shape[0] % self.group:
            raise ValueError(f"channels do not match: X {X.shape}, W {W.shape}, "
                             f"group {self.group}")
        self.effective = tuple(geometry.windows(self.kernel, self.dilations))

    def conv_padding(self, spatial):
        """(begin, end) padding of each spatial dim of a Conv over `spatial`."""
        return geometry.padding(self.auto_pad, spatial, self.kernel, self.strides,
                                self.dilations, self.pads)


def _dimension_numbers(n):
    sp = "DHW"[-n:]
    return "NC" + sp, "OI" + sp, "NC" + sp


def windowed_conv(x, w, strides, padding, dilations, group, lhs_dilation=None, precision=None,
                  channels_last=False):
    """lax.conv_general_dilated of x [N, C, ...] and w [O, C / group, k...] (ONNX layouts) as a
    sum over the kernel window of strided slices of the padded (lhs-dilated) input: a
    depthwise convolution (C / group == 1) as elementwise multiply-adds, any other as one
    batched matmul (batch: the groups) over the stacked slices (im2col). The same sums in
    another order (f16/bf16 in f32, rounded once); jax derives the gradients from it (pads,
    slices and matmuls, no convolution).

    XLA:CPU runs a grouped convolution, and far worse its transposes, through a slow generic
    loop; this runs 1.5-200x faster there (conv_general chooses it on the CPU only).

    channels_last=True: the same sums over x transposed to [N, ..., C] (_channels_last), for
    an inference forward whose weights are constants (see conv_general)."""
    if channels_last:
        return _channels_last(x, w, strides, padding, dilations, group, lhs_dilation, precision)
    n, dtype = x.ndim - 2, x.dtype
    acc = rules.compute_dtype(dtype)
    x, w = x.astype(acc), w.astype(acc)
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    xp = lax.pad(x, jnp.zeros((), acc),
                 [(0, 0, 0)] * 2 + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)])
    kernel = w.shape[2:]
    out = geometry.out_sizes(xp.shape[2:], kernel, strides, dilations)
    n_batch, c_out = x.shape[0], w.shape[0]
    c_group, o_group = x.shape[1] // group, c_out // group
    taps = math.prod(kernel)
    w = w.reshape(c_out, c_group, taps)
    if c_group > 1 and _patchify(kernel, strides, padding, dilations) and lhs_dilation == (1,) * n:
        # [N, C * K, pixels] as stacking the windows would give it, by one transpose (a 1x1:
        # x as it lies)
        patches = x if taps == 1 else jnp.moveaxis(_blocks(x, kernel, out), range(2, 2 + n),
                                                   range(2 + n, 2 + 2 * n))
        patches = patches.reshape(n_batch, x.shape[1] * taps, -1)
        return _matmul(patches, w, group, out, precision).astype(dtype)
    windows = _tap_windows(xp, kernel, out, strides, dilations)
    if c_group == 1:  # depthwise (o_group: the channel multiplier)
        terms = (jnp.repeat(win, o_group, axis=1) * w[:, 0, k].reshape((c_out,) + (1,) * n)
                 for k, win in enumerate(windows))
        # materialized once: XLA:CPU otherwise fuses the k-term sum into each consumer and
        # computes it again in every one (a LayerNorm after it: 3 times; ConvNeXt's 7x7
        # forward 1.6x ORT's time before, 0.85x after, on one core)
        y = _materialized(functools.reduce(jnp.add, terms))
    else:
        patches = jnp.stack(windows, axis=2).reshape(n_batch, x.shape[1] * taps, -1)
        y = _matmul(patches, w, group, out, precision)
    return y.astype(dtype)


def _matmul(patches, w, group, out, precision):
    """patches [N, C * K, pixels] (channel-major) by w [O, C / group, K]: y [N, O, *out]."""
    n_batch, c_out = patches.shape[0], w.shape[0]
    if group == 1:
        # the weight as it lies ([O, C * K]) against [N, C * K, pixels]: XLA:CPU then reads
        # the weight without a transpose (the batched form below transposed it every call)
        return jnp.einsum("ok,nkp->nop", w.reshape(c_out, -1), patches,
                          precision=precision).reshape(n_batch, c_out, *out)
    # [N, G, C/G * K, pixels] . [G, O/G, C/G * K] -> [G, N, pixels, O/G]
    patches = patches.reshape(n_batch, group, -1, patches.shape[-1])
    y = lax.dot_general(patches, w.reshape(group, c_out // group, -1),
                        (((2,), (2,)), ((1,), (0,))), precision=precision)
    return jnp.transpose(y, (1, 0, 3, 2)).reshape(n_batch, c_out, *out)


def _blocks(x, kernel, out):
    """x [N, C, *spatial] cut into non-overlapping kernel-sized blocks (a patchify
    convolution's patches, the rest of x beyond the last whole block dropped): [N, C, *out,
    *kernel]. A reshape and one transpose, where the taps' strided slices were K thunks on
    XLA:CPU (ViT's 8x8 patches: 64 slices of [2, 3, 4, 4] and a concatenation, ~25 us of its
    60 us eval, run as independent thunks that the executor handed to its pool thread)."""
    n = len(kernel)
    x = x[(slice(None),) * 2 + tuple(slice(0, o * k) for o, k in zip(out, kernel))]
    x = x.reshape(*x.shape[:2], *itertools.chain.from_iterable(zip(out, kernel)))
    return jnp.transpose(x, (0, 1, *range(2, 2 + 2 * n, 2), *range(3, 3 + 2 * n, 2)))


def _channels_last(x, w, strides, padding, dilations, group, lhs_dilation, precision):
    """windowed_conv over x laid out [N, ..., C] (transposed in, the result transposed back).

    XLA:CPU keeps its convolutions' and matmuls' activations channels last; the NCHW slices
    made it transpose every activation between them, in fusions that also computed the
    elementwise ops before the convolution (EfficientNet's BatchNorm + SiLU + pad before a
    depthwise convolution). Channels last, those transposes cancel out, a tap's slice is
    whole rows of channels and a depthwise tap multiplies them by one weight vector:
    EfficientNet's jitted forward 0.36 -> 0.21 ms, MobileNetV3's 0.87x, RegNet's 0.92x (one
    core, 2026-11-24). The weight is transposed instead: free where it is a constant (folded
    when compiling); where it is traced a training step ran 1.01-1.11x slower (its gradient
    ops read the activations as NCHW), so only constant weights take this form.

    One with few input channels (an image stem) takes its patch matrix by one gather
    (_gathered_patches) where that is small."""
    n, dtype = x.ndim - 2, x.dtype
    acc = rules.compute_dtype(dtype)
    x, w = x.astype(acc), w.astype(acc)
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    kernel = w.shape[2:]
    out = geometry.conv_out_sizes(x.shape[2:], kernel, strides, dilations, padding, lhs_dilation)
    n_batch, c_out = x.shape[0], w.shape[0]
    c_group, o_group, taps = x.shape[1] // group, c_out // group, math.prod(kernel)
    w = w.reshape(c_out, c_group, taps)
    if group == 1 and _gather_patches(x, kernel, lhs_dilation):
        # [pixels, K * C] . [K * C, O]
        patches = _gathered_patches(x, tuple(kernel), tuple(out), tuple(strides),
                                    tuple(map(tuple, padding)), tuple(dilations))
        y = jnp.dot(patches, jnp.transpose(w, (2, 1, 0)).reshape(taps * c_group, c_out),
                    precision=precision).reshape(n_batch, *out, c_out)
        return jnp.transpose(y, (0, n + 1, *range(1, n + 1))).astype(dtype)
    if c_group == 1:  # depthwise (o_group: the channel multiplier)
        windows = _channels_last_windows(x, kernel, out, strides, padding, dilations,
                                         lhs_dilation)
        # the taps' weight vectors as one array [K, O] behind a barrier: XLA folds the
        # transpose of a constant weight, and the fusion then reads the rows of one buffer,
        # where each slice of the constant was a constant of its own, which XLA:CPU allocates
        # every call (MobileNetV3's forward: 72 -> 32 constants, 0.89-0.92x the time, one
        # core, 2026-12-02)
        wk = _materialized(jnp.transpose(w[:, 0, :]))
        terms = (jnp.repeat(win, o_group, axis=-1) * wk[k] for k, win in enumerate(windows))
        y = _materialized(functools.reduce(jnp.add, terms))  # once: see windowed_conv
        return jnp.transpose(y, (0, n + 1, *range(1, n + 1))).astype(dtype)
    if _patchify(kernel, strides, padding, dilations) and lhs_dilation == (1,) * n:
        # [N, *out, *kernel, C]: the windows' [pixels, K, C] by one transpose (see _blocks); a
        # 1x1's by the transpose to channels last alone, which cancels the one before it (its
        # blocks' unit axes kept XLA from cancelling them: DeepLabV3's 1x1s each copied x twice)
        patches = jnp.moveaxis(x if taps == 1 else _blocks(x, kernel, out), 1, -1)
        patches = patches.reshape(-1, taps, x.shape[1])
    else:
        patches = jnp.stack(_channels_last_windows(x, kernel, out, strides, padding, dilations,
                                                   lhs_dilation), axis=-2)
    if group == 1:  # [pixels, K * C] . [K * C, O]
        patches = patches.reshape(-1, taps * c_group)
        y = jnp.dot(patches, jnp.transpose(w, (2, 1, 0)).reshape(taps * c_group, c_out),
                    precision=precision).reshape(n_batch, *out, c_out)
    else:  # [pixels, K, G, C/G] . [G, K, C/G, O/G] -> [pixels, G, O/G]
        patches = patches.reshape(-1, taps, group, c_group)
        wg = jnp.transpose(w.reshape(group, o_group, c_group, taps), (0, 3, 2, 1))
        y = jnp.einsum("pkgc,gkco->pgo", patches, wg,
                       precision=precision).reshape(n_batch, *out, c_out)
    return jnp.transpose(y, (0, n + 1, *range(1, n + 1))).astype(dtype)


def _channels_last_windows(x, kernel, out, strides, padding, dilations, lhs_dilation=None):
    """Each kernel tap's strided window of x [N, C, ...] transposed to [N, ..., C] and padded
    (lhs-dilated): [N, *out, C] each, taps in row-major order."""
    n = x.ndim - 2
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    xp = lax.pad(jnp.transpose(x, (0, *range(2, n + 2), 1)), jnp.zeros((), x.dtype),
                 [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
                 + [(0, 0, 0)])
    windows = []
    for ks in itertools.product(*map(range, kernel)):
        start = [0] + [k * d for k, d in zip(ks, dilations)] + [0]
        limit = [xp.shape[0], *(b + (o - 1) * s + 1 for b, o, s in zip(start[1:], out, strides)),
                 xp.shape[-1]]
        windows.append(lax.slice(xp, start, limit, (1, *strides, 1)))
    return windows


def _gather_patches(x, kernel, lhs_dilation):
    """Whether a group-1 channels-last convolution takes its patch matrix by one gather: few
    input channels (C * K <= 32, an image stem, whose K > 1 slices copy C values a pixel
    each) and int32 indices. The corpus's 3-channel 3x3 stride-2 stems so: MobileNetV3's,
    RegNet's and EfficientNet's forwards 0.91-1.03x, 0.92-0.99x and 0.98-0.99x the time
    (three runs of 600 interleaved calls, one core, 2026-11-25); such a stem alone 0.87x at
    [2, 3, 32, 32] (with the call's ~22 us), 0.92x at [1, 3, 224, 224], 0.69x at
    [4, 3, 224, 224]. RegNet's grouped 3x3s (8 channels a group) so: its forward 1.23x the
    time (the gather copies element by element, a slice whole rows)."""
    c_k = x.shape[1] * math.prod(kernel)
    return (all(d == 1 for d in lhs_dilation) and math.prod(kernel) > 1 and c_k <= 32
            and x.size < 1 << 31)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gathered_patches(x, kernel, out, strides, padding, dilations):
    """The channels-last patch matrix [N * P, K * C] of x [N, C, ...] (what concatenating
    _channels_last_windows gives) by one gather of x as it lies: the K slices of a few
    channels each and their concatenation cost more on XLA:CPU (MobileNetV3's stem: 9
    slices of 3 values a pixel). The indices are iota arithmetic that XLA fuses into the
    gather (a constant table of them was no faster at the corpus's sizes and 1.1x faster at
    224x224, at 5 MB of constant for a batch of 4). Its tangent is the slices' (so its
    transpose, the gradient, is pads and adds, not a scatter)."""
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    shape = (n, *out, *kernel, c)  # a patch element's image, pixel, tap and channel
    iota = functools.partial(lax.broadcasted_iota, jnp.int32, shape)
    flat = iota(0) * c + iota(len(shape) - 1)
    inside = None
    for i, (size, s, d, (lo, _)) in enumerate(zip(spatial, strides, dilations, padding)):
        pos = iota(1 + i) * s + iota(1 + len(spatial) + i) * d - lo
        ok = (pos >= 0) & (pos < size)
        inside = ok if inside is None else inside & ok
        flat = flat * size + jnp.clip(pos, 0, size - 1)
    # a tap on the padding points past the end, which the gather fills with 0
    flat = jnp.where(inside, flat, x.size).reshape(n * math.prod(out), -1)
    return jnp.take(x.reshape(-1), flat, mode="fill", fill_value=0)


def _sliced_patches(x, kernel, out, strides, padding, dilations):
    windows = _channels_last_windows(x, kernel, out, strides, padding, dilations)
    return jnp.concatenate(windows, axis=-1).reshape(x.shape[0] * math.prod(out), -1)


@_gathered_patches.defjvp
def _gathered_patches_jvp(kernel, out, strides, padding, dilations, primals, tangents):
    geometry = (kernel, out, strides, padding, dilations)
    return (_gathered_patches(primals[0], *geometry),
            _sliced_patches(tangents[0], *geometry))


def grouped_conv_dx(dy, w, x_shape, strides, padding, dilations, group, lhs_dilation=None):
    """The transpose in x of windowed_conv's grouped or depthwise convolution (group > 1) at
    dy [N, O, out...]: dx [N, C, ...x_shape] in dy's dtype.

    jax's own transpose of the strided window slices pads each tap's term back with interior
    padding and XLA:CPU sums the k padded terms inside one loop, computing each term's index
    arithmetic at every pixel (EfficientNet's 5x5 stride-2 depthwise: 130 us). Here the padded
    input is split into its stride phases: a phase is a stride-1 sum over the taps that land
    on it (a 2x2 stride: a quarter of them), and the phases interleave by one reshape."""
    n = dy.ndim - 2
    n_batch, c_out = dy.shape[:2]
    c_in, kernel, out = x_shape[1], w.shape[2:], dy.shape[2:]
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    padded = geometry.padded_sizes(x_shape[2:], padding, lhs_dilation)
    phase = [-(-p // s) for p, s in zip(padded, strides)]  # pixels a phase, per dim
    # each dim's taps by phase: (tap, its shift in dy) = (k, (k * dilation - phase) / stride)
    taps = [[[(k, (k * d - r) // s) for k in range(ks) if (k * d - r) % s == 0]
             for r in range(s)] for ks, d, s in zip(kernel, dilations, strides)]
    flat = [math.prod(kernel[i + 1:]) for i in range(n)]
    if w.shape[1] == 1:  # depthwise: each tap's term is dy (padded once, sliced) times w_k
        low = [max((t for ph in dim for _, t in ph), default=0) for dim in taps]
        dyp = lax.pad(dy, jnp.zeros((), dy.dtype), [(0, 0, 0)] * 2 + [
            (lo, max(0, m - o), 0) for lo, m, o in zip(low, phase, out)])
        w, c_terms = w.reshape(c_out, -1), c_out

        def term(k, shifts):
            start = [0, 0] + [lo - t for lo, t in zip(low, shifts)]
            win = lax.slice(dyp, start, [n_batch, c_out, *(b + m for b, m in
                                                          zip(start[2:], phase))])
            return win * w[:, k].reshape((c_out,) + (1,) * n)
    else:  # each tap's patch gradient (one batched matmul), shifted into its phase
        c_group, o_group, c_terms = c_in // group, c_out // group, c_in
        dpatch = lax.dot_general(dy.reshape(n_batch, group, o_group, -1),
                                 w.reshape(group, o_group, -1), (((2,), (1,)), ((1,), (0,))),
                                 precision=lax.Precision.HIGHEST)
        # [G, N, P, C/G * K] -> [K, N, C, out...]
        dpatch = dpatch.reshape(group, n_batch, -1, c_group, math.prod(kernel))
        dpatch = jnp.transpose(dpatch, (4, 1, 0, 3, 2)).reshape(-1, n_batch, c_in, *out)

        def term(k, shifts):
            return lax.pad(dpatch[k], jnp.zeros((), dy.dtype), [(0, 0, 0)] * 2 + [
                (t, m - o - t, 0) for t, m, o in zip(shifts, phase, out)])
    phases = []
    for r in itertools.product(*(range(s) for s in strides)):
        acc = None
        for combo in itertools.product(*(taps[i][r[i]] for i in range(n))):
            t = term(sum(k * f for (k, _), f in zip(combo, flat)), [t for _, t in combo])
            acc = t if acc is None else acc + t
        if acc is None:
            acc = jnp.zeros((n_batch, c_terms, *phase), dy.dtype)
        if c_terms != c_in:  # depthwise with a channel multiplier
            acc = acc.reshape(n_batch, c_in, -1, *phase).sum(axis=2)
        phases.append(acc)
    # [s..., N, C, m...] -> [N, C, m1, s1, m2, s2, ...]: the padded input's pixels
    dxp = jnp.stack(phases).reshape(*strides, n_batch, c_in, *phase)
    order = [n, n + 1] + [a for i in range(n) for a in (n + 2 + i, i)]
    dxp = jnp.transpose(dxp, order).reshape(n_batch, c_in,
                                            *(m * s for m, s in zip(phase, strides)))
    dxp = lax.slice(dxp, [0] * dy.ndim, [n_batch, c_in, *padded])
    pad = [(0, 0, 0)] * 2 + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
    x = jax.ShapeDtypeStruct((n_batch, c_in, *x_shape[2:]), dy.dtype)
    (dx,) = jax.linear_transpose(lambda v: lax.pad(v, jnp.zeros((), dy.dtype), pad), x)(dxp)
    return dx


def depthwise_conv_dw(dy, x, kernel, strides, padding, dilations, lhs_dilation=None):
    """The transpose in w of windowed_conv's depthwise convolution at dy [N, C * m, out...]:
    dw [C * m, 1, *kernel] in dy's dtype, one contraction of dy with the stacked windows of
    the padded x (jax's transpose reduces each tap's product in a loop of its own)."""
    n = dy.ndim - 2
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    n_batch, c_out = dy.shape[:2]
    c_in = x.shape[1]
    xp = lax.pad(x, jnp.zeros((), x.dtype),
                 [(0, 0, 0)] * 2 + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)])
    windows = _tap_windows(xp, kernel, dy.shape[2:], strides, dilations)
    patches = jnp.stack(windows, axis=2).reshape(n_batch, c_in, len(windows), -1)
    dw = jnp.einsum("ncop,nckp->cok", dy.reshape(n_batch, c_in, c_out // c_in, -1), patches,
                    precision=lax.Precision.HIGHEST)
    return dw.reshape(c_out, 1, *kernel)


def _tap_windows(xp, kernel, out, strides, dilations):
    """The strided window of the padded xp [N, C, ...] that each kernel tap reads (taps in
    row-major order), each [N, C, *out]."""
    windows = []
    for ks in itertools.product(*map(range, kernel)):
        start = [0, 0] + [k * d for k, d in zip(ks, dilations)]
        limit = [*xp.shape[:2], *(b + (o - 1) * s + 1 for b, o, s in zip(start[2:], out, strides))]
        windows.append(lax.slice(xp, start, limit, (1, 1, *strides)))
    return windows


def dense_conv_dw(dy, x, kernel, strides, padding, dilations):
    """The transpose in w of a group-1 convolution at dy [N, O, out...]: dw [O, C, *kernel]
    in dy's dtype, one matmul a kernel tap (dy against the tap's strided window of the
    padded x, contracted over batch and pixels).

    XLA:CPU's own filter-gradient convolution puts the batch in its feature dim (2 in the
    corpus) and ran ResNet's 3x3 ones at ~6 GFLOP/s: 3.2 ms for its 64->16 channel 32x32 one,
    its largest thunk. Per tap, a window (N * C * pixels) is copied while still in cache
    and one dot reads it: 0.86 ms on one core, 1.3 ms on two (XLA's: 3.2, 2.6); one
    im2col matrix of every tap (windowed_conv's transpose) took 1.9 ms either way
    (ResNet's shapes, batch 2, interleaved in one process, 2026-11-24). With few input
    channels (a 3-channel stem) the taps' dots are too thin: ConvGrad keeps XLA's there
    (_taps_dw)."""
    n_batch, c_out = dy.shape[:2]
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * 2 + [(lo, hi, 0) for lo, hi in padding])
    d = dy.reshape(n_batch, c_out, -1)
    taps = [lax.dot_general(d, win.reshape(n_batch, x.shape[1], -1), (((0, 2), (0, 2)), ((), ())),
                            precision=lax.Precision.HIGHEST)
            for win in _tap_windows(xp, kernel, dy.shape[2:], strides, dilations)]
    return jnp.stack(taps, axis=-1).reshape(c_out, x.shape[1], *kernel)


def phase_conv(x, w, strides, padding):
    """A strided, undilated group-1 convolution of x [N, C, ...] and w [O, C, k...] as a
    stride-1 one over the strides' phases stacked as channels (space-to-depth): x padded to a
    whole number of strides becomes [N, C * prod(strides), padded / strides] and w, padded
    to kernel sizes that the strides divide, [O, C * prod(strides), ceil(k / strides)].

    Its transpose in w is ConvGrad's dW on the CPU for a strided convolution with few input
    channels (_phase_dw): ResNet's 3-channel 7x7 stride-2 stem 0.80-0.83x the time of XLA's
    filter-gradient convolution on one core and on two (2.6 vs 3.2 ms, 1.9 vs 2.4 ms; the
    forward itself stays XLA's, which ran it faster: 2.0 vs 2.3 ms; 2026-11-24)."""
    n = x.ndim - 2
    n_batch, c_in = x.shape[:2]
    kernel = w.shape[2:]
    taps = [-(-k // s) for k, s in zip(kernel, strides)]
    out = geometry.conv_out_sizes(x.shape[2:], kernel, strides, (1,) * n, padding)
    # each phase as long as the last output's taps reach (at least the padded input)
    phase = [max(-(-(i + lo + hi) // s), o - 1 + t)
             for i, (lo, hi), s, o, t in zip(x.shape[2:], padding, strides, out, taps)]
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * 2 + [
        (lo, m * s - i - lo, 0) for i, (lo, _), s, m in zip(x.shape[2:], padding, strides, phase)])
    # [N, C, m1, s1, m2, s2, ...] -> [N, C, s1, s2, ..., m1, m2, ...]
    split = [d for m, s in zip(phase, strides) for d in (m, s)]
    order = [0, 1] + [3 + 2 * i for i in range(n)] + [2 + 2 * i for i in range(n)]
    xs = jnp.transpose(xp.reshape(n_batch, c_in, *split), order).reshape(
        n_batch, c_in * math.prod(strides), *phase)
    wp = lax.pad(w, jnp.zeros((), w.dtype), [(0, 0, 0)] * 2 + [
        (0, t * s - k, 0) for k, s, t in zip(kernel, strides, taps)])
    wsplit = [d for t, s in zip(taps, strides) for d in (t, s)]
    ws = jnp.transpose(wp.reshape(*w.shape[:2], *wsplit), order).reshape(
        w.shape[0], c_in * math.prod(strides), *taps)
    y = lax.conv_general_dilated(xs, ws, (1,) * n, [(0, 0)] * n,
                                 dimension_numbers=_dimension_numbers(n),
                                 precision=lax.Precision.HIGHEST)
    return lax.slice(y, [0] * y.ndim, [*y.shape[:2], *out])


@functools.cache
def _barrier_differentiates() -> bool:
    """Whether this jax differentiates and transposes lax.optimization_barrier (ConvGrad
    transposes the forward), checked by tracing both once."""
    x = jnp.zeros((), jnp.float32)
    try:
        jax.make_jaxpr(jax.grad(lambda v: lax.optimization_barrier(v) * 2.0))(x)
        jax.make_jaxpr(jax.linear_transpose(lax.optimization_barrier, x))(x)
    except Exception:  # noqa: BLE001 (any failure: go without the barrier)
        return False
    return True


def _materialized(y):
    """y, computed into a buffer of its own (lax.optimization_barrier) where jax can
    differentiate that."""
    return lax.optimization_barrier(y) if _barrier_differentiates() else y


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What follows a convolution, output channel by output channel (a BatchNormalization in
    inference, a Relu or Clip: the importer's fused Conv): `exact(y, *operands)` is the
    graph's own math, which runs where the CPU kernel does not; the kernel applies
    `folded(*operands)` -> (scale, shift) [O] (or (None, None)) and the static bounds
    [lo, hi] in its store instead: clamp(sum * scale + shift, lo, hi)."""
    operands: tuple
    exact: Callable
    folded: Callable
    lo: float = -math.inf
    hi: float = math.inf


_NOTHING_AFTER = Epilogue((), lambda y: y, lambda: (None, None))


def conv_general(x, w, strides, padding, dilations, group, lhs_dilation=None,
                 precision=lax.Precision.HIGHEST, dense=False, channels_last=False,
                 epilogue: Epilogue | None = None, constant_w=False):
    """lax.conv_general_dilated in ONNX layouts (NC..., OI...): XLA's convolution, except that
    a grouped one lowered for the CPU is windowed_conv there. (Other dense ones stay XLA's:
    their windowed filter gradient, 1.4-7x faster at the corpus's sizes, summed in another
    order and moved ResNet's 5-step losses 4e-5 off ORT's on jax 0.8. ConvGrad's dW of them
    is dense_conv_dw or phase_conv's transpose on the CPU instead: ResNet's losses 7e-7 off
    ORT's on jax 0.12.)

    dense=True (the importer's Conv and ConvGrad's forward): also the dense convolutions that
    windowed_conv runs faster on the CPU, those where it is one matmul of the input as it lies
    or of a small patch matrix: 1x1 unpadded (XLA transposes the weight and the image to NHWC
    and back around each; a matmul reads them as they are), an image stem's (C_in * kernel
    <= 32; XLA:CPU runs a 3-channel 3x3 through its slow generic loop) and non-overlapping
    windows (patchify: the patches are the input reordered). MobileNetV3's forward 15-25%
    faster on one core with the first two (measured 2026-11-24, interleaved with ORT); their
    gradients in a training step: RegNet 0.81x, EfficientNet 0.87x the time, the patchify
    ones ConvNeXt/Swin/ViT 0.87-0.91x (2026-11-24, one core, interleaved). And small 1-D ones
    (_small_patches).

    channels_last=True (the importer's Conv where the weight is a constant: an inference
    forward such as `program.jit()`), on the CPU only: windowed_conv's channels-last form,
    also for small dense convolutions of any rank, and without the kernel taps that read
    only padding (_live_taps: a dilated convolution over a feature map no wider than its
    dilation is a 1x1 one).

    epilogue: what follows it (an Epilogue): in the kernel's store where the kernel runs,
    else as the graph writes it.

    constant_w: w is a constant of the program (not traced): the CPU kernel then takes its
    weights packed by XLA's constant folding (conv_cpu.pack_weights) instead of packing them
    every call."""
    n = x.ndim - 2
    epilogue = epilogue or _NOTHING_AFTER
    ops, after = epilogue.operands, epilogue.exact

    def raw(x, w, padding=padding):
        return lax.conv_general_dilated(
            x, w, window_strides=strides, padding=padding, lhs_dilation=lhs_dilation,
            rhs_dilation=dilations, dimension_numbers=_dimension_numbers(n),
            feature_group_count=group, precision=precision)

    def xla(x, w, *ops):
        return after(raw(x, w), *ops)

    out = geometry.conv_out_sizes(x.shape[2:], w.shape[2:], strides, dilations, padding,
                                  lhs_dilation)
    if min(out) < 1:
        return xla(x, w, *ops)
    live = _live_taps(x.shape[2:], w.shape[2:], strides, padding, dilations, out,
                      lhs_dilation) if channels_last else None
    cpu_padding = padding if live is None else live[1]
    cpu_kernel = w.shape[2:] if live is None else tuple(b - a for a, b in live[0])
    kernel = channels_last and conv_cpu.applies(
        x, (*w.shape[:2], *cpu_kernel), strides, dilations, group, cpu_padding, lhs_dilation)
    # traced weights' depthwise ones (a training step's): the depthwise kernel
    depthwise = not kernel and not channels_last and depthwise_cpu.applies(
        x, (*w.shape[:2], *cpu_kernel), strides, dilations, group, cpu_padding, lhs_dilation)
    windowed = group > 1 or (dense and _windowed_dense(
        x, cpu_kernel, cpu_padding, dilations, lhs_dilation, strides, channels_last))
    if live is None and not windowed and not kernel:
        return xla(x, w, *ops)

    def before_kernel(x, w, *ops):
        if windowed:
            y = windowed_conv(x, w, strides, cpu_padding, dilations, group, lhs_dilation,
                              precision, channels_last)
        else:
            y = raw(x, w, cpu_padding)
        return after(y, *ops)

    def in_kernel(x, w, *ops):
        return conv_cpu.conv_nchw(x, w, strides, dilations, cpu_padding, group,
                                  *epilogue.folded(*ops), epilogue.lo, epilogue.hi,
                                  constant_w=constant_w)

    def in_depthwise(x, w, *ops):
        return after(depthwise_cpu.forward(x, w, dilations, cpu_padding), *ops)

    def cpu(x, w, *ops):
        if live is not None:
            w = w[(slice(None),) * 2 + tuple(slice(a, b) for a, b in live[0])]
        if kernel:
            # differentiated as before_kernel: a forward that is differentiated after all
            # (a forward-only export trained) keeps its gradients' formulation and numerics
            return with_derivatives_of(before_kernel, in_kernel)(x, w, *ops)
        if depthwise:  # (its derivatives are its own kernels)
            return in_depthwise(x, w, *ops)
        return before_kernel(x, w, *ops)
    # the platform is chosen when lowering: the compiler never sees a conditional
    return lax.platform_dependent(x, w, *ops, cpu=cpu, default=xla)


def _live_taps(spatial, kernel, strides, padding, dilations, out, lhs_dilation):
    """((first, stop) kernel taps per dim, their padding) of the taps that read the input at
    some output, or None where every tap does (or none does). A tap k reads positions
    o * stride + k * dilation - pad_begin: its live ones form one range of k."""
    if lhs_dilation is not None and any(d != 1 for d in lhs_dilation):
        return None
    taps, pads = [], []
    for size, k, s, d, (lo, hi), o in zip(spatial, kernel, strides, dilations, padding, out):
        live = [t for t in range(k)
                if any(0 <= i * s + t * d - lo < size for i in range(o))]
        if not live:
            return None
        first, stop = live[0], live[-1] + 1
        # the same outputs: the begin pad shrinks by the dropped first taps, the end pad by
        # the dropped last ones (a negative one, a crop, is left to XLA's convolution)
        taps.append((first, stop))
        pads.append((lo - first * d, hi - (k - stop) * d))
    if all(t == (0, k) for t, k in zip(taps, kernel)) or min(min(p) for p in pads) < 0:
        return None
    return taps, pads


def _windowed_dense(x, kernel, padding, dilations, lhs_dilation, strides, channels_last=False):
    """Whether windowed_conv beats XLA:CPU at this group-1 convolution (conv_general's dense)."""
    if lhs_dilation is not None and any(d != 1 for d in lhs_dilation):
        return False
    if all(k == 1 for k in kernel) and all(p == (0, 0) for p in padding):
        return True
    if all(d == 1 for d in dilations) and x.shape[1] * math.prod(kernel) <= 32:
        return True
    if (channels_last or len(kernel) == 1) and _small_patches(x, kernel, padding, dilations,
                                                              strides):
        return True
    # a 7x7 stem stays XLA's: its patch matrix cost more than XLA's convolution (231 vs 288 us)
    return _patchify(kernel, strides, padding, dilations)


def _small_patches(x, kernel, padding, dilations, strides):
    """A patch matrix of at most 2**17 elements (512 KiB in f32) with rows of >= 8 channels:
    there im2col and one matmul beat XLA:CPU's convolution, whose cost a call is ~5-10 us
    more on these small ones (DeepLabV3's 3x3s on 4x4 and 8x8 maps, channels last: its
    backbone 0.82x, its head 0.69x the time, one core). ResNet's forward ran 1.16x slower with
    every 3x3 so (64x64 maps), and a 3-channel 7x7 stem's 49 slices of 3 values cost more than
    XLA's convolution (0.25 vs 0.21 ms).

    With traced weights (a training step) the transposes too, and a strided one's dX then
    has no lhs-dilated convolution: Whisper's 1-D convolutions (length 16, 16-32 channels)
    0.89-0.90x the step's time (whisper_dynamo; whisper_ts 0.98-0.99x; one core, A/B
    interleaved, 2026-11-29). 2-D ones stay XLA's there: ResNet's 3x3s on 4x4 to 32x32 maps
    took 0.96-0.97x the step's time but moved its 5-step losses 4.1e-5 off ORT's on jax 0.8
    (from 3.7e-7; ORT's own are 4e-5 off float64's: f32 rounding compounding)."""
    pixels = x.shape[0] * math.prod(geometry.conv_out_sizes(x.shape[2:], kernel, strides,
                                                            dilations, padding))
    return x.shape[1] >= 8 and pixels * x.shape[1] * math.prod(kernel) <= 1 << 17


def _patchify(kernel, strides, padding, dilations):
    """Non-overlapping windows (strides == kernel, unpadded): the patches are x reordered."""
    return (tuple(strides) == tuple(kernel) and all(p == (0, 0) for p in padding)
            and all(d == 1 for d in dilations))


def _conv(x, w, attrs, padding, *, lhs_dilation=None, dense=False):
    """The forward convolution in x's dtype, accumulating f16/bf16 in f32. (The operands are
    cast up rather than given preferred_element_type: jax 0.8 cannot transpose that.)"""
    dtype = x.dtype
    acc = rules.compute_dtype(dtype)
    y = conv_general(x.astype(acc), w.astype(acc),
                     attrs.strides if lhs_dilation is None else (1,) * attrs.n, padding,
                     attrs.dilations, attrs.group, lhs_dilation, dense=dense)
    return y.astype(dtype)


def _grads(dY, X, W, forward, wanted):
    """(dX, dW, dB) of y = forward(X, W), each only if wanted."""
    want_x, want_w, want_b = wanted
    # inside shard_map, transposing needs dY typed as varying over every mesh axis the
    # forward's output varies over (and the operands over dY's)
    axes = varying_axes(dY) | varying_axes(X) | varying_axes(W)
    dY, X, W = (mark_varying(a, axes - varying_axes(a)) for a in (dY, X, W))
    dX = dW = dB = None
    if want_x:
        dX = _cpu_or(getattr(forward, "dx", None),
                     lambda dY, W: jax.linear_transpose(lambda x: forward(x, W), X)(dY)[0], dY, W)
    if want_w:
        dW = _cpu_or(getattr(forward, "dw", None),
                     lambda dY, X: jax.linear_transpose(lambda w: forward(X, w), W)(dY)[0], dY, X)
    if want_b:
        acc = rules.compute_dtype(dY.dtype)
        axes = (0,) + tuple(range(2, dY.ndim))
        dB = jnp.sum(dY.astype(acc), axis=axes).astype(dY.dtype)
    return dX, dW, dB


def _cpu_or(cpu, default, *args):
    """cpu(*args) where lowered for the CPU (if the forward gives one), else default(*args)."""
    if cpu is None:
        return default(*args)
    return lax.platform_dependent(*args, cpu=cpu, default=default)


def _transpose_padding(attrs, spatial, output_padding, output_shape):
    """ConvTranspose's (begin, end) crop of the full output, and the output padding, per dim.

    See geometry.conv_transpose_crops (ORT 1.19.2 splits the crop that way)."""
    n = attrs.n
    adj = _ints("output_padding", output_padding, n, 0)
    if any(a < 0 or (a >= s and a >= d) for a, s, d in zip(adj, attrs.strides, attrs.dilations)):
        raise ValueError(f"output_padding {adj} must be below strides or dilations")
    if output_shape is not None:
        output_shape = tuple(rules.integer("output_shape", i) for i in output_shape)[-n:]
        if len(output_shape) != n:
            raise ValueError(f"output_shape must give {n} spatial sizes")
    crops = geometry.conv_transpose_crops(attrs.auto_pad, spatial, attrs.strides,
                                          attrs.effective, adj, attrs.pads, output_shape)
    return crops, adj


def _conv_transpose_fn(attrs, crops, adj):
    """ConvTranspose(x, w) as one XLA convolution: input dilated by the strides, kernel
    flipped with its in/out channels swapped per group."""
    n, g = attrs.n, attrs.group
    padding = [(e - 1 - b, e - 1 - t + a) for e, (b, t), a in zip(attrs.effective, crops, adj)]

    def forward(x, w):
        c_in, c_out_g = w.shape[0], w.shape[1]
        k = w.reshape(g, c_in // g, c_out_g, *w.shape[2:])
        k = jnp.swapaxes(k, 1, 2).reshape(g * c_out_g, c_in // g, *w.shape[2:])
        k = jnp.flip(k, axis=tuple(range(2, 2 + n)))
        return _conv(x, k, attrs, padding, lhs_dilation=attrs.strides)
    return forward


def _taps_dw(X, attrs, padding):
    """Whether ConvGrad's dW on the CPU is dense_conv_dw: a group-1 convolution that stays
    XLA's there (not windowed: those transpose to matmuls already) with >= 16 input channels
    (ResNet's 16- to 64-channel 3x3s: 1.1-3.7x faster on one core, 1.35-2x on two; its
    3-channel 7x7 stem: 1.8x slower)."""
    return (attrs.group == 1 and X.shape[1] >= 16
            and not _windowed_dense(X, attrs.kernel, padding, attrs.dilations, None,
                                    attrs.strides))


def _phase_dw(X, attrs, padding):
    """Whether ConvGrad's dW on the CPU is phase_conv's transpose: a strided, undilated
    group-1 convolution with < 16 input channels (fewer than dense_conv_dw takes) that stays
    XLA's there."""
    return (attrs.group == 1 and X.shape[1] < 16 and max(attrs.strides) > 1
            and all(d == 1 for d in attrs.dilations)
            and not _windowed_dense(X, attrs.kernel, padding, attrs.dilations, None,
                                    attrs.strides))


def _conv_forward(X, W, auto_pad, dilations, group, kernel_shape, pads, strides):
    """Conv(x, w) with the attributes checked against X and W."""
    attrs = _Attrs(X, W, auto_pad=auto_pad, dilations=dilations, group=group,
                   kernel_shape=kernel_shape, pads=pads, strides=strides, transpose=False)
    padding = attrs.conv_padding(X.shape[2:])

    def forward(x, w):
        # dense=True: the dense convolutions that windowed_conv runs faster on the CPU (1x1,
        # image stems, patchify) are windowed there, so are their gradients (matmuls)
        return _conv(x, w, attrs, padding, dense=True)
    depthwise = depthwise_cpu.applies(X, W.shape, attrs.strides, attrs.dilations, attrs.group,
                                      padding, None)
    if attrs.group > 1:
        # windowed_conv on the CPU: its transposes written out run faster there
        def dx(dY, w):
            acc = rules.compute_dtype(dY.dtype)
            return grouped_conv_dx(dY.astype(acc), w.astype(acc), X.shape, attrs.strides,
                                   padding, attrs.dilations, attrs.group).astype(X.dtype)

        def depthwise_dx(dY, w):  # on the CPU: see depthwise_cpu
            return depthwise_cpu.dx(dY, w, X.shape[1:], attrs.dilations,
                                    padding).astype(X.dtype)
        forward.dx = depthwise_dx if depthwise else dx
    if _taps_dw(X, attrs, padding):

        def dw(dY, x):  # on the CPU: see dense_conv_dw
            acc = rules.compute_dtype(dY.dtype)
            return dense_conv_dw(dY.astype(acc), x.astype(acc), attrs.kernel, attrs.strides,
                                 padding, attrs.dilations).astype(W.dtype)
        forward.dw = dw
    if _phase_dw(X, attrs, padding):

        def dw(dY, x):  # on the CPU: see phase_conv
            acc = rules.compute_dtype(dY.dtype)
            w0 = jax.ShapeDtypeStruct(W.shape, acc)
            conv = lambda w: phase_conv(x.astype(acc), w, attrs.strides, padding)
            return jax.linear_transpose(conv, w0)(dY.astype(acc))[0].astype(W.dtype)
        forward.dw = dw
    if attrs.group > 1 and W.shape[1] == 1:

        def dw(dY, x):
            acc = rules.compute_dtype(dY.dtype)
            return depthwise_conv_dw(dY.astype(acc), x.astype(acc), attrs.kernel, attrs.strides,
                                     padding, attrs.dilations).astype(W.dtype)

        def depthwise_dw(dY, x):  # on the CPU: see depthwise_cpu
            return depthwise_cpu.dw(dY, x, attrs.kernel, attrs.dilations,
                                    padding).astype(W.dtype)
        forward.dw = depthwise_dw if depthwise else dw
    return forward


def _conv_transpose_forward(X, W, auto_pad, dilations, group, kernel_shape, output_padding,
                            output_shape, pads, strides):
    """ConvTranspose(x, w) with the attributes checked against X and W."""
    attrs = _Attrs(X, W, auto_pad=auto_pad, dilations=dilations, group=group,
                   kernel_shape=kernel_shape, pads=pads, strides=strides, transpose=True)
    crops, adj = _transpose_padding(attrs, X.shape[2:], output_padding, output_shape)
    return _conv_transpose_fn(attrs, crops, adj)


def conv(X, W, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
         strides=None):
    """ONNX Conv without bias (the forward ConvGrad differentiates; not an ORT training op)."""
    X, W = jnp.asarray(X), jnp.asarray(W)
    with rules.named("conv"):
        forward = _conv_forward(X, W, auto_pad, dilations, group, kernel_shape, pads, strides)
    return forward(X, W)


def conv_transpose(X, W, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    """ONNX ConvTranspose without bias (the forward ConvTransposeGrad differentiates; not an
    ORT training op). W is [C_in, C_out / group, k...]."""
    X, W = jnp.asarray(X), jnp.asarray(W)
    with rules.named("conv_transpose"):
        forward = _conv_transpose_forward(X, W, auto_pad, dilations, group, kernel_shape,
                                          output_padding, output_shape, pads, strides)
    return forward(X, W)


def _grad_op(forward):
    """check and reference of a convolution gradient whose forward(X, W, **attrs) gives the
    checked forward convolution."""
    def check(dY, X, W, *, outputs, **attrs):
        rules.floats(dY=dY, X=X, W=W)
        rules.outputs(outputs, 3)
        expected = jax.eval_shape(forward(X, W, **attrs), X, W)
        if tuple(dY.shape) != tuple(expected.shape):
            raise ValueError(f"dY must have the forward output's shape "
                             f"{tuple(expected.shape)}, got {dY.shape}")

    def reference(dY, X, W, *, outputs, **attrs):
        return _grads(dY, X, W, forward(X, W, **attrs), rules.outputs(outputs, 3))
    return check, reference


def _conv_inputs(x_shape, w_shape, forward, attrs):
    """Matrix inputs (dY, X, W): X [n, ...x_shape] with n the leading dim, the spatial dim
    after the channels the second leading dim; dY the forward output's shape."""
    def make(rng, shape, dtype):
        n, s = shape
        x = jnp.asarray(rng.standard_normal((n, x_shape[0], s, *x_shape[1:])), dtype)
        w = jnp.asarray(rng.standard_normal(w_shape), dtype)
        y = jax.eval_shape(forward(x, w, **attrs), x, w)
        return jnp.asarray(rng.standard_normal(y.shape), dtype), x, w
    return make


_CONV_ATTRS = {"auto_pad": "NOTSET", "dilations": None, "group": 1, "kernel_shape": None,
               "pads": None, "strides": None}
_OUTPUTS = {"outputs": (True, True, True)}
_CONV_FORWARD = lambda X, W, **a: _conv_forward(X, W, **{**_CONV_ATTRS, **a})
_CONV_T_FORWARD = lambda X, W, **a: _conv_transpose_forward(
    X, W, **{**_CONV_ATTRS, "output_padding": None, "output_shape": None, **a})


# a 2-D strided, padded and dilated case (tests/test_conv.py covers 1-D, 3-D, grouped and
# auto_pad geometries); dY and X batch-sharded give dW and dB by an all-reduce. Group 1: XLA's
# SPMD partitioner gathers a batch-sharded operand of a grouped convolution (jax 0.12, even a
# plain lax.conv_general_dilated forward with feature_group_count 2)
_CONV_MATRIX = {"strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}
_CONV_T_MATRIX = {"strides": [2, 1], "pads": [0, 1, 1, 0], "output_padding": [1, 0]}

_check, _reference = _grad_op(_CONV_FORWARD)
conv_grad = define(
    "conv_grad", ort=("com.microsoft", "ConvGrad"), inputs=("dY: float", "X: float", "W: float"),
    outputs=("dX", "dW", "dB"), attrs=_CONV_ATTRS, options=_OUTPUTS, check=_check,
    reference=_reference,
    matrix=Matrix(_conv_inputs((4, 5), (6, 4, 3, 2), _CONV_FORWARD, _CONV_MATRIX),
                  attrs=_CONV_MATRIX, grad=(0, 1, 2)),
    doc="""ORT ConvGrad: (dX, dW, dB) of Y = Conv(X, W, B) given dY, with Conv's attributes.

    auto_pad SAME_UPPER/SAME_LOWER pad to ceil(size / stride) outputs, the odd pixel at the
    end/start; VALID pads nothing; NOTSET uses `pads` (begins then ends). Unwanted outputs
    (`outputs`, see the module docstring) are None.""")

_check, _reference = _grad_op(_CONV_T_FORWARD)
conv_transpose_grad = define(
    "conv_transpose_grad", ort=("com.microsoft", "ConvTransposeGrad"),
    inputs=("dY: float", "X: float", "W: float"), outputs=("dX", "dW", "dB"),
    attrs={"auto_pad": "NOTSET", "dilations": None, "group": 1, "kernel_shape": None,
           "output_padding": None, "output_shape": None, "pads": None, "strides": None},
    options=_OUTPUTS,
    check=_check, reference=_reference,
    matrix=Matrix(_conv_inputs((4, 3), (4, 3, 2, 2), _CONV_T_FORWARD, _CONV_T_MATRIX),
                  attrs=_CONV_T_MATRIX, grad=(0, 1, 2)),
    doc="""ORT ConvTransposeGrad: (dX, dW, dB) of Y = ConvTranspose(X, W, B) given dY, with
    ConvTranspose's attributes (W is [C_in, C_out / group, k...]). Unwanted outputs
    (`outputs`, see the module docstring) are None. (ORT has no CPU kernel.)""")
del _check, _reference

__all__ = ["conv_grad", "conv_transpose_grad"]
