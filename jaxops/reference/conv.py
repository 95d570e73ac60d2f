"""ConvGrad / ConvTransposeGrad as jax's reverse-mode derivative (jax.vjp) of a forward Conv /
ConvTranspose written here, apart from jaxops.ops.conv (the code under test): ConvTranspose as
the adjoint of the strided convolution it undoes, rather than a convolution of the dilated
input. Both take their padding rules from jaxops._src.geometry, as the ops do. Reduced
precision is computed in f32 and rounded once."""
import jax
import jax.numpy as jnp
from jax import lax

from jaxops._src import geometry


def _compute_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _conv(x, w, strides, padding, dilations, group):
    sp = "DHW"[-(x.ndim - 2):]
    return lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=dilations,
        dimension_numbers=("NC" + sp, "OI" + sp, "NC" + sp), feature_group_count=group,
        precision=lax.Precision.HIGHEST)


def conv(X, W, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
         strides=None):
    n = X.ndim - 2
    strides, dilations = list(strides or [1] * n), list(dilations or [1] * n)
    padding = geometry.padding(auto_pad, X.shape[2:], W.shape[2:], strides, dilations, pads)
    return _conv(X, W, strides, padding, dilations, group)


def conv_transpose(X, W, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    n = X.ndim - 2
    strides, dilations = list(strides or [1] * n), list(dilations or [1] * n)
    adj = list(output_padding or [0] * n)
    spans = geometry.windows(W.shape[2:], dilations)
    wanted = None if output_shape is None else list(output_shape)[-n:]
    crops = geometry.conv_transpose_crops(auto_pad, X.shape[2:], strides, spans, adj, pads,
                                          wanted)
    # the unpadded Conv(z, W) (W read as [O=C_in, I=C_out/group, k...]) maps z of this size
    # to X's size; its adjoint is the transposed convolution before output_padding and crops
    natural = [s * (i - 1) + w for s, i, w in zip(strides, X.shape[2:], spans)]
    z = jax.ShapeDtypeStruct((X.shape[0], W.shape[1] * group, *natural), X.dtype)
    (y,) = jax.linear_transpose(
        lambda z: _conv(z, W, strides, [(0, 0)] * n, dilations, group), z)(X)
    # output_padding, and a negative end crop, append zeros
    y = jnp.pad(y, [(0, 0)] * 2 + [(0, a + max(0, -e)) for a, (_, e) in zip(adj, crops)])
    return y[(slice(None),) * 2 + tuple(slice(b, m + a - e)
                                        for m, a, (b, e) in zip(natural, adj, crops))]


def _grads(forward, dY, X, W):
    t = _compute_dtype(dY.dtype)
    _, vjp = jax.vjp(forward, X.astype(t), W.astype(t))
    dX, dW = vjp(dY.astype(t))
    dB = jnp.sum(dY.astype(t), axis=(0,) + tuple(range(2, dY.ndim)))
    return tuple(g.astype(dY.dtype) for g in (dX, dW, dB))


def conv_grad(dY, X, W, **attrs):
    return _grads(lambda x, w: conv(x, w, **attrs), dY, X, W)


def conv_transpose_grad(dY, X, W, **attrs):
    return _grads(lambda x, w: conv_transpose(x, w, **attrs), dY, X, W)
