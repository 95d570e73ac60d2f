"""The loss ops against onnxruntime-training 1.19.2 itself (CPU, float32)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops
from helpers import assert_close

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

F32 = np.float32
SHAPES = [(5, 4), (3, 4, 2), (2, 3, 2, 2)]
REDUCTIONS = ["mean", "sum", "none"]
# (weights?, ignore_index); ignore_index 1 is a real class
VARIANTS = [(False, None), (True, None), (False, 1), (True, 1)]


def inputs(rng, shape, weighted, ignore_index, label_dtype=np.int64):
    scores = rng.standard_normal(shape).astype(F32)
    labels = rng.integers(0, shape[1], (shape[0],) + shape[2:]).astype(label_dtype)
    if ignore_index is not None:
        labels.flat[0] = ignore_index  # at least one ignored sample
    weights = (rng.random(shape[1]) + 0.1).astype(F32) if weighted else None
    return scores, labels, weights


def attrs_of(reduction, ignore_index):
    a = {"reduction": reduction}
    if ignore_index is not None:
        a["ignore_index"] = ignore_index
    return a


def close(got, want, ulps=16):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want.astype(np.float64), jnp.float32, ulps=ulps)


@pytest.mark.parametrize("opset", [12, 13])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weighted,ignore_index", VARIANTS, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_softmax_cross_entropy_loss_and_grad(rng, opset, shape, weighted, ignore_index, reduction):
    s, l, w = inputs(rng, shape, weighted, ignore_index, np.int64 if opset == 13 else np.int32)
    feeds = [s, l] + ([w] if weighted else [])
    attrs = attrs_of(reduction, ignore_index)
    y, lp = ort_oracle.run_node("SoftmaxCrossEntropyLoss", feeds, out_dtypes=[F32, F32],
                                domain="", opset=opset, **attrs)
    gy, glp = ops.softmax_cross_entropy_loss(*feeds, **attrs)
    close(np.asarray(gy), y, ulps=32)
    close(np.asarray(glp), lp)
    dy = rng.standard_normal(l.shape if reduction == "none" else ()).astype(F32)
    (d,) = ort_oracle.run_node("SoftmaxCrossEntropyLossGrad", [dy, lp, l] + feeds[2:], **attrs)
    close(np.asarray(ops.softmax_cross_entropy_loss_grad(dy, lp, l, *feeds[2:], **attrs)), d)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted,ignore_index", VARIANTS, ids=str)
def test_internal_ops(rng, reduction, weighted, ignore_index):
    # the pair generate_artifacts emits for a CrossEntropyLoss: ignore_index is an input
    s, l, w = inputs(rng, (4, 5, 3), weighted, ignore_index)
    ii = None if ignore_index is None else np.array(ignore_index, np.int64)
    feeds = [s, l, w, ii]  # jaxops: absent inputs are None
    # ORT: trailing absent inputs are left off; an absent weight before a present
    # ignore_index is fed as ones, which means the same
    ort_feeds = [s, l] + ([w] if weighted else [np.ones(5, F32)] if ii is not None else [])
    ort_feeds += [ii] if ii is not None else []
    y, lp = ort_oracle.run_node("SoftmaxCrossEntropyLossInternal", ort_feeds,
                                out_dtypes=[F32, F32], reduction=reduction)
    gy, glp = ops.softmax_cross_entropy_loss_internal(*feeds, reduction=reduction)
    close(np.asarray(gy), y, ulps=32)
    close(np.asarray(glp), lp)
    dy = rng.standard_normal(l.shape if reduction == "none" else ()).astype(F32)
    bias = rng.standard_normal(s.shape).astype(F32)
    grad_feeds = [dy, lp, l] + ort_feeds[2:]
    (d,) = ort_oracle.run_node("SoftmaxCrossEntropyLossInternalGrad", grad_feeds,
                               reduction=reduction)
    close(np.asarray(ops.softmax_cross_entropy_loss_internal_grad(
        dy, lp, l, *feeds[2:], reduction=reduction)), d)
    if len(ort_feeds) == 4:  # with all optional inputs present, also the fused bias
        (db,) = ort_oracle.run_node("SoftmaxCrossEntropyLossInternalGrad", grad_feeds + [bias],
                                    reduction=reduction)
        close(np.asarray(ops.softmax_cross_entropy_loss_internal_grad(
            dy, lp, l, *feeds[2:], bias, reduction=reduction)), db)


def test_all_ignored_mean_matches_ort(rng):
    s = rng.standard_normal((3, 4)).astype(F32)
    l = np.full((3,), -1, np.int64)
    y, lp = ort_oracle.run_node("SoftmaxCrossEntropyLoss", [s, l], out_dtypes=[F32, F32],
                                domain="", opset=13, ignore_index=-1)
    assert float(y) == 0.0
    assert float(ops.softmax_cross_entropy_loss(s, l, ignore_index=-1)[0]) == 0.0
    (d,) = ort_oracle.run_node("SoftmaxCrossEntropyLossGrad", [F32(1), lp, l], ignore_index=-1)
    np.testing.assert_array_equal(ops.softmax_cross_entropy_loss_grad(F32(1), lp, l,
                                                                      ignore_index=-1), d)


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 6)], ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sparse_softmax_cross_entropy(rng, shape, weighted, reduction):
    x = rng.standard_normal(shape).astype(F32)
    l = rng.integers(0, shape[-1], shape[:-1]).astype(np.int64)
    feeds = [x, l] + ([(rng.random(shape[:-1]) + 0.1).astype(F32)] if weighted else [])
    y, lp = ort_oracle.run_node("SparseSoftmaxCrossEntropy", feeds, out_dtypes=[F32, F32],
                                domain="", opset=9, reduction=reduction)
    gy, glp = ops.sparse_softmax_cross_entropy(*feeds, reduction=reduction)
    close(np.asarray(gy), y, ulps=32)
    close(np.asarray(glp), lp)
    dy = rng.standard_normal(()).astype(F32)
    (d,) = ort_oracle.run_node("SparseSoftmaxCrossEntropyGrad", [dy, lp, l] + feeds[2:],
                               domain="", opset=9, reduction=reduction)
    close(np.asarray(ops.sparse_softmax_cross_entropy_grad(dy, lp, l, *feeds[2:],
                                                           reduction=reduction)), d)


def test_sparse_none_follows_the_schema_not_ort_cpu(rng):
    # ORT 1.19.2's CPU kernel returns the SUM for reduction='none'; jaxops returns per-sample
    # losses (label's shape, as the schema and the CUDA kernel); their sum is ORT's number.
    x = rng.standard_normal((4, 5)).astype(F32)
    l = rng.integers(0, 5, (4,)).astype(np.int64)
    y, _ = ort_oracle.run_node("SparseSoftmaxCrossEntropy", [x, l], out_dtypes=[F32, F32],
                               domain="", opset=9, reduction="none")
    got, _ = ops.sparse_softmax_cross_entropy(x, l, reduction="none")
    assert got.shape == (4,) and np.asarray(y).shape == ()
    np.testing.assert_allclose(np.sum(got), y, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 6)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_soft_label_softmax_cross_entropy(rng, shape, reduction):
    x = rng.standard_normal(shape).astype(F32)
    lab = rng.random(shape).astype(F32)
    lab /= lab.sum(-1, keepdims=True)
    y, lp = ort_oracle.run_node("SoftmaxCrossEntropy", [x, lab], out_dtypes=[F32, F32],
                                reduction=reduction)
    gy, glp = ops.softmax_cross_entropy(x, lab, reduction=reduction)
    close(np.asarray(gy), y, ulps=32)
    close(np.asarray(glp), lp)
    dy = rng.standard_normal(()).astype(F32)
    (d,) = ort_oracle.run_node("SoftmaxCrossEntropyGrad", [dy, lp, lab], reduction=reduction)
    close(np.asarray(ops.softmax_cross_entropy_grad(dy, lp, lab, reduction=reduction)), d)
