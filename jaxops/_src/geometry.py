"""The index geometry of ONNX's windowed and resampling ops, written once for everyone who needs
it: the importer's handlers (Conv, ConvTranspose, the pools, Resize), the ORT gradient ops
(ConvGrad, ConvTransposeGrad, AveragePoolGrad, ResizeGrad) and the references. Plain integer
arithmetic on static sizes, except `resize_source`, which also takes traced values."""
from __future__ import annotations

SAME = ("SAME_UPPER", "SAME_LOWER")


def same_padding(auto_pad, spatial, strides, windows):
    """auto_pad SAME_UPPER/SAME_LOWER: (begin, end) per spatial dim so that ceil(size / stride)
    windows (of the dilated sizes `windows`) fit; the odd pixel goes at the end (UPPER) or the
    start (LOWER)."""
    out = []
    for size, s, w in zip(spatial, strides, windows):
        total = max(0, (-(-size // s) - 1) * s + w - size)
        small, large = total // 2, total - total // 2
        out.append((small, large) if auto_pad == "SAME_UPPER" else (large, small))
    return out


def windows(kernel, dilations):
    """The spans of dilated kernels: (k - 1) * d + 1 per dim."""
    return [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]


def padding(auto_pad, spatial, kernel, strides, dilations, pads):
    """(begin, end) per spatial dim of a Conv or pooling: SAME_* as `same_padding`, VALID or
    no `pads` none, NOTSET `pads` (all begins, then all ends)."""
    n = len(kernel)
    if auto_pad in SAME:
        return same_padding(auto_pad, spatial, strides, windows(kernel, dilations))
    if auto_pad == "VALID" or pads is None:
        return [(0, 0)] * n
    return [(pads[i], pads[i + n]) for i in range(n)]


def padded_sizes(spatial, padding, lhs_dilation=None):
    """Each spatial size after input (lhs) dilation and padding."""
    lhs_dilation = lhs_dilation or (1,) * len(spatial)
    return [(i - 1) * d + 1 + lo + hi for i, d, (lo, hi) in zip(spatial, lhs_dilation, padding)]


def out_sizes(padded, kernel, strides, dilations):
    """How many windows of the dilated kernel fit each padded size at `strides` (< 1: none)."""
    return [(p - (k - 1) * d - 1) // s + 1 for p, k, s, d in zip(padded, kernel, strides, dilations)]


def conv_out_sizes(spatial, kernel, strides, dilations, padding, lhs_dilation=None):
    """A convolution's output size per spatial dim."""
    return out_sizes(padded_sizes(spatial, padding, lhs_dilation), kernel, strides, dilations)


def pool_output_size(size, window, stride, pad_begin, pad_end, ceil_mode):
    """How many windows a pooling makes along one dim. With ceil_mode the last, partial window
    counts only if it starts inside the input or its begin pad (as ONNX's reference and ORT)."""
    span = size + pad_begin + pad_end - window
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    return out - 1 if (out - 1) * stride >= size + pad_begin else out


def conv_transpose_crops(auto_pad, spatial, strides, windows, output_padding, pads,
                         output_shape=None):
    """ConvTranspose's (begin, end) crop of its full output, stride * (in - 1) + output_padding
    + window, per dim. With output_shape (or auto_pad SAME_*, whose output is in * stride) the
    total follows from the wanted size and is split as the ONNX spec and ORT split it: SAME_UPPER
    crops the odd pixel at the end, NOTSET/SAME_LOWER at the start; a wanted size beyond the full
    one gives a negative end crop (zeros appended)."""
    n = len(spatial)
    if output_shape is None and auto_pad in SAME:
        output_shape = [i * s for i, s in zip(spatial, strides)]
    if output_shape is None:
        return [(0, 0)] * n if auto_pad == "VALID" or pads is None else \
            [(pads[i], pads[n + i]) for i in range(n)]
    crops = []
    for size, s, w, adj, want in zip(spatial, strides, windows, output_padding, output_shape):
        total = s * (size - 1) + adj + w - want
        crop = max(total, 0)
        begin = crop // 2 if auto_pad == "SAME_UPPER" else crop - crop // 2
        crops.append((begin, total - begin))
    return crops


def resize_source(mode, y, scale, in_size, out_length, roi=(0.0, 1.0)):
    """The input coordinates that Resize's output indices `y` (arange(out_size), numpy or jnp)
    read along one axis, by coordinate_transformation_mode. `out_length` is the resized
    length (scale * in_size, or the output size where the caller follows ORT's kernels);
    `scale` may be traced."""
    if mode == "align_corners":
        return y * 0 if out_length == 1 else y * (in_size - 1) / (out_length - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        if out_length == 1:
            return y * 0 + (hi - lo) * (in_size - 1) / 2 + lo * (in_size - 1)
        return y * (hi - lo) * (in_size - 1) / (out_length - 1) + lo * (in_size - 1)
    if mode == "pytorch_half_pixel":
        return y * 0 - 0.5 if out_length == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        return in_size / 2 * (1 - y.shape[0] / out_length) + (y + 0.5) / scale - 0.5
    raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")
