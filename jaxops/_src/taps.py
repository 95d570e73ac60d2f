"""A window op's kernel taps as strided slices of its input (the pools' CPU form and the max
pool kernel's reference): one slice a tap, padded with the value that leaves the reduction as
it is, so that combining the taps elementwise gives the pool."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax import lax

# Up to this many input elements each tap reads its own slice of x, padded there, and XLA fuses
# the taps into one pass; above, x is padded once and the taps slice the padded copy. On one
# core (2026-11-28, interleaved): DeepLabV3's forward, a 3x3 max pool over 32K elements, 0.96x
# the time (135.6 -> 130.4 us); ResNet's, over 524K, 1.015-1.02x (its bounds checks in the
# fused pass cost more than the padded copy).
SLICE_FIRST_MAX = 1 << 17


def tap_slices(x, fill, kernel, strides, dilations, out, begin_pads, first):
    """One strided slice of x a kernel tap, in window order, each with x's shape but the
    spatial axes (those from `first` on, len(kernel) of them) of sizes `out`: the tap's value
    at every output, `fill` where it reads padding (begin_pads before, the rest after)."""
    fill = jnp.asarray(fill, x.dtype)
    if x.size <= SLICE_FIRST_MAX:
        yield from _padded_taps(x, fill, kernel, strides, dilations, out, begin_pads, first)
        return
    cfg = [(0, 0, 0)] * x.ndim
    for a, n, k, s, d, lo, o in zip(range(first, x.ndim), x.shape[first:], kernel, strides,
                                    dilations, begin_pads, out):
        cfg[a] = (lo, (o - 1) * s + (k - 1) * d + 1 - n - lo, 0)  # a negative end crops
    xp = lax.pad(x, fill, cfg)
    for ks in np.ndindex(*kernel):
        start, limit, step = [0] * xp.ndim, list(xp.shape), [1] * xp.ndim
        for a, k, d, o, s in zip(range(first, xp.ndim), ks, dilations, out, strides):
            start[a], limit[a], step[a] = k * d, k * d + (o - 1) * s + 1, s
        yield lax.slice(xp, start, limit, step)


def _padded_taps(x, fill, kernel, strides, dilations, out, begin_pads, first):
    """tap_slices' taps, each a strided slice of x itself padded with `fill` to the output
    size (a tap that reads only padding: `fill` throughout)."""
    nd = len(kernel)
    shape = list(x.shape)
    shape[first:first + nd] = out
    for ks in np.ndindex(*kernel):
        start, limit, step = [0] * x.ndim, list(x.shape), [1] * x.ndim
        cfg = [(0, 0, 0)] * x.ndim
        for a, k, d, o, s, lo in zip(range(first, first + nd), ks, dilations, out, strides,
                                     begin_pads):
            # the outputs i0..i1 whose tap reads x[i * s + k * d - lo] inside x
            i0 = max(0, -(-(lo - k * d) // s))
            i1 = min(o - 1, (x.shape[a] - 1 + lo - k * d) // s)
            if i1 < i0:
                yield jnp.full(shape, fill)
                break
            p0 = i0 * s + k * d - lo
            start[a], limit[a], step[a] = p0, p0 + (i1 - i0) * s + 1, s
            cfg[a] = (i0, o - 1 - i1, 0)
        else:
            yield lax.pad(lax.slice(x, start, limit, step), fill, cfg)
