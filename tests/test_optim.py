"""AdamWOptimizer / SGDOptimizerV2 (multi-tensor kernels) against the references, plus the
XLA-coded optimizers (Adam, SGD, LAMB, InplaceClipGradNorm) against the spec's formulas:
dtypes, jit, donation/aliasing, vmap, sharding, bad input (jit and JAXOPS_DISABLE of the ops
with a row there: the op matrix, tests/test_op_matrix.py)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, on_cpu_devices
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxops import ops
from jaxops.reference import optim as ref

SHAPES = [(3, 4), (2, 3, 2), (), (0,)]


def make_lists(rng, shapes=SHAPES, wdtype=jnp.float32, gdtype=None):
    gdtype = gdtype or wdtype
    new = lambda s, scale=1.0: scale * rng.standard_normal(s)
    w = [jnp.asarray(new(s), wdtype) for s in shapes]
    g = [jnp.asarray(new(s), gdtype) for s in shapes]
    m1 = [jnp.asarray(new(s, 0.1), wdtype) for s in shapes]
    m2 = [jnp.asarray(np.abs(new(s, 0.1)), wdtype) for s in shapes]
    return w, g, m1, m2


LR = jnp.asarray([0.05], jnp.float32)
STEP = jnp.asarray([3], jnp.int32)

DTYPES = [(jnp.float32, None), (jnp.float64, None), (jnp.float16, None), (jnp.bfloat16, None),
          (jnp.float32, jnp.float16), (jnp.float32, jnp.bfloat16)]
DTYPE_IDS = ["f32", "f64", "f16", "bf16", "f32w-f16g", "f32w-bf16g"]


def assert_lists(actual, expected, dtype, ulps=2, before=None):
    """Within `ulps` of each entry, or of the tensor's magnitude before the update (`before`):
    an update that cancels most of a weight leaves the rounding of the weight's size."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        if before is None:
            assert_close(a, e, dtype, ulps=ulps)
            continue
        eps = float(jnp.finfo(dtype).eps)
        scale = float(np.max(np.abs(np.asarray(before[i], np.float64)), initial=0))
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                                   rtol=ulps * eps, atol=ulps * eps * scale)


MODES = [(0, 1, 0.0), (0, 1, 0.01), (1, 1, 0.0), (1, 0, 0.01), (1, 1, 0.1)]
# every mode in f32, every dtype in the two modes ORT graphs use
CASES = ([(jnp.float32, None, *m) for m in MODES]
         + [(w, g, *m) for w, g in DTYPES[1:] for m in (MODES[1], MODES[2])])
adamw_ref = jax.jit(ref.adamw_optimizer, static_argnames=(
    "alpha", "beta", "epsilon", "weight_decay", "correct_bias", "adam_mode"))
sgd_ref = jax.jit(ref.sgd_optimizer_v2)


@pytest.mark.parametrize("wdtype,gdtype,adam_mode,correct_bias,weight_decay", CASES, ids=str)
def test_adamw_matches_reference(rng, wdtype, gdtype, adam_mode, correct_bias, weight_decay):
    w, g, m1, m2 = make_lists(rng, wdtype=wdtype, gdtype=gdtype)
    kw = dict(adam_mode=adam_mode, correct_bias=correct_bias, weight_decay=weight_decay,
              epsilon=1e-6)
    flag, *out = ops.adamw_optimizer(LR, STEP, w, g, m1, m2, **kw)
    eflag, *expected = adamw_ref(LR, STEP, w, g, m1, m2, **kw)
    assert flag.dtype == jnp.bool_ and flag.shape == STEP.shape and bool(flag[0])
    for a, e, old in zip(out, expected, (w, m1, m2)):
        assert_lists(a, e, wdtype, before=old)
    # the update really moved the weights (a no-op kernel would pass the aliasing checks)
    assert not np.allclose(np.asarray(out[0][0], np.float32), np.asarray(w[0], np.float32))


def test_adamw_spec_formulas_by_hand():
    # one element, f64: mode 0 (PyTorch) and mode 1 (HuggingFace) written out from the spec
    w, g, m1, m2 = 1.5, -0.25, 0.125, 0.0625
    lr, a, b, eps, wd, t = 0.5, 0.875, 0.96875, 0.0078125, 0.0625, 2
    n1, n2 = a * m1 + (1 - a) * g, b * m2 + (1 - b) * g * g
    ac, bc = 1 - a**t, 1 - b**t
    w0 = w - lr * wd * w
    mode0 = w0 - lr * n1 / (ac * (np.sqrt(n2 / bc) + eps))
    mode1 = w - lr * np.sqrt(bc) / ac * n1 / (np.sqrt(n2) + eps)
    mode1 = mode1 - lr * wd * mode1
    arr = lambda v: [jnp.asarray([v], jnp.float64)]
    for mode, expected in ((0, mode0), (1, mode1)):
        _, nw, nm1, nm2 = ops.adamw_optimizer(jnp.asarray([lr], jnp.float32), jnp.asarray([t]),
                                              arr(w), arr(g), arr(m1), arr(m2), alpha=a, beta=b,
                                              epsilon=eps, weight_decay=wd, adam_mode=mode)
        np.testing.assert_allclose(nw[0], [expected], rtol=1e-14)
        np.testing.assert_allclose(nm1[0], [n1], rtol=1e-15)
        np.testing.assert_allclose(nm2[0], [n2], rtol=1e-15)


def _adamw_kernel_numpy(lr, step, w, g, m1, m2, alpha, beta, eps, wd, mode, acc):
    """The CPU kernel's arithmetic, operation by operation in `acc` (numpy rounds each one,
    as the kernel does: no multiply-add is fused) and in the kernel's order (optim.h)."""
    A = lambda x: acc(np.float32(x))  # the attributes and lr arrive as float32
    alpha, beta, eps, wd, lr = A(alpha), A(beta), A(eps), A(wd), A(lr)
    one = acc(1)
    bias1, bias2 = one - alpha ** acc(step), one - beta ** acc(step)
    w, g, m1, m2 = (np.asarray(x).astype(acc) for x in (w, g, m1, m2))
    if mode == 0:
        w = w - lr * wd * w
    m1 = alpha * m1 + (one - alpha) * g
    m2 = beta * m2 + (one - beta) * g * g
    if mode == 0:
        w = w - lr / bias1 * (m1 / (np.sqrt(m2) / np.sqrt(bias2) + eps))
    else:
        w = w - lr * np.sqrt(bias2) / bias1 * (m1 / (np.sqrt(m2) + eps))
        if wd > 0:
            w = w - lr * wd * w
    return w, m1, m2


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the CPU kernel's operation order (CUDA's rounds mode 1 otherwise)")
@pytest.mark.parametrize("wdtype,gdtype", [(np.float32, None), (np.float64, None),
                                           (np.float32, jnp.bfloat16), (jnp.bfloat16, None)],
                         ids=str)
@pytest.mark.parametrize("adam_mode,weight_decay", [(0, 0.01), (1, 0.0), (1, 0.1)])
def test_adamw_kernel_bits_on_long_tensors(rng, wdtype, gdtype, adam_mode, weight_decay):
    """Every element rounded as the formulas say, bit for bit, on tensors long enough for the
    vectorized loop (whichever ISA's copy this CPU runs) and of every tail length; alpha, beta
    and step make the bias corrections exact, so the oracle's pow cannot differ from libm's.
    bf16 weights: f32 math, each result rounded to bf16 once (numpy's cast rounds to even)."""
    shapes = [(1031,), (37, 29), (8,), (7,), (1,)]
    gdtype = gdtype or wdtype
    acc = np.float64 if wdtype == np.float64 else np.float32
    w = [rng.standard_normal(s).astype(wdtype) for s in shapes]
    g = [np.array(jnp.asarray(rng.standard_normal(s), gdtype)) for s in shapes]
    m1 = [(0.1 * rng.standard_normal(s)).astype(wdtype) for s in shapes]
    m2 = [np.abs(0.1 * rng.standard_normal(s)).astype(wdtype) for s in shapes]
    w[0][:3], g[0][:3], m2[0][:3] = -0.0, 0.0, 0.0  # signed zeros, a zero second moment
    hyper = dict(alpha=0.875, beta=0.96875, epsilon=1e-6, weight_decay=weight_decay)
    step = 3
    _, *out = ops.adamw_optimizer(LR, jnp.asarray([step]), w, g, m1, m2, adam_mode=adam_mode,
                                  **hyper)
    for i in range(len(shapes)):
        expected = _adamw_kernel_numpy(LR[0], step, w[i], g[i], m1[i], m2[i], 0.875, 0.96875, 1e-6,
                                weight_decay, adam_mode, acc)
        for k in range(3):
            a, e = np.asarray(out[k][i]), expected[k].astype(wdtype)
            assert a.dtype == wdtype
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8),
                                          err_msg=f"tensor {i}, result {k}")
    assert not np.array_equal(np.asarray(out[0][0]), w[0])  # the weights did move


@pytest.mark.parametrize("wdtype,gdtype", DTYPES, ids=DTYPE_IDS)
def test_sgd_v2_matches_reference(rng, wdtype, gdtype):
    w, g, _, _ = make_lists(rng, wdtype=wdtype, gdtype=gdtype)
    flag, out = ops.sgd_optimizer_v2(LR, w, g)
    eflag, expected = sgd_ref(LR, w, g)
    assert flag.shape == LR.shape and bool(flag[0])
    # w - lr*g may cancel most of w: the roundings are of w's size (seed 4196153228 left a
    # scalar of 0.0064 off by 5e-9, 2 ulps of the result).
    assert_lists(out, expected, wdtype, before=w)
    # against exact math: a few roundings of the weight's size (w - lr*g may cancel most of w)
    w0 = np.asarray(w[0], np.float64)
    eps = float(jnp.finfo(wdtype).eps)
    np.testing.assert_allclose(np.asarray(out[0], np.float64),
                               w0 - float(LR[0]) * np.asarray(g[0], np.float64),
                               rtol=8 * eps, atol=4 * eps * float(np.max(np.abs(w0))))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_flag_shapes_and_update_signal(rng, shape):
    w, g, m1, m2 = make_lists(rng, shapes=[(4,), (2, 2)])
    step = jnp.full(shape, 2, jnp.int32)
    lr = jnp.full(shape, 0.1, jnp.float32)
    for signal in (None, jnp.asarray(True), jnp.asarray([False])):
        flag, nw, nm1, nm2 = ops.adamw_optimizer(lr, step, w, g, m1, m2, signal)
        sflag, sw = ops.sgd_optimizer_v2(lr, w, g, signal)
        assert flag.shape == shape and sflag.shape == shape
        updated = signal is None or bool(np.asarray(signal).reshape(()))
        assert bool(np.all(flag)) == bool(np.all(sflag)) == updated
        for new, old in ((nw, w), (nm1, m1), (nm2, m2), (sw, w)):
            same = all(np.array_equal(a, b) for a, b in zip(new, old))
            assert same != updated


def test_step_is_used_as_given(rng):
    # the op never increments step: two calls with the same step apply the same correction
    w, g, m1, m2 = make_lists(rng, shapes=[(6,)], wdtype=jnp.float64)
    one = lambda s: ops.adamw_optimizer(LR, jnp.asarray([s]), w, g, m1, m2)[1][0]
    np.testing.assert_array_equal(one(5), one(5))
    assert not np.allclose(one(1), one(2))
    assert np.isnan(np.asarray(one(0))).all()  # ORT: step 0 divides by 1 - alpha^0 = 0


def test_empty_list():
    flag, w, m1, m2 = ops.adamw_optimizer(LR, STEP, [], [], [], [])
    assert bool(flag[0]) and w == m1 == m2 == []
    flag, w = ops.sgd_optimizer_v2(LR, [], [])
    assert bool(flag[0]) and w == []


def _adamw_numpy(w, g, m1, m2, lr, step, a=0.9, b=0.999, eps=1e-8, wd=0.01):
    """AdamW mode 0 in f64 numpy, from the spec."""
    w = w - lr * wd * w
    n1, n2 = a * m1 + (1 - a) * g, b * m2 + (1 - b) * g * g
    return w - lr * n1 / ((1 - a**step) * (np.sqrt(n2 / (1 - b**step)) + eps)), n1, n2


def test_many_tensors(rng):
    # more tensors than one CUDA launch takes (192), of mixed sizes
    shapes = [(int(n),) for n in rng.integers(0, 40, size=200)]
    w, g, m1, m2 = make_lists(rng, shapes=shapes)
    _, *out = ops.adamw_optimizer(LR, STEP, w, g, m1, m2)
    for i in range(len(shapes)):
        f64 = [np.asarray(x[i], np.float64) for x in (w, g, m1, m2)]
        expected = _adamw_numpy(*f64, float(LR[0]), 3, *(float(np.float32(v)) for v in
                                                            (0.9, 0.999, 1e-8, 0.01)))
        # New w and m1 may cancel most of their terms, so the tolerance follows the terms'
        # size; the f32 bias correction 1 - beta^3 carries a relative rounding of
        # eps / (1 - beta^3) (4e-5) into w's update (seed 1662764248: a one-element w of
        # 0.00093 after an update of 0.0017 was 5e-9 off).
        w0, g0, m10, _ = (np.abs(x).max(initial=0) for x in f64)
        update = np.abs(expected[0] - f64[0]).max(initial=0)
        bias = float(jnp.finfo(jnp.float32).eps) / (1 - 0.999**3)
        for a, e, terms, extra in zip(out, expected, (w0, max(m10, 0.1 * g0), 0),
                                      (bias * update, 0, 0)):
            scale = max(np.abs(e).max(initial=0), terms)
            np.testing.assert_allclose(a[i], e, rtol=2e-6, atol=2e-6 * scale + extra)


def test_jit_donation_updates_in_place(rng):
    w, g, m1, m2 = make_lists(rng, shapes=[(64,), (8, 8)])
    expected = ops.adamw_optimizer(LR, STEP, w, g, m1, m2)
    step = jax.jit(lambda w, m1, m2, g: ops.adamw_optimizer(LR, STEP, w, g, m1, m2)[1:],
                   donate_argnums=(0, 1, 2))
    text = step.lower(w, m1, m2, g).as_text()
    assert text.count("output_operand_alias") >= 1
    compiled = step.lower(w, m1, m2, g).compile().as_text()
    assert "custom_call_target=\"jaxops_adamw_optimizer\"" in compiled
    assert "output_to_operand_aliasing" in compiled
    out = step(w, m1, m2, g)
    assert all(x.is_deleted() for x in w + m1 + m2)  # donated buffers were consumed
    for a, e in zip(out, expected[1:]):
        assert_lists(a, e, jnp.float32, ulps=0)


def test_sgd_jit_donation(rng):
    w, g, _, _ = make_lists(rng, shapes=[(16,), (3, 3)])
    expected = ops.sgd_optimizer_v2(LR, w, g)[1]
    step = jax.jit(lambda w, g: ops.sgd_optimizer_v2(LR, w, g)[1], donate_argnums=0)
    assert "output_to_operand_aliasing" in step.lower(w, g).compile().as_text()
    out = step(w, g)
    assert all(x.is_deleted() for x in w)
    assert_lists(out, expected, jnp.float32, ulps=0)


def _vmap_case(rng, batched, axis=0, b=3):
    shapes = [(4,), (2, 3)]
    lists = list(make_lists(rng, shapes=[(b, *s) for s in shapes]))
    lists = [[jnp.moveaxis(x, 0, axis) for x in xs] for xs in lists]
    unb = make_lists(rng, shapes=shapes)
    lists = [xs if k in batched else list(u) for k, (xs, u) in enumerate(zip(lists, unb))]
    return lists


@pytest.mark.parametrize("batched,axis", [((0, 1, 2, 3), 0), ((0, 1, 2, 3), 1), ((1,), 0),
                                          ((0, 2, 3), 1), ((0,), 0)], ids=str)
def test_vmap_adamw(rng, batched, axis):
    lists = _vmap_case(rng, batched, axis)
    axes = [axis if k in batched else None for k in range(4)]
    fn = lambda w, g, m1, m2: ops.adamw_optimizer(LR, STEP, w, g, m1, m2)
    out = jax.vmap(fn, in_axes=(axes[0], axes[1], axes[2], axes[3]))(*lists)
    rfn = lambda w, g, m1, m2: ref.adamw_optimizer(LR, STEP, w, g, m1, m2)
    expected = jax.vmap(rfn, in_axes=tuple(axes))(*lists)
    for a, e in zip(jax.tree.leaves(out[1:]), jax.tree.leaves(expected[1:])):
        assert_close(a, e, jnp.float32, ulps=2)


def test_vmap_over_lr_and_step(rng):
    w, g, m1, m2 = make_lists(rng, shapes=[(4,), (2, 2)])
    lrs = jnp.asarray([[0.1], [0.01], [0.5]], jnp.float32)
    steps = jnp.asarray([[1], [2], [3]], jnp.int32)
    fn = lambda lr, st: ops.adamw_optimizer(lr, st, w, g, m1, m2)
    out = jax.vmap(fn)(lrs, steps)
    for i in range(3):
        one = ops.adamw_optimizer(lrs[i], steps[i], w, g, m1, m2)
        for a, e in zip(jax.tree.leaves(out[1:]), jax.tree.leaves(one[1:])):
            assert_close(a[i], e, jnp.float32, ulps=2)
    sgd = jax.vmap(lambda lr: ops.sgd_optimizer_v2(lr, w, g)[1])(lrs)
    assert_close(sgd[0][1], w[0] - 0.01 * g[0], jnp.float32)


def test_vmap_sgd_unbatched_grads(rng):
    w = [jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)]
    g = [jnp.asarray(rng.standard_normal(5), jnp.float32)]
    flag, out = jax.vmap(lambda w: ops.sgd_optimizer_v2(LR, w, g))(w)
    assert flag.shape == (3, 1)  # vmap broadcasts the (unbatched) flag
    assert_close(out[0], w[0] - 0.05 * g[0][None], jnp.float32)


def test_grad_through_adamw_reference_rule(rng):
    # d(new weights)/d(lr) via the default jvp (the reference): finite and equal to the
    # reference's own derivative
    w, g, m1, m2 = make_lists(rng, shapes=[(5,)])
    f = lambda lr, fn: jnp.sum(fn(lr, STEP, w, g, m1, m2)[1][0])
    got = jax.grad(lambda lr: f(lr, ops.adamw_optimizer))(LR)
    expected = jax.grad(lambda lr: f(lr, ref.adamw_optimizer))(LR)
    # A sum of 5 derivatives that may cancel: f32 roundings of the terms' size (seed 1719505348
    # gave 0.0229562 against 0.0229562(3), 1.3e-6 relative to the sum).
    terms = jax.jacfwd(lambda lr: ref.adamw_optimizer(lr, STEP, w, g, m1, m2)[1][0])(LR)
    scale = float(np.sum(np.abs(np.asarray(terms, np.float64))))
    np.testing.assert_allclose(got, expected, rtol=0,
                               atol=8 * float(jnp.finfo(jnp.float32).eps) * scale)


def _trimmed(spec):
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize("spec", [P("x"), P(None, "x"), P("x", None)], ids=str)
def test_sharded_params_stay_sharded(rng, spec):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    shapes = [(8, 12), (8, 4)]
    w, g, m1, m2 = make_lists(rng, shapes=shapes)
    sh = NamedSharding(mesh, spec)
    put = lambda xs: [jax.device_put(x, sh) for x in xs]
    ws, gs, m1s, m2s = put(w), put(g), put(m1), put(m2)
    fn = jax.jit(lambda w, g, m1, m2: ops.adamw_optimizer(LR, STEP, w, g, m1, m2),
                 donate_argnums=(0, 2, 3))
    compiled = fn.lower(ws, gs, m1s, m2s).compile().as_text()
    assert "all-gather" not in compiled and "all-to-all" not in compiled
    assert "output_to_operand_aliasing" in compiled
    out = fn(ws, gs, m1s, m2s)
    expected = adamw_ref(LR, STEP, w, g, m1, m2)
    for a, e in zip(jax.tree.leaves(out[1:]), jax.tree.leaves(expected[1:])):
        assert _trimmed(a.sharding.spec) == _trimmed(spec)
        assert_close(a, e, jnp.float32, ulps=2)
    sgd = jax.jit(lambda w, g: ops.sgd_optimizer_v2(LR, w, g)[1])
    assert "all-gather" not in sgd.lower(put(w), gs).compile().as_text()
    for a in sgd(put(w), gs):
        assert _trimmed(a.sharding.spec) == _trimmed(spec)


def test_bad_input(rng):
    w, g, m1, m2 = make_lists(rng, shapes=[(3,), (2, 2)])
    f16 = [x.astype(jnp.float16) for x in g]
    cases = [
        ((LR.astype(jnp.float64), STEP, w, g, m1, m2), {}, TypeError, "lr must be float32"),
        ((jnp.ones(2, jnp.float32), STEP, w, g, m1, m2), {}, ValueError, "one element"),
        ((LR, jnp.ones(1, jnp.float32), w, g, m1, m2), {}, TypeError, "step must be int32 or int64"),
        ((LR, STEP, w, g[:1], m1, m2), {}, ValueError, "one length"),
        ((LR, STEP, w, g[::-1], m1, m2), {}, ValueError, "different shapes"),
        ((LR, STEP, w, g, [x.astype(jnp.float64) for x in m1], m2), {}, TypeError, "weights' dtype"),
        (([x.astype(jnp.float16) for x in w], STEP, w, g, m1, m2)[:0] + (LR, STEP,
          [x.astype(jnp.bfloat16) for x in w], f16,
          [x.astype(jnp.bfloat16) for x in m1], [x.astype(jnp.bfloat16) for x in m2]), {},
         TypeError, "weights' dtype"),
        ((LR, STEP, [w[0], w[1].astype(jnp.float64)], g, m1, m2), {}, TypeError, "share one dtype"),
        ((LR, STEP, [x.astype(jnp.int32) for x in w], g, m1, m2), {}, TypeError, "float16"),
        ((LR, STEP, w, g, m1, m2), {"adam_mode": 2}, ValueError, "adam_mode"),
        ((LR, STEP, w, g, m1, m2), {"adam_mode": 0, "correct_bias": 0}, ValueError, "correct_bias"),
        ((LR, STEP, w, g, m1, m2, jnp.ones(1, jnp.int32)), {}, TypeError, "update_signal"),
    ]
    for args, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            ops.adamw_optimizer(*args, **kwargs)
        assert "jaxops.ops.adamw_optimizer" in str(info.value)
        with pytest.raises(error, match=text):
            jax.jit(functools.partial(ops.adamw_optimizer, **kwargs))(*args)
    with pytest.raises(TypeError, match="jaxops.ops.adamw_optimizer: weights must be a list"):
        ops.adamw_optimizer(LR, STEP, w[0], g, m1, m2)
    with pytest.raises(ValueError, match="jaxops.ops.sgd_optimizer_v2: .*one length"):
        ops.sgd_optimizer_v2(LR, w, g[:1])
    with pytest.raises(TypeError, match="jaxops.ops.sgd_optimizer_v2: lr must be float32"):
        ops.sgd_optimizer_v2(jnp.ones(1, jnp.int32), w, g)


# ---- XLA-coded ops: Adam (legacy), SGD (legacy), LAMB, InplaceClipGradNorm ----------------

def test_adam_optimizer_scaling_and_signal(rng):
    w = jnp.asarray(rng.standard_normal(6), jnp.float32)
    g = jnp.asarray(rng.standard_normal(6), jnp.float32)
    m = jnp.zeros(6, jnp.float32)
    T, R = jnp.asarray(2), jnp.asarray(0.1, jnp.float32)
    base = ops.adam_optimizer(R, T, w, g / 4, m, m)
    # loss scale 4 divides the gradient
    scaled = ops.adam_optimizer(R, T, w, g, m, m, None, jnp.float32(4))
    np.testing.assert_allclose(scaled[3], base[3], rtol=1e-6)
    # a global norm above loss_scale * max_norm_clip: g is divided by norm / max_norm_clip
    clipped = ops.adam_optimizer(R, T, w, g, m, m, None, jnp.float32(1), jnp.float32(8),
                                 max_norm_clip=2.0)
    np.testing.assert_allclose(clipped[3], base[3], rtol=1e-6)
    # mixed-precision copy and update_signal False
    mpw = w.astype(jnp.float16)
    out = ops.adam_optimizer(R, T, w, g, m, m, mpw)
    np.testing.assert_array_equal(out[5], out[3].astype(jnp.float16))
    off = ops.adam_optimizer(R, T, w, g, m, m, mpw, None, None, jnp.asarray(False))
    assert int(off[0]) == 2 and int(out[0]) == 3
    np.testing.assert_array_equal(off[3], w)
    np.testing.assert_array_equal(off[5], mpw)


def test_sgd_optimizer_outputs(rng):
    w, g = (jnp.asarray(rng.standard_normal((2, 3)), jnp.float32) for _ in range(2))
    nw, ng = ops.sgd_optimizer(jnp.asarray([0.5], jnp.float32), w, g)
    np.testing.assert_allclose(nw, w - 0.5 * g, rtol=1e-7)
    np.testing.assert_allclose(ng, -0.5 * g, rtol=1e-7)


def _lamb_numpy(w, g, m1, m2, lr, step, a, b, lam, eps, rmin=-np.inf, rmax=np.inf, scale=1.0,
                parts=False):
    """LambOptimizer for one group, in f64 numpy, straight from the spec. `parts` adds the size
    of the new gradient's two terms, ratio * (|lambda w| + |adam's step|): where they cancel, an
    f32 kernel's rounding is relative to that, not to the result."""
    g = g / scale
    n1, n2 = a * m1 + (1 - a) * g, b * m2 + (1 - b) * g * g
    ac, bc = (1 - a**step, 1 - b**step) if step > 0 else (1, 1)
    d = lam * w + (n1 / ac) / (np.sqrt(n2 / bc) + eps)
    bad = ~np.isfinite(d)
    d[bad], n1[bad], n2[bad] = 0, m1[bad], m2[bad]
    wn, dn = np.linalg.norm(w), np.linalg.norm(d)
    ratio = lr * (np.clip(wn / dn, rmin, rmax) if wn != 0 and dn != 0 else 1)
    new = w - ratio * d
    if parts:
        return new, -ratio * d, n1, n2, np.abs(ratio) * (np.abs(lam * w) + np.abs(d - lam * w))
    return new, -ratio * d, n1, n2


@pytest.mark.parametrize("rmin,rmax", [(-np.inf, np.inf), (0.5, 0.6), (2.0, 3.0)])
def test_lamb_two_groups(rng, rmin, rmax):
    args, expected = [], []
    lam, eps = [0.01, 0.0], [1e-6, 1e-4]
    for i, shape in enumerate([(4, 3), (7,)]):
        w, g = rng.standard_normal(shape), rng.standard_normal(shape)
        m1, m2 = 0.1 * rng.standard_normal(shape), np.abs(0.1 * rng.standard_normal(shape))
        args += [jnp.asarray(x) for x in (w, g, m1, m2)] + [None]
        expected.append(_lamb_numpy(w, g, m1, m2, 0.1, 3, 0.9, 0.999, lam[i], eps[i], rmin, rmax))
    out = ops.lamb_optimizer(None, None, None, jnp.asarray(0.1), jnp.asarray(3), *args,
                             alpha=[0.9, 0.9], beta=[0.999, 0.999], epsilon=eps,
                             ratio_min=rmin, ratio_max=rmax, **{"lambda": lam})
    assert int(out[0]) == 4
    for i, e in enumerate(expected):
        got = out[1 + 5 * i:5 + 5 * i]
        for a, x in zip(got, e):
            np.testing.assert_allclose(a, x, rtol=1e-12, atol=1e-14)
        assert out[5 + 5 * i] is None


def test_lamb_zero_norm_nonfinite_and_signal():
    w = jnp.zeros(3, jnp.float64)  # ||w|| = 0: ratio = lr
    g = jnp.asarray([1.0, jnp.inf, -2.0])
    m = jnp.asarray([0.5, 0.5, 0.5])
    out = ops.lamb_optimizer(None, None, None, jnp.asarray(0.1), None, w, g, m, m, None,
                             **{"lambda": 0.0})
    assert out[0] is None  # no step input: no step output
    ew, eg, e1, e2 = _lamb_numpy(np.zeros(3), np.array([1.0, np.inf, -2.0]), np.full(3, 0.5),
                                 np.full(3, 0.5), 0.1, 0, 0.9, 0.999, 0.0, 1e-6)
    for a, e in zip(out[1:5], (ew, eg, e1, e2)):
        np.testing.assert_allclose(a, e, rtol=1e-12)
    assert float(out[3][1]) == 0.5 and float(out[1][1]) == 0.0  # non-finite d: moments kept
    # mixed-precision copy follows the weights; update_signal False passes everything through
    w32 = jnp.asarray([1.0, 2.0], jnp.float32)
    g32 = jnp.asarray([0.5, 0.25], jnp.float32)
    z = jnp.zeros(2, jnp.float32)
    on = ops.lamb_optimizer(None, None, None, jnp.float32(0.1), jnp.asarray(1), w32, g32, z, z,
                            w32.astype(jnp.bfloat16))
    np.testing.assert_array_equal(on[5], on[1].astype(jnp.bfloat16))
    off = ops.lamb_optimizer(jnp.asarray(False), None, None, jnp.float32(0.1), jnp.asarray(1),
                             w32, g32, z, z, w32.astype(jnp.bfloat16))
    assert int(off[0]) == 1
    np.testing.assert_array_equal(off[1], w32)
    np.testing.assert_array_equal(off[2], g32)


def test_lamb_loss_scale_and_norm_clip(rng):
    w, g = rng.standard_normal(5), rng.standard_normal(5)
    m = np.zeros(5)
    args = [jnp.asarray(x) for x in (w, g, m, m)] + [None]
    # norm 10 > loss_scale 2 * max_norm_clip 1: g is divided by 10 / 1
    out = ops.lamb_optimizer(None, jnp.asarray(2.0), jnp.asarray(10.0), jnp.asarray(0.1),
                             jnp.asarray(2), *args)
    e = _lamb_numpy(w, g, m.copy(), m.copy(), 0.1, 2, 0.9, 0.999, 0.0, 1e-6, scale=10.0)
    np.testing.assert_allclose(out[1], e[0], rtol=1e-12)
    out = ops.lamb_optimizer(None, jnp.asarray(2.0), jnp.asarray(1.0), jnp.asarray(0.1),
                             jnp.asarray(2), *args)
    e = _lamb_numpy(w, g, m.copy(), m.copy(), 0.1, 2, 0.9, 0.999, 0.0, 1e-6, scale=2.0)
    np.testing.assert_allclose(out[1], e[0], rtol=1e-12)


def test_lamb_bad_input():
    w = jnp.ones(3)
    with pytest.raises(ValueError, match="jaxops.ops.lamb_optimizer: R"):
        ops.lamb_optimizer(None, None, None, None, None, w, w, w, w, None)
    with pytest.raises(ValueError, match="jaxops.ops.lamb_optimizer: alpha has 1 values"):
        ops.lamb_optimizer(None, None, None, jnp.asarray(0.1), None, w, w, w, w, None,
                           w, w, w, w, None, alpha=[0.9])
    with pytest.raises(ValueError, match="different shapes"):
        ops.lamb_optimizer(None, None, None, jnp.asarray(0.1), None, w, jnp.ones(2), w, w)
    with pytest.raises(TypeError, match="jaxops.ops.lamb_optimizer: unexpected attribute"):
        ops.lamb_optimizer(None, None, None, jnp.asarray(0.1), None, w, w, w, w, lamda=0.1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64])
def test_inplace_clip_grad_norm(rng, dtype):
    g = [jnp.asarray(rng.standard_normal(s), dtype) for s in [(3, 4), (5,)]]
    total = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in g))
    for max_norm, coef in ((0.5, 0.5 / (total + 1e-6)), (1e3, 1.0)):
        out = ops.inplace_clip_grad_norm(g, max_norm=max_norm)
        for a, x in zip(out, g):
            assert a.dtype == dtype
            assert_close(a, np.asarray(x, np.float64) * coef, dtype, ulps=4)
    with pytest.raises(ValueError, match="jaxops.ops.inplace_clip_grad_norm: norm_type"):
        ops.inplace_clip_grad_norm(g, norm_type="inf")


def test_inplace_clip_grad_norm_vmap_and_sharded(rng):
    """A list input, so the op matrix cannot batch or shard it: vmap over every tensor (or
    one unbatched), and a sharded list: no gather, shardings kept, values unchanged."""
    g = [jnp.asarray(rng.standard_normal(s)) for s in [(3, 8, 4), (3, 8)]]
    fn = lambda g: ops.inplace_clip_grad_norm(g, max_norm=0.5)  # noqa: E731
    for axes, example in (([0, 0], lambda k: [g[0][k], g[1][k]]),
                          ([0, None], lambda k: [g[0][k], g[1][0]])):
        got = jax.vmap(fn, in_axes=(axes,))([g[0], g[1] if axes[1] == 0 else g[1][0]])
        for k in range(3):
            for a, e in zip(got, fn(example(k))):
                np.testing.assert_allclose(a[k], e, rtol=1e-12)
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sh = NamedSharding(mesh, P("x"))
    placed = [jax.device_put(x[0], sh) for x in g]
    jitted = jax.jit(fn)
    assert "all-gather" not in jitted.lower(placed).compile().as_text()
    for a, e in zip(jitted(placed), fn([x[0] for x in g])):
        assert a.sharding.spec[:1] == ("x",)
        np.testing.assert_allclose(a, e, rtol=1e-12)


def test_adam_optimizer_sharded(rng):
    """Sharded tensors stay sharded with no gather (the op matrix checks the first output,
    here the one-element step count)."""
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    sh = NamedSharding(mesh, P("x"))
    w, g, m1, m2 = (x[0] for x in make_lists(rng, shapes=[(8, 4)], wdtype=jnp.float64))
    args = (jnp.asarray([0.1]), jnp.asarray([3]), w, g, m1, jnp.abs(m2))
    placed = args[:2] + tuple(jax.device_put(x, sh) for x in args[2:])
    jitted = jax.jit(lambda *a: ops.adam_optimizer(*a, **{"lambda": 0.01}))
    assert "all-gather" not in jitted.lower(*placed).compile().as_text()
    got = jitted(*placed)
    for a, e in zip(got[1:5], ops.adam_optimizer(*args, **{"lambda": 0.01})[1:5]):
        assert a.sharding.spec[:1] == ("x",)
        np.testing.assert_allclose(a, e, rtol=1e-12)


def test_ort_ops_table():
    ms = "com.microsoft"
    for op_type, fn in [("AdamWOptimizer", ops.adamw_optimizer),
                        ("SGDOptimizerV2", ops.sgd_optimizer_v2),
                        ("AdamOptimizer", ops.adam_optimizer), ("SGDOptimizer", ops.sgd_optimizer),
                        ("LambOptimizer", ops.lamb_optimizer),
                        ("InplaceClipGradNorm", ops.inplace_clip_grad_norm)]:
        assert ops.ORT_OPS[(ms, op_type)] is fn


# ---- the LAMB kernel (f32 weights and moments) against the reference ------------------------

def _lamb_groups(rng, gdtype, shapes=((4, 3), (7,), (0,), (2, 2))):
    groups = []
    for s in shapes:
        w, g, m1, m2 = (x[0] for x in make_lists(rng, shapes=[s], gdtype=gdtype))
        groups.append((w, g, m1, m2, None))
    return groups


def _lamb_both(groups, *scalars, **kw):
    flat = [x for grp in groups for x in grp]
    got = ops.lamb_optimizer(*scalars, *flat, **kw)
    n = len(groups)
    per = {k: [kw.get(k, d)] * n if not isinstance(kw.get(k, d), list) else kw[k]
           for k, d in (("alpha", 0.9), ("beta", 0.999), ("epsilon", 1e-6),
                        ("max_norm_clip", 1.0), ("lambda", 0.0))}
    _, outs = ref.lamb_optimizer(*scalars, groups, alpha=per["alpha"], beta=per["beta"],
                                 lambda_=per["lambda"], epsilon=per["epsilon"],
                                 max_norm_clip=per["max_norm_clip"],
                                 ratio_min=kw.get("ratio_min", -np.inf),
                                 ratio_max=kw.get("ratio_max", np.inf))
    return got, [x for grp in outs for x in grp]


@pytest.mark.parametrize("gdtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("scalars,kw", [
    ((None, None, None, 0.1, 3), {}),
    ((None, 2.0, 40.0, 0.1, 3), {"ratio_min": 0.05, "ratio_max": 0.07, "lambda": 0.01}),
    ((True, 4.0, 1.0, 0.1, None), {"lambda": [0.0, 0.1, 0.2, 0.3], "epsilon": 1e-4}),
    ((False, None, None, 0.1, 3), {}),
], ids=["plain", "scaled-clipped-clamped", "no-step", "signal-off"])
def test_lamb_kernel_matches_reference(rng, gdtype, scalars, kw):
    groups = _lamb_groups(rng, gdtype)
    conv = [None if x is None else jnp.asarray(x, jnp.float32 if isinstance(x, float) else None)
            for x in scalars]
    got, expected = _lamb_both(groups, *conv, **kw)
    assert (got[0] is None) == (scalars[4] is None)
    if scalars[4] is not None:
        assert int(got[0]) == (3 if scalars[0] is False else 4)
    for a, e in zip(got[1:], expected):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype and a.shape == e.shape
        assert_close(a, e, e.dtype, ulps=8)  # the norms sum in a different order
    if scalars[0] is False:
        np.testing.assert_array_equal(got[1], groups[0][0])


def test_lamb_kernel_nonfinite_and_mixed_precision_copy():
    w = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
    g = jnp.asarray([0.5, jnp.inf, -1.0], jnp.float32)
    m = jnp.asarray([0.1, 0.1, 0.1], jnp.float32)
    got = ops.lamb_optimizer(None, None, None, jnp.float32(0.1), jnp.asarray(2), w, g, m, m,
                             w.astype(jnp.float16))
    assert got[3][1] == m[1] and float(got[2][1]) == 0  # d = 0: moments kept, no delta
    assert float(got[1][1]) == 2.0  # ... so that weight does not move
    np.testing.assert_array_equal(got[5], got[1].astype(jnp.float16))


def test_lamb_kernel_donation_and_vmap(rng):
    groups = _lamb_groups(rng, jnp.float32, shapes=((8,), (3, 3)))
    flat = [x for grp in groups for x in grp]
    lr, step = jnp.float32(0.1), jnp.asarray(1)
    expected = ops.lamb_optimizer(None, None, None, lr, step, *flat)
    fn = jax.jit(lambda *f: ops.lamb_optimizer(None, None, None, lr, step, *f))
    compiled = fn.lower(*flat).compile().as_text()
    assert "jaxops_lamb_optimizer" in compiled and "output_to_operand_aliasing" in compiled
    for a, e in zip(fn(*flat), expected):
        if e is not None:
            np.testing.assert_array_equal(a, e)
    # vmap over a batch of first weights: each batch member has its own trust ratio
    ws = jnp.stack([groups[0][0], 2 * groups[0][0]])
    out = jax.vmap(lambda w: ops.lamb_optimizer(None, None, None, lr, step, w, *flat[1:])[1])(ws)
    one = ops.lamb_optimizer(None, None, None, lr, step, ws[1], *flat[1:])[1]
    assert_close(out[1], one, jnp.float32, ulps=4)


def test_lamb_kernel_sharded_stays_correct(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    groups = _lamb_groups(rng, jnp.float32, shapes=((8, 4), (8,)))
    sh = NamedSharding(mesh, P("x"))
    flat = [None if x is None else jax.device_put(x, sh) for grp in groups for x in grp]
    fn = jax.jit(lambda *f: ops.lamb_optimizer(None, None, None, jnp.float32(0.1),
                                               jnp.asarray(1), *f)[1:])
    got = fn(*flat)
    expected = ops.lamb_optimizer(None, None, None, jnp.float32(0.1), jnp.asarray(1),
                                  *[x for grp in groups for x in grp])[1:]
    for a, e in zip(got, expected):
        if e is not None:
            assert_close(a, e, jnp.float32, ulps=2)


@pytest.mark.parametrize("gdtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lamb_without_new_gradients(rng, gdtype):
    """new_gradients=False: the same weights and moments, None for the gradients, and the
    kernel neither returns nor aliases a gradient buffer."""
    groups = _lamb_groups(rng, gdtype)
    flat = [x for grp in groups for x in grp]
    lr, step = jnp.float32(0.1), jnp.asarray(3)
    full = ops.lamb_optimizer(None, None, None, lr, step, *flat, **{"lambda": 0.01})
    fn = jax.jit(lambda *f: ops.lamb_optimizer(None, None, None, lr, step, *f,
                                               new_gradients=False, **{"lambda": 0.01}))
    lean = fn(*flat)
    for i in range(len(groups)):
        a, b = full[1 + 5 * i:6 + 5 * i], lean[1 + 5 * i:6 + 5 * i]
        assert b[1] is None and b[4] is None
        for k in (0, 2, 3):
            np.testing.assert_array_equal(b[k], a[k])
    hlo = fn.lower(*flat).compile().as_text()
    results = len(jax.tree.leaves(jax.eval_shape(fn, *flat)))
    assert results == 1 + 3 * len(groups)
    # the reference path (f64 weights) drops them too
    g64 = [tuple(None if x is None else x.astype(jnp.float64) for x in grp) for grp in groups]
    out = ops.lamb_optimizer(None, None, None, 0.1, 3, *[x for grp in g64 for x in grp],
                             new_gradients=False)
    assert all(out[2 + 5 * i] is None for i in range(len(groups)))
    assert "jaxops_lamb_optimizer" in hlo


# XLA:GPU fuses a tiny tensor's whole update, its norms' reductions included, into one
# multi-output fusion, which cannot write the moments over the inputs it reduces: it copies them
# into the donated buffers (H100, jax 0.11.2: 6-9 copies of [4, 3] and [7] tensors, a few bytes).
# Tensors of a model's size get their own reduction fusions and no copy. The XLA:CPU of older jax
# copies too (0.8.0: seen; 0.9-0.11 unchecked).
_TINY = ((4, 3), (7,), (4, 3))
_SIZED = ((256, 96), (4096,), (64, 160))


@pytest.mark.xfail(jax.__version_info__ < (0, 12) and jax.default_backend() == "cpu",
                   strict=False, reason="the XLA:CPU of jax < 0.12 copies donated LAMB buffers")
@pytest.mark.parametrize("shapes", [
    pytest.param(_TINY, id="tiny", marks=pytest.mark.xfail(
        jax.default_backend() == "gpu", strict=True,
        reason="XLA:GPU fuses a tiny tensor's norms with its moments and copies them")),
    pytest.param(_SIZED, id="sized")])
@pytest.mark.parametrize("new_gradients", [False, True])
def test_lamb_reference_donated_updates_in_place(rng, new_gradients, shapes):
    """The XLA path (jaxops.optim.lamb's update, f64, vmap) donated: every output aliases its
    input and the executable copies nothing, with a traced update_signal too. The moments'
    finite masks read w, and they read g: unordered against the overwrites, XLA copied each
    weight (and each gradient when new gradients are written) first."""
    groups = _lamb_groups(rng, jnp.float32, shapes=shapes)
    flat = [x for grp in groups for x in grp[:4]]  # w, g, m1, m2 a group: the results' order

    def step(signal, *flat):
        groups = [x for i in range(0, len(flat), 4) for x in (*flat[i:i + 4], None)]
        return ops.lamb_optimizer.reference(signal, None, None, jnp.float32(0.1), jnp.asarray(3),
                                            *groups, new_gradients=new_gradients,
                                            **{"lambda": 0.01})[1:]
    donated = [1 + i for i in range(len(flat)) if new_gradients or i % 4 != 1]
    fn = jax.jit(step, donate_argnums=donated)
    text = fn.lower(jnp.asarray(True), *flat).compile().as_text()
    aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}", text.split("\n", 1)[0])
    assert [int(i) for _, i in aliases] == donated  # each result on its own input
    assert " copy(" not in text[text.index("\nENTRY"):]
    out = fn(jnp.asarray(True), *[jnp.copy(x) for x in flat])
    for a, e in zip(out, jax.jit(step)(jnp.asarray(True), *flat)):  # not donated
        assert (a is None) == (e is None)
        if a is not None:
            np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("gdtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lamb_kernel_long_list(rng, gdtype):
    """A list as a real model's: 200 tensors (two kernel tables of at most 192), tensors of many
    chunks: 5M elements, more than the GPU kernel's shared-memory slots hold on an H100 or H200
    (3.2M: the tensor is spilled), 3M (kept in the slots), and many small ones. The kernel is
    deterministic: a second run gives the same bits."""
    sizes = [5_000_000, 3_000_000, 0, 600_001, 500_000] + [
        int(n) for n in rng.integers(1, 3000, 195)]
    sizes[60] = 250_000
    groups = _lamb_groups(rng, gdtype, shapes=[(n,) for n in sizes])
    flat = [x for grp in groups for x in grp]
    kw = {"lambda": 0.01, "ratio_min": 0.0, "ratio_max": 10.0}
    fn = jax.jit(lambda *f: ops.lamb_optimizer(None, None, None, jnp.float32(0.01),
                                               jnp.asarray(5), *f, **kw))
    got = fn(*flat)
    again = fn(*flat)
    for a, b in zip(got, again):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    for i, grp in enumerate(groups):
        w, g, m1, m2 = (np.asarray(x, np.float64) for x in grp[:4])
        # the attributes and learning rate are f32: 1 - 0.999**5 with 0.999 in f32 is 1.3e-5 off
        # its f64 value, which a cancelling step magnifies (seed 1924334371: 5.3e-5)
        lr, a1, b2, lam, eps = (float(np.float32(v)) for v in (0.01, 0.9, 0.999, 0.01, 1e-6))
        *e, cancel = _lamb_numpy(w, g, m1, m2, lr, 5, a1, b2, lam, eps, 0.0, 10.0, parts=True)
        for k in range(4):  # f32 math and sums in another order: relative to the tensor's scale
            a, x = np.asarray(got[1 + 5 * i + k], np.float64), e[k]
            scale = float(np.max(np.abs(x))) if x.size else 0.0
            # The new gradient carries the trust ratio, from f32 sums of n squares in the
            # kernel's order: their rounding grows as sqrt(n) eps (2.7e-5 seen at 5M on a CPU).
            sums = 2 * np.sqrt(x.size) * np.finfo(np.float32).eps
            tol = 1e-5 if k != 1 else max(1e-5, sums) if gdtype == jnp.float32 else 1e-2
            # w moves by that gradient, so it carries the same rounding times its step (seed
            # 2087482706, bf16: a step of 3.97 with the ratio 2.3e-5 off gave w 1.2e-4 off)
            atol = tol * scale + (sums * np.abs(e[1]) if k == 0 else 0.0)
            # a moment is a sum of two terms that may cancel: their size sets its rounding (seed
            # 3897607328, f32: m1 = 0.9 * -0.1007 + 0.1 * 0.8948 = -0.00113 was 1.8e-5 off)
            terms = (0.9 * np.abs(m1) + 0.1 * np.abs(g) if k == 2 else
                     0.999 * m2 + 0.001 * g * g if k == 3 else cancel if k == 1 else 0.0)
            bad = np.abs(a - x) > tol * (np.abs(x) + terms) + atol
            assert not bad.any(), f"{i}/{k}: {bad.sum()} of {bad.size} entries off"
