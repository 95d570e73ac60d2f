"""ResizeGrad (com.microsoft): the adjoint of a 4-D NCHW bilinear Resize, as XLA scatter-adds.

ORT's ResizeGrad (a CUDA kernel; none on CPU) accepts only mode="linear", the
coordinate_transformation_modes "half_pixel" (default) and "align_corners", no `axes`, no
antialias and keep_aspect_ratio_policy="stretch"; anything else raises ValueError here too.
Per spatial dim (H, W), output pixel o reads input position
  align_corners: o * (in - 1) / (out - 1)   (0 when out == 1)
  half_pixel:    max(0, (o + 0.5) / scale - 0.5), scale = scales[d] when the `scales`
                 input is given (non-empty), else out / in
and the gradient of o is spread onto floor(position) and the next pixel (the same one at the
last pixel) with weights 1 - frac and frac; the 2-D weight is the product of the H and W
ones. This is exactly the adjoint of ONNX Resize(mode=linear) for these modes (tested
against ORT's CPU Resize). `roi` is ignored, as ORT does. f16/bf16 accumulate in f32 (ORT's
kernel accumulates atomically in the data type).
"""
import jax.numpy as jnp
import numpy as np

from jaxops._src import geometry, rules
from jaxops._src.spec import REQUIRED, Matrix, define

_MODES = ("half_pixel", "align_corners")


def _str(value):
    return value.decode() if isinstance(value, bytes) else value


def source_taps(in_size, out_size, align_corners, scale=None):
    """(lo, hi, w_lo, w_hi): the two input pixels each output pixel reads and their weights
    (f32), for one spatial dim. `scale` (half_pixel only) may be a traced scalar."""
    dst = jnp.arange(out_size, dtype=jnp.float32)
    if align_corners:
        src = geometry.resize_source("align_corners", dst, None, in_size, out_size)
    else:
        scale = out_size / in_size if scale is None else scale.astype(jnp.float32)
        src = geometry.resize_source("half_pixel", dst, scale, in_size, out_size)
        src = jnp.maximum(src, 0.0)  # the first half pixel reads pixel 0 alone
    lo = jnp.minimum(src.astype(jnp.int32), in_size - 1)
    hi = jnp.where(lo < in_size - 1, lo + 1, lo)
    frac = src - lo
    return lo, hi, 1 - frac, frac


def _scales(scales):
    """The `scales` input, None when absent or empty."""
    return None if scales is None or scales.size == 0 else scales


def _check(dY, X, roi, scales, *, mode, coordinate_transformation_mode, antialias, axes,
           keep_aspect_ratio_policy, cubic_coeff_a, exclude_outside, extrapolation_value,
           nearest_mode):
    rules.same_dtype(dY=dY, X=X)
    if _str(mode) != "linear":
        raise ValueError(f"only mode='linear' is supported (as in ORT), got {mode!r}")
    ctm = _str(coordinate_transformation_mode)
    if ctm not in _MODES:
        raise ValueError(f"coordinate_transformation_mode must be one of {_MODES} (as in ORT), "
                         f"got {ctm!r}")
    if antialias or axes is not None or _str(keep_aspect_ratio_policy) != "stretch":
        raise ValueError("antialias, axes and keep_aspect_ratio_policy other than 'stretch' "
                         "are not supported (as in ORT)")
    if X.ndim != 4 or dY.ndim != 4 or dY.shape[:2] != X.shape[:2]:
        raise ValueError(f"dY and X must be NCHW with equal N and C, got {dY.shape} and "
                         f"{X.shape}")
    scales = _scales(scales)
    if scales is not None and (np.dtype(scales.dtype) not in rules.FLOATS
                               or scales.shape != (4,)):
        raise ValueError(f"scales must be 4 floats (N, C, H, W), got {scales.dtype}{scales.shape}")


def _resize_grad(dY, X, roi, scales, *, coordinate_transformation_mode, **unused):
    scales = _scales(scales)
    align = _str(coordinate_transformation_mode) == "align_corners"
    (h_in, w_in), (h_out, w_out) = X.shape[2:], dY.shape[2:]
    h = source_taps(h_in, h_out, align, None if scales is None else scales[2])
    w = source_taps(w_in, w_out, align, None if scales is None else scales[3])
    acc = rules.compute_dtype(dY.dtype)
    dy = dY.astype(acc)
    dX = jnp.zeros(X.shape, acc)
    for hi, hw in ((h[0], h[2]), (h[1], h[3])):
        for wi, ww in ((w[0], w[2]), (w[1], w[3])):
            weight = (hw[:, None] * ww[None, :]).astype(acc)
            dX = dX.at[:, :, hi[:, None], wi[None, :]].add(dy * weight)
    return dX.astype(dY.dtype)


def _make(rng, shape, dtype):
    """dY [N, C, 5, 7] upsampled from X [N, C, 3, 4]."""
    n, c = shape
    return (jnp.asarray(rng.standard_normal((n, c, 5, 7)), dtype),
            jnp.asarray(rng.standard_normal((n, c, 3, 4)), dtype))


resize_grad = define(
    "resize_grad", ort=("com.microsoft", "ResizeGrad"),
    inputs=("dY: float", "X: float", "roi?", "scales?"), outputs=("dX",),
    attrs={"mode": REQUIRED, "coordinate_transformation_mode": "half_pixel", "antialias": 0,
           "axes": None, "keep_aspect_ratio_policy": "stretch", "cubic_coeff_a": -0.75,
           "exclude_outside": 0, "extrapolation_value": 0.0,
           "nearest_mode": "round_prefer_floor"},
    check=_check, reference=_resize_grad,
    doc="""ORT ResizeGrad: dX (X's shape) from dY, the gradient of Y = Resize(X, roi, scales)
    with mode="linear" (see the module docstring). X supplies only its shape. Resize's
    attributes are accepted as ORT's builder copies them; cubic_coeff_a, exclude_outside,
    extrapolation_value and nearest_mode do not affect linear mode.""",
    matrix=Matrix(_make, attrs={"mode": "linear"}, grad=(0,)))

__all__ = ["resize_grad"]
