"""The normalisation ops against onnxruntime-training 1.19.2 itself (CPU).

ORT 1.19.2 CPU runs LayerNormalizationGrad, SimplifiedLayerNormalizationGrad and
InvertibleLayerNormalizationGrad for float32 and the f16 mixes below (float64 fails inside its
kernel), BatchNormalizationGrad and BatchNormInternal for f32 and the f16 mixes (no float64).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

f16, f32 = np.float16, np.float32
LN_TYPES = [(f32, f32, f32), (f16, f32, f16), (f32, f32, f16), (f16, f32, f32)]  # (T, U, V)
LN_SHAPES = [((3, 7), -1), ((2, 3, 4), 1), ((2, 3, 4), -1), ((2, 3, 4, 5), 2), ((5,), 0),
             ((4, 6), None)]  # None: the default axis


def close(op_dtypes, got, expected, dy, scale, inv, ulps=16, sums=None):
    """X_grad's terms cancel, so its tolerance scales with |dY * scale * inv_std|; `sums`, where
    given, are the sums of magnitudes of the terms each later output adds up (its scale)."""
    for g, e, dt in zip(got, expected, op_dtypes):
        assert g.dtype == dt, (g.dtype, dt)
    mag = (np.abs(dy.astype(np.float64)).max() * np.abs(scale.astype(np.float64)).max()
           * max(float(np.max(inv)), 1.0) * 4)
    dx, e = np.asarray(got[0], np.float64), expected[0].astype(np.float64)
    eps = float(np.finfo(op_dtypes[0]).eps)
    np.testing.assert_array_less(np.abs(dx - e), ulps * eps * (np.abs(e) + mag))
    for k, (g, w) in enumerate(zip(got[1:], expected[1:])):
        w = w.astype(np.float64)
        assert_close(g, w, g.dtype, ulps=ulps, scale=None if sums is None else np.abs(w) + sums[k])


def _ln_inputs(rng, shape, axis, simplified=False):
    axis = (-1 if axis is None else axis) % len(shape)
    red = tuple(range(axis, len(shape)))
    x = rng.standard_normal(shape) * 1.5 + 0.3
    mean = x.mean(axis=red, keepdims=True)  # ORT's forward keeps the reduced dims as 1
    inv = 1 / np.sqrt(((x if simplified else x - mean) ** 2).mean(axis=red, keepdims=True) + 1e-5)
    feat = shape[axis:]
    return x, mean, inv, rng.uniform(0.5, 1.5, feat), rng.standard_normal(feat), \
        rng.standard_normal(shape)


@pytest.mark.parametrize("types", LN_TYPES, ids=["f32", "f16-f32-f16", "f32-f32-f16", "f16-f32-f32"])
@pytest.mark.parametrize("shape,axis", LN_SHAPES, ids=str)
def test_layer_normalization_grad(rng, types, shape, axis):
    T, U, V = types
    x, mean, inv, scale, _, dy = _ln_inputs(rng, shape, axis)
    args = [dy.astype(V), x.astype(T), scale.astype(V), mean.astype(U), inv.astype(U)]
    # the attributes ORT's gradient builder writes: axis plus the forward's epsilon/stash_type
    attrs = {} if axis is None else {"axis": axis}
    attrs.update(epsilon=1e-5, stash_type=1)
    expected = ort_oracle.run_node("LayerNormalizationGrad", args, [T, V, V], **attrs)
    got = ops.layer_normalization_grad(*[jnp.asarray(a) for a in args], **attrs)
    close([T, V, V], got, expected, args[0], args[2], args[4])


@pytest.mark.parametrize("types", LN_TYPES, ids=["f32", "f16-f32-f16", "f32-f32-f16", "f16-f32-f32"])
@pytest.mark.parametrize("shape,axis", LN_SHAPES, ids=str)
def test_simplified_layer_normalization_grad(rng, types, shape, axis):
    T, U, V = types
    x, _, inv, scale, _, dy = _ln_inputs(rng, shape, axis, simplified=True)
    args = [dy.astype(V), x.astype(T), scale.astype(V), inv.astype(U)]
    attrs = {} if axis is None else {"axis": axis}
    attrs.update(epsilon=1e-5, stash_type=1)
    expected = ort_oracle.run_node("SimplifiedLayerNormalizationGrad", args, [T, V], **attrs)
    got = ops.simplified_layer_normalization_grad(*[jnp.asarray(a) for a in args], **attrs)
    close([T, V], got, expected, args[0], args[2], args[3])


@pytest.mark.parametrize("dtype", [f32, f16])
@pytest.mark.parametrize("shape,axis", LN_SHAPES, ids=str)
def test_invertible_layer_normalization_grad(rng, dtype, shape, axis):
    x, mean, inv, scale, bias, dy = _ln_inputs(rng, shape, axis)
    y = (x - mean) * inv * scale + bias
    args = [dy.astype(dtype), y.astype(dtype), scale.astype(dtype), bias.astype(dtype),
            inv.astype(f32)]
    attrs = {} if axis is None else {"axis": axis}
    expected = ort_oracle.run_node("InvertibleLayerNormalizationGrad", args, [dtype] * 3, **attrs)
    got = ops.invertible_layer_normalization_grad(*[jnp.asarray(a) for a in args], **attrs)
    close([dtype] * 3, got, expected, args[0], args[2], args[4], ulps=32)


def test_layer_norm_forward_to_grad_chain(rng):
    # statistics straight from ORT's own LayerNormalization (opset 17, outputs Mean, InvStdDev)
    x = rng.standard_normal((4, 3, 8)).astype(f32)
    scale, bias = rng.standard_normal(8).astype(f32), rng.standard_normal(8).astype(f32)
    _, mean, inv = ort_oracle.run_node("LayerNormalization", [x, scale, bias], [f32] * 3,
                                       domain="", axis=-1, epsilon=1e-5)
    assert mean.shape == (4, 3, 1)
    dy = rng.standard_normal(x.shape).astype(f32)
    expected = ort_oracle.run_node("LayerNormalizationGrad", [dy, x, scale, mean, inv], [f32] * 3,
                                   axis=-1, epsilon=1e-5)
    got = ops.layer_normalization_grad(dy, x, scale, mean, inv, axis=-1, epsilon=1e-5)
    close([f32] * 3, got, expected, dy, scale, inv)


BN_TYPES = [(f32, f32, f32), (f16, f16, f16), (f16, f16, f32), (f16, f32, f32)]  # (T, T1, T2)
BN_IDS = ["f32", "f16", "f16-f16-f32", "f16-f32-f32"]
BN_SHAPES = [(2, 3), (4, 3, 5), (2, 3, 4, 5), (1, 2, 3, 2, 2)]


def _bn_inputs(rng, shape, types):
    T, T1, T2 = types
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(T)
    return (x, rng.uniform(0.5, 1.5, c).astype(T1), rng.standard_normal(c).astype(T1),
            rng.standard_normal(c).astype(T2), rng.uniform(0.5, 2, c).astype(T2))


@pytest.mark.parametrize("types", BN_TYPES, ids=BN_IDS)
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
@pytest.mark.parametrize("attrs", [{}, {"epsilon": 1e-3, "momentum": 0.7}], ids=["default", "eps-mom"])
def test_batch_norm_internal_then_grad(rng, types, shape, attrs):
    T, T1, T2 = types
    inputs = _bn_inputs(rng, shape, types)
    expected = ort_oracle.run_node("BatchNormInternal", list(inputs), [T, T2, T2, T2, T2], **attrs)
    got = ops.batch_norm_internal(*[jnp.asarray(a) for a in inputs], **attrs)
    ulps = 32 if T == f16 else 16
    # x - mean cancels where a channel's values lie close together (two samples a channel at
    # (2, 3)): its rounding, of the size of |x| + |mean|, is amplified by scale * inv_std in y
    # and by inv_std^3 |x - mean| in inv_std.
    xs = np.asarray(inputs[0], np.float64)
    axes = tuple(i for i in range(xs.ndim) if i != 1)
    cshape = [1 if i != 1 else -1 for i in range(xs.ndim)]
    mean = xs.mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(xs.var(axis=axes, keepdims=True) + attrs.get("epsilon", 1e-5))
    terms = np.abs(xs) + np.abs(mean)
    y_scale = np.abs(np.asarray(inputs[1], np.float64).reshape(cshape)) * terms * inv
    inv_scale = (inv**3 * np.abs(xs - mean) * terms).max(axis=axes)
    for k, (g, e, dt) in enumerate(zip(got, expected, [T, T2, T2, T2, T2])):
        assert g.dtype == dt
        e = e.astype(np.float64)
        scale = np.abs(e) + (y_scale if k == 0 else inv_scale) if k in (0, 4) else None
        assert_close(g, e, dt, ulps=ulps, scale=scale)
    # BatchNormalizationGrad on the saved statistics, with the node's epsilon as a real graph has
    dy = rng.standard_normal(shape).astype(T)
    x, scale = inputs[0], inputs[1]
    saved_mean, saved_inv = expected[3], expected[4]
    eps = attrs.get("epsilon", 1e-5)
    expected = ort_oracle.run_node("BatchNormalizationGrad", [dy, x, scale, saved_mean, saved_inv],
                                   [T, T1, T1], epsilon=eps)
    got = ops.batch_normalization_grad(dy, x, scale, saved_mean, saved_inv, epsilon=eps)
    # dScale and dBias are per-channel sums that can cancel (seed 2026-11-25's CI run: dScale
    # 0.11389879 vs ORT's 0.11389828, over a relative bound): scaled by their terms' magnitudes
    dys = np.abs(dy.astype(np.float64))
    xhat = np.abs(xs - np.asarray(saved_mean, np.float64).reshape(cshape)) * np.asarray(
        saved_inv, np.float64).reshape(cshape)
    close([T, T1, T1], got, expected, dy, scale, saved_inv, ulps=ulps,
          sums=[(dys * xhat).sum(axis=axes), dys.sum(axis=axes)])


def test_batch_norm_internal_inference_mode(rng):
    inputs = _bn_inputs(rng, (2, 3, 4), (f32, f32, f32))
    (expected,) = ort_oracle.run_node("BatchNormInternal", list(inputs), [f32], training_mode=0)
    y, *rest = ops.batch_norm_internal(*inputs, training_mode=0)
    assert rest == [None] * 4
    assert_close(y, expected.astype(np.float64), f32, ulps=16)
