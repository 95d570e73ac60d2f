"""Softmax cross-entropy losses (ORT ops) and jaxops.nn.cross_entropy."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import ops
from jaxops.reference import loss as ref
from helpers import DTYPE_IDS, FLOAT_DTYPES, assert_close, on_cpu_devices

SHAPES = [(5, 7), (2, 5, 3, 2), (1, 1), (3, 1001)]
REDUCTIONS = ["mean", "sum", "none"]
# (weights?, ignore_index, reduction): ignore_index 2 is a real class, so some samples are
# ignored; every reduction meets weights and ignore_index
VARIANTS = [(False, None, "mean"), (True, 2, "mean"), (False, -100, "sum"), (True, 2, "none")]
VARIANT_IDS = ["plain-mean", "weights-ignore2-mean", "ignore-100-sum", "weights-ignore2-none"]
# (weighted, reduction) pairs for the smaller matrices
WEIGHTED_REDUCTIONS = [(False, "mean"), (True, "sum"), (True, "none")]


def make(rng, shape, dtype, weights, ignore_index, label_dtype=jnp.int64):
    c = shape[1]
    scores = jnp.asarray(rng.standard_normal(shape) * 2, dtype)
    labels = rng.integers(0, c, (shape[0],) + shape[2:])
    if ignore_index is not None:
        labels = np.where(rng.random(labels.shape) < 0.3, ignore_index, labels)
    w = jnp.asarray(rng.random(c) + 0.1, dtype) if weights else None
    return scores, jnp.asarray(labels, label_dtype), w


def f64(x):
    return None if x is None else jnp.asarray(x, jnp.float64)


def dy_for(rng, reduction, labels, dtype):
    if reduction == "none":
        return jnp.asarray(rng.standard_normal(labels.shape), dtype)
    return jnp.asarray(rng.standard_normal(), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weights,ignore_index,reduction", VARIANTS, ids=VARIANT_IDS)
def test_loss_and_grad_match_reference(rng, dtype, shape, weights, ignore_index, reduction):
    s, l, w = make(rng, shape, dtype, weights, ignore_index)
    y, lp = ops.softmax_cross_entropy_loss(s, l, w, reduction=reduction, ignore_index=ignore_index)
    ey, elp = ref.softmax_cross_entropy_loss(f64(s), l, f64(w), reduction=reduction,
                                             ignore_index=ignore_index)
    assert y.dtype == dtype and lp.dtype == dtype and lp.shape == shape
    assert y.shape == (l.shape if reduction == "none" else ())
    assert_close(lp, elp, dtype)
    assert_close(y, ey, dtype, ulps=32)
    dy = dy_for(rng, reduction, l, dtype)
    d = ops.softmax_cross_entropy_loss_grad(dy, lp, l, w, reduction=reduction,
                                            ignore_index=ignore_index)
    e = ref.softmax_cross_entropy_loss_grad(f64(dy), f64(lp), l, f64(w), reduction=reduction,
                                            ignore_index=ignore_index)
    assert d.dtype == dtype and d.shape == shape
    assert_close(d, e, dtype, ulps=16)


def test_loss_formula_by_hand():
    # [N=2, C=3, d=2] against an explicit loop (mean over non-ignored, weighted)
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 3, 2))
    l = np.array([[0, 2], [1, 1]])
    w = np.array([0.5, 2.0, 3.0])
    lp = s - np.log(np.exp(s).sum(1, keepdims=True))
    num = den = 0.0
    for i in range(2):
        for k in range(2):
            if l[i, k] == 2:  # ignored
                continue
            num -= w[l[i, k]] * lp[i, l[i, k], k]
            den += w[l[i, k]]
    y, _ = ops.softmax_cross_entropy_loss(s, l, w, ignore_index=2)
    np.testing.assert_allclose(y, num / den, rtol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_is_zero_not_nan(reduction):
    s = jnp.ones((3, 4), jnp.float32)
    l = jnp.full((3,), -100)
    for w in (None, jnp.ones((4,), jnp.float32)):
        y, lp = ops.softmax_cross_entropy_loss(s, l, w, reduction=reduction, ignore_index=-100)
        np.testing.assert_array_equal(y, np.zeros(y.shape))
        dy = jnp.ones(l.shape if reduction == "none" else (), jnp.float32)
        d = ops.softmax_cross_entropy_loss_grad(dy, lp, l, w, reduction=reduction,
                                                ignore_index=-100)
        np.testing.assert_array_equal(d, np.zeros((3, 4)))
    f = lambda x: jaxops.nn.cross_entropy(x, l, ignore_index=-100, reduction=reduction).sum()
    assert float(f(s)) == 0.0
    np.testing.assert_array_equal(jax.grad(f)(s), np.zeros((3, 4)))


def test_zero_weight_sum_mean_is_zero():
    # ORT 1.19.2: mean with weights summing to 0 over the non-ignored samples gives 0
    s = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4)))
    l = jnp.asarray([0, 1, 2])
    w = jnp.asarray([0.0, 0.0, 0.0, 1.0])
    y, lp = ops.softmax_cross_entropy_loss(s, l, w)
    assert float(y) == 0.0
    np.testing.assert_array_equal(ops.softmax_cross_entropy_loss_grad(1.0, lp, l, w), 0)


@pytest.mark.parametrize("bad", [5, -3, 2**31 + 1])
def test_out_of_range_label_is_nan_and_safe(bad):
    # defined behaviour: that sample's loss and gradient row are NaN; other rows unaffected
    s = jnp.asarray(np.random.default_rng(2).standard_normal((4, 5)), jnp.float32)
    l = jnp.asarray([0, bad, 4, 1], jnp.int64)
    y, lp = ops.softmax_cross_entropy_loss(s, l, reduction="none")
    assert np.isnan(y[1]) and np.isfinite(np.delete(np.asarray(y), 1)).all()
    assert np.isfinite(lp).all()
    assert np.isnan(ops.softmax_cross_entropy_loss(s, l)[0])
    d = ops.softmax_cross_entropy_loss_grad(jnp.ones(4, jnp.float32), lp, l, reduction="none")
    assert np.isnan(d[1]).all() and np.isfinite(np.delete(np.asarray(d), 1, 0)).all()
    # ignore_index wins over the range check
    y2, _ = ops.softmax_cross_entropy_loss(s, l, ignore_index=bad)
    assert np.isfinite(y2)
    ys, _ = ops.sparse_softmax_cross_entropy(s, l, reduction="none")
    assert np.isnan(ys[1]) and np.isfinite(ys[0])
    ce = jaxops.nn.cross_entropy(s, l, reduction="none")
    assert np.isnan(ce[1]) and np.isfinite(ce[0])
    g = jax.grad(lambda x: jaxops.nn.cross_entropy(x, l, reduction="sum"))(s)
    assert np.isnan(g[1]).all() and np.isfinite(g[0]).all()
    # same answer on the reference path
    ref_y, _ = ref.softmax_cross_entropy_loss(s, l, reduction="none")
    np.testing.assert_array_equal(np.isnan(ref_y), np.isnan(y))


@pytest.mark.parametrize("dtype,out_type,out_dtype", [
    (jnp.float32, None, jnp.float32), (jnp.float16, 1, jnp.float32),
    (jnp.float16, None, jnp.float16), (jnp.bfloat16, 16, jnp.bfloat16),
    (jnp.float32, 10, jnp.float16), (jnp.float64, 11, jnp.float64)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_internal_ops(rng, dtype, out_type, out_dtype, reduction):
    s, l, w = make(rng, (6, 5, 2), dtype, True, 3)
    ii = jnp.asarray(3, jnp.int64)
    y, lp = ops.softmax_cross_entropy_loss_internal(s, l, w, ii, reduction=reduction,
                                                    output_type=out_type)
    ey, elp = ref.softmax_cross_entropy_loss(f64(s), l, f64(w), reduction=reduction,
                                             ignore_index=3)
    assert y.dtype == out_dtype and lp.dtype == out_dtype
    tol_dtype = dtype if jnp.finfo(dtype).eps > jnp.finfo(out_dtype).eps else out_dtype
    assert_close(lp, elp, tol_dtype)
    assert_close(y, ey, tol_dtype, ulps=32)
    # ignore_index may be a traced value
    y_jit, _ = jax.jit(lambda i: ops.softmax_cross_entropy_loss_internal(
        s, l, w, i, reduction=reduction, output_type=out_type))(ii)
    # a different XLA program: on GPU its row sum may round differently (1 ulp seen on an H100)
    assert_close(y_jit, y, tol_dtype, ulps=4)
    # without ignore_index nothing is ignored
    y_none, _ = ops.softmax_cross_entropy_loss_internal(s, l, w, None, reduction=reduction,
                                                        output_type=out_type)
    e_none, _ = ref.softmax_cross_entropy_loss(f64(s), l, f64(w), reduction=reduction)
    assert_close(y_none, e_none, tol_dtype, ulps=32)
    # the gradient: log_prob of the forward's dtype, output cast, optional bias
    dy = dy_for(rng, reduction, l, lp.dtype)
    bias = jnp.asarray(rng.standard_normal(s.shape), out_dtype)
    for b in (None, bias):
        d = ops.softmax_cross_entropy_loss_internal_grad(dy, lp, l, w, ii, b,
                                                         reduction=reduction,
                                                         output_type=out_type)
        e = ref.softmax_cross_entropy_loss_grad(f64(dy), f64(lp), l, f64(w), reduction=reduction,
                                                ignore_index=3, bias=f64(b))
        assert d.dtype == out_dtype and d.shape == s.shape
        assert_close(d, e, tol_dtype, ulps=16)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 7), (4, 1001)], ids=str)
@pytest.mark.parametrize("weighted,reduction", WEIGHTED_REDUCTIONS)
def test_sparse(rng, dtype, shape, weighted, reduction):
    x = jnp.asarray(rng.standard_normal(shape) * 2, dtype)
    l = jnp.asarray(rng.integers(0, shape[-1], shape[:-1]))
    w = jnp.asarray(rng.random(shape[:-1]) + 0.1, dtype) if weighted else None
    y, lp = ops.sparse_softmax_cross_entropy(x, l, w, reduction=reduction)
    ey, elp = ref.sparse_softmax_cross_entropy(f64(x), l, f64(w), reduction=reduction)
    assert y.dtype == dtype and y.shape == (l.shape if reduction == "none" else ())
    assert_close(lp, elp, dtype)
    assert_close(y, ey, dtype, ulps=32)
    # the definition: -w_i * log_prob[i, l_i], summed / averaged by hand
    nll = -np.take_along_axis(np.asarray(elp), np.asarray(l)[..., None], -1)[..., 0]
    ww = np.ones(l.shape) if w is None else np.asarray(f64(w))
    want = {"none": ww * nll, "sum": (ww * nll).sum(), "mean": (ww * nll).sum() / ww.sum()}
    np.testing.assert_allclose(ey, want[reduction], rtol=1e-12)
    dy = dy_for(rng, reduction, l, dtype)
    d = ops.sparse_softmax_cross_entropy_grad(dy, lp, l, w, reduction=reduction)
    e = ref.sparse_softmax_cross_entropy_grad(f64(dy), f64(lp), l, f64(w), reduction=reduction)
    assert d.dtype == dtype
    assert_close(d, e, dtype, ulps=16)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_soft_labels(rng, dtype, reduction):
    x = jnp.asarray(rng.standard_normal((3, 4, 6)), dtype)
    lab = jax.nn.softmax(jnp.asarray(rng.standard_normal((3, 4, 6))), -1).astype(dtype)
    y, lp = ops.softmax_cross_entropy(x, lab, reduction=reduction)
    x64, lab64 = f64(x), f64(lab)
    lp64 = jax.nn.log_softmax(x64, -1)
    per = -(lab64 * lp64).sum(-1)
    want = {"none": per, "sum": per.sum(), "mean": per.mean()}[reduction]
    assert_close(lp, lp64, dtype)
    assert_close(y, want, dtype, ulps=32)
    dy = dy_for(rng, reduction, per, dtype)
    d = ops.softmax_cross_entropy_grad(dy, lp, lab, reduction=reduction)
    g = f64(dy)[..., None] if reduction == "none" else f64(dy) / (12 if reduction == "mean" else 1)
    assert_close(d, g * (jnp.exp(f64(lp)) - lab64), dtype, ulps=16)


def test_log_prob_not_requested(rng):
    s, l, _ = make(rng, (4, 9), jnp.float32, False, None)
    y, lp = ops.softmax_cross_entropy_loss(s, l, return_log_prob=False)
    assert lp is None
    np.testing.assert_allclose(y, ops.softmax_cross_entropy_loss(s, l)[0], rtol=1e-6)
    jaxpr = str(jax.make_jaxpr(lambda s: ops.softmax_cross_entropy_loss(
        s, l, return_log_prob=False)[0])(s))
    assert "jaxops_softmax_cross_entropy_rows " in jaxpr and "log_prob" not in jaxpr


def test_kernels_run(rng):
    # (jit against eager: tests/test_op_matrix.py)
    s, l, w = make(rng, (6, 5, 3), jnp.float32, True, 1)
    fn = functools.partial(ops.softmax_cross_entropy_loss, ignore_index=1)
    out = fn(s, l, w)
    assert "jaxops_softmax_cross_entropy_rows_log_prob" in str(jax.make_jaxpr(fn)(s, l, w))
    g = jax.jit(functools.partial(ops.softmax_cross_entropy_loss_grad, ignore_index=1))
    assert "jaxops_softmax_cross_entropy_rows_grad" in str(jax.make_jaxpr(g)(out[0], out[1], l, w))


def test_label_dtypes_agree(rng):
    s, l, w = make(rng, (5, 4, 3), jnp.float32, True, 0)
    a = ops.softmax_cross_entropy_loss(s, l, w, ignore_index=0)
    b = ops.softmax_cross_entropy_loss(s, l.astype(jnp.int32), w, ignore_index=0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


VMAP_AXES = [(0, 0, None), (None, 0, None), (0, None, None), (1, 1, None), (0, 0, 0),
             (None, None, 0)]


@pytest.mark.parametrize("in_axes,reduction", list(zip(VMAP_AXES, REDUCTIONS * 2)), ids=str)
def test_vmap(rng, in_axes, reduction):
    b = 3
    s, l, w = make(rng, (4, 5, 2), jnp.float64, True, 1)
    def batched(a, ax, noise):
        if ax is None:
            return a
        stack = jnp.stack([a + (i * noise if noise else 0) for i in range(b)])
        return jnp.moveaxis(stack, 0, ax)
    lb = jnp.stack([jnp.roll(l, i) for i in range(b)])
    args = (batched(s, in_axes[0], 0.1),
            l if in_axes[1] is None else jnp.moveaxis(lb, 0, in_axes[1]),
            batched(w, in_axes[2], 0.2))
    fn = lambda f: lambda s, l, w: f(s, l, w, reduction=reduction, ignore_index=1)
    got = jax.vmap(fn(ops.softmax_cross_entropy_loss), in_axes)(*args)
    want = jax.vmap(fn(ref.softmax_cross_entropy_loss), in_axes)(*args)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    # the gradient op and nn.cross_entropy under vmap too
    dy = jnp.ones(l.shape) if reduction == "none" else jnp.float64(0.7)
    gfn = lambda f: lambda lp, l, w: f(dy, lp, l, w, reduction=reduction, ignore_index=1)
    lp_b = got[1]  # batched on axis 0 (every pattern batches something)
    np.testing.assert_allclose(
        jax.vmap(gfn(ops.softmax_cross_entropy_loss_grad), (0,) + in_axes[1:])(lp_b, *args[1:]),
        jax.vmap(gfn(ref.softmax_cross_entropy_loss_grad), (0,) + in_axes[1:])(lp_b, *args[1:]),
        rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)], ids=str)
def test_vmap_of_grad(rng, in_axes):
    s = jnp.asarray(rng.standard_normal((3, 4, 6)))  # [batch, rows, C]
    l = jnp.asarray(rng.integers(0, 6, (3, 4))).at[0, 1].set(-100)
    args = (s if in_axes[0] == 0 else s[0], l if in_axes[1] == 0 else l[0])
    for f in (lambda x, l: jaxops.nn.cross_entropy(x, l, ignore_index=-100),
              lambda x, l: ops.softmax_cross_entropy_loss(x, l, ignore_index=-100)[0]):
        got = jax.vmap(jax.grad(f), in_axes)(*args)
        ref_f = lambda x, l: ref.cross_entropy(x, l, None, -100)
        want = jax.vmap(jax.grad(ref_f), in_axes)(*args)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _grad_cases(rng):
    s, l, w = make(rng, (3, 4, 2), jnp.float64, True, 1)
    _, lp = ops.softmax_cross_entropy_loss(s, l, w, ignore_index=1)
    x = jnp.asarray(rng.standard_normal((5, 6)))
    lab = jnp.asarray([0, 5, -100, 2, 3])
    wc = jnp.asarray(rng.random(6) + 0.5)
    return {
        "loss-mean": (lambda s, w: ops.softmax_cross_entropy_loss(s, l, w, ignore_index=1)[0],
                      (s, w), ("fwd", "rev")),
        "nn-mean": (lambda x, wc: jaxops.nn.cross_entropy(x, lab, wc, -100), (x, wc), ("rev",)),
        "nn-none": (lambda x: jaxops.nn.cross_entropy(x, lab, None, -100, "none"), (x,), ("rev",)),
    }


# The ops' per-sample ('none') outputs, every op's gradient op included, in fwd and rev mode:
# tests/test_op_matrix.py; here the mean's weights and jaxops.nn.cross_entropy.
@pytest.mark.parametrize("case", ["loss-mean", "nn-mean", "nn-none"])
def test_check_grads_order2(rng, case):
    fn, args, modes = _grad_cases(rng)[case]
    # jitted: check_grads' many evaluations then run compiled code (eager is far slower)
    check_grads(jax.jit(fn), args, order=2, modes=modes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("weighted,reduction", WEIGHTED_REDUCTIONS)
def test_nn_cross_entropy(rng, dtype, weighted, reduction):
    x = jnp.asarray(rng.standard_normal((3, 7, 33)) * 2, dtype)
    l = jnp.asarray(rng.integers(0, 33, (3, 7)))
    l = jnp.where(jnp.asarray(rng.random((3, 7)) < 0.1), -100, l)
    w = jnp.asarray(rng.random(33) + 0.1, dtype) if weighted else None
    f = lambda impl: lambda x, w: impl(x, l, w, -100, reduction)
    y = f(jaxops.nn.cross_entropy)(x, w)
    e = f(ref.cross_entropy)(f64(x), f64(w))
    assert y.dtype == dtype and y.shape == (l.shape if reduction == "none" else ())
    assert_close(y, e, dtype, ulps=32)
    ct = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)  # a linear probe
    loss = lambda impl: lambda x, w: jnp.sum(f(impl)(x, w).astype(jnp.float32) * ct)
    gx, gw = jax.grad(loss(jaxops.nn.cross_entropy), (0, 1))(x, w) if weighted else \
        (jax.grad(loss(jaxops.nn.cross_entropy))(x, w), None)
    ex = jax.grad(loss(ref.cross_entropy))(f64(x), f64(w))
    assert gx.dtype == dtype
    assert_close(gx, ex, dtype, ulps=32)
    if weighted:
        ew = jax.grad(loss(ref.cross_entropy), 1)(f64(x), f64(w))
        assert_close(gw, ew, dtype, ulps=64)


def test_nn_cross_entropy_backward_never_writes_log_prob(rng):
    x = jnp.asarray(rng.standard_normal((8, 50)), jnp.float32)
    l = jnp.asarray(rng.integers(0, 50, 8))
    grad = jax.grad(lambda x: jaxops.nn.cross_entropy(x, l, ignore_index=-100))
    jaxpr = str(jax.make_jaxpr(grad)(x))
    assert "jaxops_softmax_cross_entropy_rows " in jaxpr
    assert "jaxops_softmax_cross_entropy_rows_grad" in jaxpr
    # the only [rows, C] values are the logits and the gradient kernel's output (reshaped)
    producers = set(re.findall(r":f32\[8,50\] = ([\w]+)", jaxpr))
    assert producers <= {"jaxops_softmax_cross_entropy_rows_grad", "reshape"}, producers


@pytest.mark.parametrize("spec", [P("x"), P("x", None, None)], ids=str)
def test_sharded_input_is_not_gathered(rng, spec):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    s, l, w = make(rng, (8, 5, 3), jnp.float32, True, 1)
    sh = NamedSharding(mesh, spec)
    s_s, l_s = jax.device_put(s, sh), jax.device_put(l, NamedSharding(mesh, P("x")))
    for fn in (jax.jit(lambda s, l: ops.softmax_cross_entropy_loss(s, l, w, ignore_index=1,
                                                                   reduction="none")),
               jax.jit(lambda s, l: ops.softmax_cross_entropy_loss_grad(
                   jnp.float32(1), s, l, w, ignore_index=1))):
        hlo = fn.lower(s_s, l_s).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo
        out = fn(s_s, l_s)
        want = fn(s, l)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out, want)


def test_sharded_nn_cross_entropy_grad(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    l = jnp.asarray(rng.integers(0, 40, 16))
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ls = jax.device_put(l, NamedSharding(mesh, P("x")))
    grad = jax.jit(jax.grad(lambda x, l: jaxops.nn.cross_entropy(x, l)))
    hlo = grad.lower(xs, ls).compile().as_text()
    assert "all-gather" not in hlo
    g = grad(xs, ls)
    assert g.sharding.spec[0] == "x"
    np.testing.assert_allclose(g, jax.grad(lambda x: ref.cross_entropy(x, l))(x), rtol=1e-5,
                               atol=1e-7)


def test_bad_input():
    f32 = jnp.ones((2, 3), jnp.float32)
    lab = jnp.zeros((2,), jnp.int64)
    sce = ops.softmax_cross_entropy_loss
    cases = [
        (sce, (jnp.ones((2, 3), jnp.int32), lab), {}, TypeError, "scores must be float"),
        (sce, (jnp.ones((3,), jnp.float32), lab), {}, ValueError, "rank >= 2"),
        (sce, (f32, lab.astype(jnp.float32)), {}, TypeError, "labels must be int32 or int64"),
        (sce, (f32, jnp.zeros((3,), jnp.int64)), {}, ValueError, "labels must have shape"),
        (sce, (f32, lab, jnp.ones((4,), jnp.float32)), {}, ValueError, "weights must have shape"),
        (sce, (f32, lab, jnp.ones((3,), jnp.float64)), {}, TypeError,
         "scores and weights must share one dtype"),
        (sce, (f32, lab), {"reduction": "avg"}, ValueError, "reduction must be"),
        (sce, (f32, lab), {"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        (ops.softmax_cross_entropy_loss_internal, (f32, lab, None, jnp.float32(1)), {},
         TypeError, "ignore_index must be int32 or int64"),
        (ops.softmax_cross_entropy_loss_internal, (f32, lab), {"output_type": 7},
         ValueError, "output_type"),
        (ops.softmax_cross_entropy_loss_grad, (jnp.ones(2, jnp.float32), f32, lab), {},
         ValueError, "dY must be a scalar"),
        (ops.softmax_cross_entropy_loss_grad, (jnp.float32(1), f32, lab), {"reduction": "none"},
         ValueError, "dY must have shape"),
        (ops.softmax_cross_entropy_loss_internal_grad,
         (jnp.float32(1), f32, lab, None, None, jnp.ones((2, 3), jnp.float16)), {},
         TypeError, "bias must have dtype"),
        (ops.sparse_softmax_cross_entropy, (f32, jnp.zeros((3,), jnp.int64)), {}, ValueError,
         "label must have shape"),
        (ops.sparse_softmax_cross_entropy, (f32, lab, jnp.ones((3,), jnp.float32)), {},
         ValueError, "weight must have shape"),
        (ops.softmax_cross_entropy, (f32, jnp.ones((2, 4), jnp.float32)), {}, ValueError,
         "label must have shape"),
        (ops.softmax_cross_entropy_grad, (jnp.float32(1), f32, f32.astype(jnp.float16)), {},
         TypeError, "log_prob and label must share one dtype"),
        (jaxops.nn.cross_entropy, (f32, jnp.zeros((3,), jnp.int64)), {}, ValueError,
         "labels must have shape"),
    ]
    for fn, args, kwargs, error, text in cases:
        name = fn.__name__
        with pytest.raises(error, match=text) as info:
            fn(*args, **kwargs)
        assert f"jaxops.ops.{name}" in str(info.value)
        with pytest.raises(error, match=text):  # also at trace time under jit
            jax.jit(functools.partial(fn, **kwargs))(*args)


def test_disable_routes_to_reference(rng, monkeypatch):
    s, l, w = make(rng, (4, 9), jnp.float32, True, 2)
    trace = lambda: str(jax.make_jaxpr(
        lambda s: ops.softmax_cross_entropy_loss(s, l, w, ignore_index=2))(s))
    expected = ref.softmax_cross_entropy_loss(s, l, w, ignore_index=2)
    for value in ("all", "softmax_cross_entropy_loss"):
        monkeypatch.setenv("JAXOPS_DISABLE", value)
        assert "jaxops_softmax_cross_entropy_rows" not in trace()
        np.testing.assert_allclose(ops.softmax_cross_entropy_loss(s, l, w, ignore_index=2)[0],
                                   expected[0], rtol=1e-6)
    monkeypatch.setenv("JAXOPS_DISABLE", "cross_entropy")
    assert "jaxops_" not in str(jax.make_jaxpr(lambda s: jaxops.nn.cross_entropy(s, l))(s))
    monkeypatch.setenv("JAXOPS_DISABLE", "softmax_grad")
    assert "jaxops_softmax_cross_entropy_rows" in trace()


def test_ort_ops_table():
    ms = "com.microsoft"
    table = {
        ("", "SoftmaxCrossEntropyLoss"): ops.softmax_cross_entropy_loss,
        ("", "SparseSoftmaxCrossEntropy"): ops.sparse_softmax_cross_entropy,
        ("", "SparseSoftmaxCrossEntropyGrad"): ops.sparse_softmax_cross_entropy_grad,
        (ms, "SoftmaxCrossEntropyLossGrad"): ops.softmax_cross_entropy_loss_grad,
        (ms, "SoftmaxCrossEntropyLossInternal"): ops.softmax_cross_entropy_loss_internal,
        (ms, "SoftmaxCrossEntropyLossInternalGrad"): ops.softmax_cross_entropy_loss_internal_grad,
        (ms, "SoftmaxCrossEntropy"): ops.softmax_cross_entropy,
        (ms, "SoftmaxCrossEntropyGrad"): ops.softmax_cross_entropy_grad,
    }
    for key, fn in table.items():
        assert ops.ORT_OPS[key] is fn


# Long rows, aligned and not: the CUDA kernels' vector and scalar paths, several block sizes
LARGE = [(2, 50304), (3, 32001), (33, 7)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", LARGE, ids=str)
def test_large_rows(rng, dtype, shape):
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    l = jnp.asarray(rng.integers(0, shape[1], shape[:1]))
    l = l.at[0].set(-100)
    f = lambda impl: lambda x: impl(x, l, None, -100, "sum")
    assert_close(f(jaxops.nn.cross_entropy)(x), f(ref.cross_entropy)(f64(x)), dtype, ulps=64)
    assert_close(jax.grad(f(jaxops.nn.cross_entropy))(x), jax.grad(f(ref.cross_entropy))(f64(x)),
                 dtype, ulps=32)
    y, lp = ops.softmax_cross_entropy_loss(x, l, ignore_index=-100, reduction="none")
    _, elp = ref.softmax_cross_entropy_loss(f64(x), l, ignore_index=-100, reduction="none")
    assert_close(lp, elp, dtype, ulps=16)


def test_deterministic(rng):
    x = jnp.asarray(rng.standard_normal((64, 3000)), jnp.float32)
    l = jnp.asarray(rng.integers(0, 3000, 64))
    f = jax.jit(jax.value_and_grad(lambda x: jaxops.nn.cross_entropy(x, l)))
    a, b = f(x), f(x)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_row_kernels_ignore_labels_outside_the_row(rng):
    # the kernels themselves: a label outside [0, C) is never used as an address (nll 0, no
    # one-hot term); the ops above turn such samples into NaN or ignore them
    from jaxops.ops.loss import rows_forward, rows_grad
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    l = jnp.asarray([6, -1, 2**31 - 1, -2**31], jnp.int32)
    nll, lse, lp = rows_forward(x, l, jnp.float32)
    np.testing.assert_array_equal(nll, np.zeros(4))
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(x, axis=-1), rtol=1e-6, atol=1e-6)
    d = rows_grad(jnp.ones(4, jnp.float32), x, lse, l, out_dtype=jnp.float32)
    np.testing.assert_allclose(d, jax.nn.softmax(x, axis=-1), rtol=1e-6, atol=1e-7)
