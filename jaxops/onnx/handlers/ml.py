"""The numeric ai.onnx.ml ops that map directly onto jnp (string and tree-ensemble ops are not
covered)."""
from __future__ import annotations


from ..registry import handler
from ._util import xp

ML = "ai.onnx.ml"


@handler("Binarizer", since=1, domain=ML)
def binarizer(ctx, x, *, threshold=0.0):
    m = xp(x)
    return m.where(x > threshold, m.ones((), x.dtype), m.zeros((), x.dtype)).astype(x.dtype)


@handler("ArrayFeatureExtractor", since=1, domain=ML)
def array_feature_extractor(ctx, x, indices):
    """x[..., indices] with the indices flattened; a 1-D x gives a [1, k] row."""
    m = xp(x, indices)
    idx = m.reshape(indices, (-1,))
    out = m.take(x, idx, axis=-1)
    return m.reshape(out, (1, -1)) if x.ndim == 1 else out
