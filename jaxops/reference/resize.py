"""ResizeGrad as jax's reverse-mode derivative of a bilinear Resize written with gathers
(ONNX Resize, mode=linear, half_pixel or align_corners; tests check the pair against ORT)."""
import jax
import numpy as np


def _taps(in_size, out_size, align_corners, scale):
    o = np.arange(out_size, dtype=np.float64)
    if align_corners:
        src = o * ((in_size - 1) / (out_size - 1)) if out_size > 1 else o * 0
    else:
        src = np.maximum((o + 0.5) / scale - 0.5, 0)
    src = np.minimum(src, in_size - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, in_size - 1)
    return lo, hi, src - lo


def resize_linear(X, out_hw, align_corners=False, scales_hw=None):
    (h, w), (oh, ow) = X.shape[2:], out_hw
    sh, sw = scales_hw if scales_hw is not None else (oh / h, ow / w)
    hl, hh, hf = _taps(h, oh, align_corners, sh)
    wl, wh, wf = _taps(w, ow, align_corners, sw)
    rows = X[:, :, hl, :] * (1 - hf)[:, None] + X[:, :, hh, :] * hf[:, None]
    return rows[..., wl] * (1 - wf) + rows[..., wh] * wf


def resize_grad(dY, X, align_corners=False, scales_hw=None):
    f = lambda x: resize_linear(x, dY.shape[2:], align_corners, scales_hw)
    return jax.vjp(f, X)[1](dY)[0]
