"""LayerNormalizationGrad, SimplifiedLayerNormalizationGrad, InvertibleLayerNormalizationGrad,
BatchNormalizationGrad, BatchNormInternal and jaxops.nn.layer_norm / rms_norm."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import ops
from jaxops.reference import norm as ref
from helpers import assert_close, on_cpu_devices

f16, bf16, f32, f64 = jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64
LN_OPS = ["layer", "simplified", "invertible"]
LN_FN = {"layer": ops.layer_normalization_grad, "simplified": ops.simplified_layer_normalization_grad,
         "invertible": ops.invertible_layer_normalization_grad}
LN_REF = {"layer": ref.layer_normalization_grad, "simplified": ref.simplified_layer_normalization_grad,
          "invertible": ref.invertible_layer_normalization_grad}
# (T = X's dtype, U = statistics, V = dY/scale/bias): every ORT CUDA combination, plus bf16
LN_TYPES = [(f32, f32, f32), (f64, f64, f64), (f16, f32, f16), (f32, f32, f16), (f16, f32, f32),
            (bf16, f32, bf16), (bf16, f32, f32)]
LN_TYPE_IDS = ["f32", "f64", "f16-f32-f16", "f32-f32-f16", "f16-f32-f32", "bf16-f32-bf16",
               "bf16-f32-f32"]
LN_SHAPES = [((7,), 0), ((5, 33), -1), ((5, 33), 1), ((4, 6, 9), 1), ((3, 4, 5, 6), -2),
             ((2, 130), 1), ((1, 1), 1), ((0, 5), 1), ((3, 0), 1)]


def make_ln(rng, op, shape, axis, types=(f64, f64, f64)):
    """ORT operands: a real X (or forward output Y), its per-row statistics, dY."""
    T, U, V = types
    axis = axis % len(shape)
    feat = shape[axis:]
    x = rng.standard_normal(shape) * 1.5 + 0.3
    red = tuple(range(axis, len(shape)))
    mean = x.mean(axis=red, keepdims=True) if x.size else np.zeros(shape[:axis] + (1,) * len(feat))
    sq = (x if op == "simplified" else x - mean) ** 2
    inv = 1 / np.sqrt((sq.mean(axis=red, keepdims=True) if x.size else mean * 0 + 1) + 1e-5)
    scale = rng.uniform(0.5, 1.5, feat) * rng.choice([-1, 1], feat)
    bias = rng.standard_normal(feat)
    dy = rng.standard_normal(shape)
    j = lambda v, t: jnp.asarray(v, t)
    if op == "layer":
        return j(dy, V), j(x, T), j(scale, V), j(mean, U), j(inv, U)
    if op == "simplified":
        return j(dy, V), j(x, T), j(scale, V), j(inv, U)
    y = (x - mean) * inv * scale + bias
    return j(dy, V), j(y, V), j(scale, V), j(bias, V), j(inv, U)


def f64_expected(op, args, axis):
    return jax.jit(functools.partial(LN_REF[op], axis=axis))(*[jnp.asarray(a, f64) for a in args])


def assert_ln_close(op, outs, expected, args, ulps=16, sums=None):
    """X_grad's terms cancel (B - mean(B) - xhat * mean(B * xhat)): its tolerance scales with
    |B| = |dY * scale * inv_std| * (1 + xhat^2) rather than with the result. `sums`: for the
    other outputs (sums over the batch that can cancel too), the sums of their terms'
    magnitudes."""
    dx, e = outs[0], np.asarray(expected[0], np.float64)
    inv = np.asarray(args[-1], np.float64).max(initial=0.0)
    mag = (np.abs(np.asarray(args[0], np.float64)).max(initial=0.0)
           * np.abs(np.asarray(args[2], np.float64)).max(initial=0.0) * max(inv, 1.0) * 4)
    tol = ulps * float(jnp.finfo(dx.dtype).eps) * (np.abs(e) + mag) + 1e-300
    np.testing.assert_array_less(np.abs(np.asarray(dx, np.float64) - e), tol + 1e-30)
    for o, w, m in zip(outs[1:], expected[1:], sums or [None] * len(outs)):
        assert_close(o, w, o.dtype, ulps=ulps, scale=m)


# every dtype combination on one shape, f32 or bf16 on the rest
LN_MATRIX = ([(t, (5, 33), -1) for t in LN_TYPES]
             + [(LN_TYPES[0] if i % 2 else LN_TYPES[5], s, a)
                for i, (s, a) in enumerate(LN_SHAPES) if (s, a) != ((5, 33), -1)])
LN_MATRIX_IDS = [f"{LN_TYPE_IDS[LN_TYPES.index(t)]}-{s}-{a}" for t, s, a in LN_MATRIX]


@pytest.mark.parametrize("op", LN_OPS)
@pytest.mark.parametrize("types,shape,axis", LN_MATRIX, ids=LN_MATRIX_IDS)
def test_ln_matches_reference(rng, op, types, shape, axis):
    if op == "invertible" and types[0] != types[2]:
        pytest.skip("InvertibleLayerNormalizationGrad's X_grad has Y's dtype here")
    T, U, V = types
    args = make_ln(rng, op, shape, axis, types)
    outs = jax.jit(_ln_call(op, axis))(*args)
    expected = f64_expected(op, args, axis)
    assert len(outs) == (2 if op == "simplified" else 3)
    assert outs[0].dtype == T and outs[0].shape == shape
    for o in outs[1:]:
        assert o.dtype == V and o.shape == args[2].shape
    assert_ln_close(op, outs, expected, args)
    if shape == (5, 33):  # the fallback (JAXOPS_DISABLE) agrees too
        assert_ln_close(op, jax.jit(functools.partial(LN_REF[op], axis=axis))(*args), expected,
                        args)


@pytest.mark.parametrize("op", LN_OPS)
def test_ln_default_axis_and_stats_shapes(rng, op):
    # ORT's LayerNormalization emits [M, 1] statistics; flat ones are read the same way
    args = make_ln(rng, op, (4, 6), -1)
    flat = [a.reshape(-1) if a.shape == (4, 1) else a for a in args]
    for a, b in zip(LN_FN[op](*args), LN_FN[op](*flat, axis=1)):
        np.testing.assert_array_equal(a, b)
    assert LN_FN[op].spec.attrs["axis"] == -1


def test_layer_norm_grad_formula(rng):
    # X_grad against the closed form written out, and the reduced outputs against sums
    dy, x, s, m, i = make_ln(rng, "layer", (3, 8), -1)
    dx, ds, db = ops.layer_normalization_grad(dy, x, s, m, i)
    xh = (x - m) * i
    b = dy * s * i
    want = b - b.mean(-1, keepdims=True) - xh * (b * xh).mean(-1, keepdims=True)
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ds, (dy * xh).sum(0), rtol=1e-12)
    np.testing.assert_allclose(db, dy.sum(0), rtol=1e-12)
    # invertible op: the same from the forward output
    bias = jnp.asarray(rng.standard_normal(8))
    y = xh * s + bias
    got = ops.invertible_layer_normalization_grad(dy, y, s, bias, i)
    for g, w in zip(got, (dx, ds, db)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10)


BN_SHAPES = [(2, 3), (4, 3, 5), (2, 3, 4, 5), (1, 2, 3, 2, 2), (3, 1, 7), (0, 3, 2)]
# (T = X/dY, T1 = scale/B, T2 = mean/var): ORT's combinations plus bf16
BN_TYPES = [(f32, f32, f32), (f64, f64, f64), (f16, f16, f16), (f16, f16, f32), (f16, f32, f32),
            (bf16, f32, f32), (bf16, bf16, bf16)]
BN_TYPE_IDS = ["f32", "f64", "f16", "f16-f16-f32", "f16-f32-f32", "bf16-f32-f32", "bf16"]


def make_bn(rng, shape, types=(f64, f64, f64)):
    T, T1, T2 = types
    c = shape[1]
    x = rng.standard_normal(shape) * 2 + 0.5
    red = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=red) if x.size else np.zeros(c)
    inv = 1 / np.sqrt((x.var(axis=red) if x.size else np.ones(c)) + 1e-5)
    j = jnp.asarray
    return dict(x=j(x, T), dy=j(rng.standard_normal(shape), T),
                scale=j(rng.uniform(0.5, 1.5, c), T1), b=j(rng.standard_normal(c), T1),
                mean=j(mean, T2), inv=j(inv, T2),
                in_mean=j(rng.standard_normal(c), T2), in_var=j(rng.uniform(0.5, 2, c), T2))


BN_MATRIX = ([(t, (2, 3, 4, 5)) for t in BN_TYPES]
             + [(BN_TYPES[0] if i % 2 else BN_TYPES[5], s)
                for i, s in enumerate(BN_SHAPES) if s != (2, 3, 4, 5)])
BN_MATRIX_IDS = [f"{BN_TYPE_IDS[BN_TYPES.index(t)]}-{s}" for t, s in BN_MATRIX]


@pytest.mark.parametrize("types,shape", BN_MATRIX, ids=BN_MATRIX_IDS)
def test_bn_grad_matches_reference(rng, types, shape):
    d = make_bn(rng, shape, types)
    args = (d["dy"], d["x"], d["scale"], d["mean"], d["inv"])
    outs = jax.jit(functools.partial(ops.batch_normalization_grad, epsilon=1e-5))(*args)
    expected = jax.jit(ref.batch_normalization_grad)(*[jnp.asarray(a, f64) for a in args])
    assert [o.dtype for o in outs] == [types[0], types[1], types[1]]
    # X_grad's terms cancel: its tolerance scales with |scale * inv_std * dY| * (1 + xhat^2).
    # scale_grad = sum(dY * xhat) and bias_grad = sum(dY) over all but the channels cancel too
    # (jax 0.8 CI: 8.1e-8 off a near-zero bf16 sum against a 2.6e-8 tolerance scaled by it).
    dy, x = (np.asarray(a, np.float64) for a in (d["dy"], d["x"]))
    per_channel = (1, -1) + (1,) * (len(shape) - 2)
    xhat = (x - np.asarray(d["mean"], np.float64).reshape(per_channel)) * np.asarray(
        d["inv"], np.float64).reshape(per_channel)
    red = (0,) + tuple(range(2, len(shape)))
    sums = [np.abs(dy * xhat).sum(axis=red), np.abs(dy).sum(axis=red)]
    assert_ln_close("bn", outs, expected, (args[0], None, args[2], args[4]), sums=sums)


@pytest.mark.parametrize("types,shape", [m for m in BN_MATRIX if m[1][0] > 0],
                         ids=[i for m, i in zip(BN_MATRIX, BN_MATRIX_IDS) if m[1][0] > 0])
def test_batch_norm_internal_matches_reference(rng, types, shape):
    d = make_bn(rng, shape, types)
    args = (d["x"], d["scale"], d["b"], d["in_mean"], d["in_var"])
    outs = jax.jit(functools.partial(ops.batch_norm_internal, epsilon=1e-3, momentum=0.8))(*args)
    expected = jax.jit(functools.partial(ref.batch_norm_internal, epsilon=1e-3, momentum=0.8))(
        *[jnp.asarray(a, f64) for a in args])
    assert [o.dtype for o in outs] == [types[0]] + [types[2]] * 4
    for o, e in zip(outs, expected):
        assert_close(o, e, o.dtype, ulps=16)
    # the written-out semantics: biased variance, momentum weighs the old statistics
    x = np.asarray(d["x"], np.float64)
    red = (0,) + tuple(range(2, len(shape)))
    mean, var = x.mean(axis=red), x.var(axis=red)
    mom, eps = float(np.float32(0.8)), float(np.float32(1e-3))  # ORT's attributes are f32
    want_rm = mom * np.asarray(d["in_mean"], np.float64) + (1 - mom) * mean
    want_rv = mom * np.asarray(d["in_var"], np.float64) + (1 - mom) * var
    for o, w in ((outs[1], want_rm), (outs[2], want_rv), (outs[3], mean),
                 (outs[4], 1 / np.sqrt(var + eps))):
        assert_close(o, w, o.dtype, ulps=16)


def test_batch_norm_internal_inference_mode(rng):
    d = make_bn(rng, (4, 3, 5))
    y, *rest = ops.batch_norm_internal(d["x"], d["scale"], d["b"], d["in_mean"], d["in_var"],
                                       training_mode=0)
    assert rest == [None] * 4
    shape = (1, 3, 1)
    want = (d["scale"].reshape(shape) * (d["x"] - d["in_mean"].reshape(shape))
            / jnp.sqrt(d["in_var"].reshape(shape) + 1e-5) + d["b"].reshape(shape))
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_bn_grad_reads_inverse_std(rng):
    # ORT's input 4 (named `variance`) is BatchNormInternal's saved_inv_std; epsilon is unused
    d = make_bn(rng, (4, 3, 5))
    _, _, _, saved_mean, saved_inv = ops.batch_norm_internal(
        d["x"], d["scale"], d["b"], d["in_mean"], d["in_var"])
    a = ops.batch_normalization_grad(d["dy"], d["x"], d["scale"], saved_mean, saved_inv, epsilon=1e-5)
    b = ops.batch_normalization_grad(d["dy"], d["x"], d["scale"], saved_mean, saved_inv, epsilon=0.5)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    # against autodiff of the training-mode forward pass
    f = lambda x, s, b: ref.bn_train_core(x, s, b, d["in_mean"], d["in_var"], epsilon=1e-5,
                                          momentum=0.9, batch=0)[0]
    _, vjp = jax.vjp(f, d["x"], d["scale"], d["b"])
    for g, w in zip(a, vjp(d["dy"])):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10)


def _ln_call(op, axis=-1):
    return functools.partial(LN_FN[op], axis=axis)


# jit against eager, the kernels traced (and not under JAXOPS_DISABLE), check_grads order 2 in
# fwd and rev mode on every operand: tests/test_op_matrix.py


def _stack(a, ax, batch=3):
    if ax is None:
        return a
    return jnp.moveaxis(jnp.stack([a * (1 + 0.1 * k) for k in range(batch)]), 0, ax)


LN_VMAP = [(0, 0, None), (1, 1, None), (0, 0, 0), (None, 0, None), (0, None, 0), (-1, -1, -1)]


@pytest.mark.parametrize("op", LN_OPS)
@pytest.mark.parametrize("in_axes", LN_VMAP, ids=str)
def test_ln_vmap(rng, op, in_axes):
    # in_axes: (dY and X/Y, statistics, scale and bias)
    args = make_ln(rng, op, (4, 5), -1)
    kinds = {"layer": "bbssb", "simplified": "bbsb", "invertible": "bbsss"}[op]
    kinds = [k if not (op != "layer" and i == len(kinds) - 1) else "t" for i, k in enumerate(kinds)]
    pick = {"b": 0, "t": 1, "s": 2}
    axes = []
    for i, k in enumerate(kinds):
        ax = in_axes[pick[k]] if k != "b" else in_axes[0]
        if k == "b" and i == 0:
            ax = in_axes[0]
        if op == "layer" and i == 3:  # mean: statistics
            ax = in_axes[1]
        if op == "layer" and i == 2:
            ax = in_axes[2]
        axes.append(ax)
    axes = [ax if ax is None or ax >= 0 else a.ndim for ax, a in zip(axes, args)]
    if all(a is None for a in axes):
        return
    batched = [_stack(a, ax) for a, ax in zip(args, axes)]
    got = jax.jit(jax.vmap(_ln_call(op), in_axes=axes))(*batched)
    want = jax.jit(jax.vmap(functools.partial(LN_REF[op], axis=-1), in_axes=axes))(*batched)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_axes", [(0, 0, None, 0, 0), (1, 1, 0, None, None), (None, 0, 0, 0, 0)],
                         ids=str)
def test_bn_vmap(rng, in_axes):
    d = make_bn(rng, (3, 2, 4))
    grad_args = [d["dy"], d["x"], d["scale"], d["mean"], d["inv"]]
    batched = [_stack(a, ax) for a, ax in zip(grad_args, in_axes)]
    got = jax.vmap(functools.partial(ops.batch_normalization_grad, epsilon=1e-5), in_axes)(
        *batched)
    want = jax.vmap(ref.batch_normalization_grad, in_axes)(*batched)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    train_axes = (in_axes[1], in_axes[2], in_axes[2], in_axes[3], in_axes[4])
    train_args = [d["x"], d["scale"], d["b"], d["in_mean"], d["in_var"]]
    batched = [_stack(a, ax) for a, ax in zip(train_args, train_axes)]
    got = jax.vmap(ops.batch_norm_internal, train_axes)(*batched)
    want = jax.vmap(ref.batch_norm_internal, train_axes)(*batched)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", LN_OPS)
def test_ln_vmap_of_grad(rng, op):
    args = make_ln(rng, op, (3, 4, 5), -1)
    w = jnp.asarray(rng.standard_normal((4, 5)))
    def loss(fn, *a):
        return sum(jnp.sum(jnp.sin(o) * (w if o.ndim == 2 else w[0])) for o in fn(*a, axis=-1))
    n = len(args)
    for argnums in (0, tuple(range(n))):
        in_axes = (0, 0) + (None,) * (n - 2)  # per-example rows, shared scale (unbatched)
        unb = [a if ax == 0 else a for a, ax in zip(args, in_axes)]
        unb = [a if i < 2 or i == n - 1 or (op == "layer" and i == 3) else a for i, a in enumerate(unb)]
        stats_axes = tuple(0 if (i == n - 1 or (op == "layer" and i == 3)) else ax
                           for i, ax in enumerate(in_axes))
        got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, LN_FN[op]), argnums),
                               stats_axes))(*unb)
        want = jax.jit(jax.vmap(jax.grad(functools.partial(loss, LN_REF[op]), argnums),
                                stats_axes))(*unb)
        jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-10), got, want)


def _plain_layer_norm(x, s, b, axis, eps=1e-5):
    axes = tuple(range(axis % x.ndim, x.ndim))
    m = x.mean(axis=axes, keepdims=True)
    v = ((x - m) ** 2).mean(axis=axes, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * s + b


def _plain_rms_norm(x, s, axis, eps=1e-5):
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x / jnp.sqrt((x ** 2).mean(axis=axes, keepdims=True) + eps) * s


@pytest.mark.parametrize("axis", [-1, 1])
def test_nn_layer_norm_and_rms_norm(rng, axis):  # axis 1: every dim from 1 on is normalised
    # 8 features: a row of 4 can have a variance near 0, where check_grads' finite differences
    # of the curvature fail (1 seed in 200; the autodiff itself matched to 4e-15)
    x = jnp.asarray(rng.standard_normal((2, 3, 8)))
    feat = x.shape[axis:]
    s, b = jnp.asarray(rng.standard_normal(feat)), jnp.asarray(rng.standard_normal(feat))
    w = jnp.asarray(rng.standard_normal(x.shape))
    cases = [(lambda x, s, b: jaxops.nn.layer_norm(x, s, b, axis),
              lambda x, s, b: _plain_layer_norm(x, s, b, axis),
              "jaxops_layer_normalization_grad"),
             (lambda x, s, b: jaxops.nn.rms_norm(x, s, axis),
              lambda x, s, b: _plain_rms_norm(x, s, axis),
              "jaxops_simplified_layer_normalization_grad")]
    for fn, plain, kernel in cases:
        np.testing.assert_allclose(jax.jit(fn)(x, s, b), plain(x, s, b), rtol=1e-12, atol=1e-12)
        loss = lambda f: lambda *a: jnp.sum(jnp.cos(f(*a)) * w)
        argnums = (0, 1, 2) if "layer_norm" in kernel else (0, 1)
        got = jax.jit(jax.grad(loss(fn), argnums))(x, s, b)
        want = jax.jit(jax.grad(loss(plain), argnums))(x, s, b)
        for g, e in zip(got, want):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)
        assert kernel in str(jax.make_jaxpr(jax.grad(loss(fn)))(x, s, b))
    if axis == -1:  # custom_vjp: reverse mode only
        check_grads(jax.jit(lambda x, s, b: jaxops.nn.layer_norm(x, s, b, axis)), (x, s, b),
                    order=2, modes=("rev",))
        check_grads(jax.jit(lambda x, s: jaxops.nn.rms_norm(x, s, axis)), (x, s), order=2,
                    modes=("rev",))


def test_nn_vmap_of_grad(rng):
    # per-example x, shared or per-example scale/bias
    x = jnp.asarray(rng.standard_normal((3, 4, 5)))
    s, b = jnp.asarray(rng.standard_normal(5)), jnp.asarray(rng.standard_normal(5))
    loss = lambda f: lambda x, s, b: jnp.sum(jnp.sin(f(x, s, b)))
    for in_axes in ((0, None, None), (0, 0, 0)):
        sb = (s, b) if in_axes[1] is None else (jnp.stack([s] * 3) * 1.1, jnp.stack([b] * 3))
        got = jax.jit(jax.vmap(jax.grad(loss(jaxops.nn.layer_norm), (0, 1, 2)), in_axes))(x, *sb)
        want = jax.vmap(jax.grad(loss(lambda *a: _plain_layer_norm(*a, -1)), (0, 1, 2)),
                        in_axes)(x, *sb)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [f32, f16, bf16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("param_dtype", [f32, None], ids=["f32-params", "same-params"])
def test_nn_grad_dtypes(rng, dtype, param_dtype):
    pdt = param_dtype or dtype
    x = jnp.asarray(rng.standard_normal((8, 33)), dtype)
    s = jnp.asarray(rng.uniform(0.5, 1.5, 33), pdt)
    b = jnp.asarray(rng.standard_normal(33), pdt)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jaxops.nn.layer_norm(*a)[:, :5].astype(f32)),
                         (0, 1, 2)))(x, s, b)
    e = jax.jit(jax.grad(lambda *a: jnp.sum(_plain_layer_norm(*a, -1)[:, :5]), (0, 1, 2)))(
        *[jnp.asarray(a, f64) for a in (x, s, b)])
    for gi, ei, want_dtype in zip(g, e, (dtype, pdt, pdt)):
        assert gi.dtype == want_dtype
        assert_close(gi, ei, want_dtype, ulps=32)


@pytest.mark.parametrize("op", LN_OPS)
@pytest.mark.parametrize("spec", [P("x"), P("x", None, None), P(None, "x"), P("x", "y")], ids=str)
def test_ln_sharded_input_is_not_gathered(rng, op, spec):
    devices = on_cpu_devices(4)
    mesh = Mesh(np.array(devices).reshape(2, 2), ("x", "y")) if "y" in spec else \
        Mesh(np.array(devices), ("x",))
    args = make_ln(rng, op, (8, 4, 6), -1, (f32, f32, f32))
    sharding = NamedSharding(mesh, spec)
    # rows are sharded; statistics follow X's leading dims
    stats_spec = P(*tuple(spec)[:2]) if len(tuple(spec)) else spec
    put = [jax.device_put(a, sharding) if a.ndim == 3 else
           jax.device_put(a, NamedSharding(mesh, stats_spec)) if a.shape[:2] == (8, 4) else a
           for a in args]
    fn = jax.jit(_ln_call(op))
    hlo = fn.lower(*put).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    out = fn(*put)
    assert out[0].sharding.spec[:len(spec)] == tuple(spec)[:len(out[0].sharding.spec)]
    for a, b in zip(out, LN_FN[op](*args)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_ln_sharded_normalised_axis_stays_correct(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    args = make_ln(rng, "layer", (4, 8), -1, (f32, f32, f32))
    sharding = NamedSharding(mesh, P(None, "x"))
    put = [jax.device_put(a, sharding) if a.shape == (4, 8) else a for a in args]
    for a, b in zip(jax.jit(_ln_call("layer"))(*put), LN_FN["layer"](*args)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bn_sharded_channels_not_gathered(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    d = make_bn(rng, (3, 8, 5), (f32, f32, f32))
    big, small = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P("x"))
    put = lambda a: jax.device_put(a, big if a.ndim == 3 else small)
    for fn, keys in ((functools.partial(ops.batch_normalization_grad, epsilon=1e-5),
                      ("dy", "x", "scale", "mean", "inv")),
                     (ops.batch_norm_internal, ("x", "scale", "b", "in_mean", "in_var"))):
        args = [put(d[k]) for k in keys]
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo
        for a, b in zip(jax.jit(fn)(*args), fn(*[d[k] for k in keys])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sharded_grad_of_nn_layer_norm(rng):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 32)), f32), NamedSharding(mesh, P("x")))
    s, b = jnp.ones(32, f32), jnp.zeros(32, f32)
    grad = jax.jit(jax.grad(lambda x, s, b: jnp.sum(jaxops.nn.layer_norm(x, s, b) ** 3), (0, 1, 2)))
    assert "all-gather" not in grad.lower(x, s, b).compile().as_text()
    gx, gs, gb = grad(x, s, b)
    assert gx.sharding.spec[0] == "x"
    want = jax.grad(lambda x, s, b: jnp.sum(_plain_layer_norm(x, s, b, -1) ** 3), (0, 1, 2))(
        np.asarray(x), s, b)
    for g, w in zip((gx, gs, gb), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", LN_OPS)
def test_deterministic(rng, op):
    args = make_ln(rng, op, (300, 96), -1, (bf16, f32, bf16))
    fn = jax.jit(_ln_call(op))
    first = fn(*args)
    for _ in range(2):
        for a, b in zip(fn(*args), first):
            np.testing.assert_array_equal(a, b)


LN_LABELS = {"layer": ["Y_grad", "X", "scale", "mean", "inv_std_dev"],
             "simplified": ["Y_grad", "X", "scale", "inv_std_var"],
             "invertible": ["Y_grad", "Y", "scale", "bias", "inv_std_var"]}


@pytest.mark.parametrize("op", LN_OPS)
def test_ln_bad_input(rng, op):
    args = list(make_ln(rng, op, (2, 3), -1, (f32, f32, f32)))
    n = len(args)
    def with_(i, v):
        a = list(args)
        a[i] = v
        return a
    cases = [
        (with_(1, jnp.ones((2, 3), jnp.int32)), {}, TypeError, "float16"),
        (with_(0, args[0].astype(f16)), {}, TypeError, "share one dtype"),
        (with_(0, jnp.ones((3, 2), f32)), {}, ValueError, "share one shape"),
        (with_(2, jnp.ones(4, f32)), {}, ValueError, "must hold 3 values"),
        (with_(n - 1, jnp.ones(3, f32)), {}, ValueError, "must hold 2 values"),
        (with_(n - 1, args[-1].astype(f16)), {}, TypeError, "float32 or float64"),
        ([a.astype(f64) if i == 0 else a for i, a in enumerate(args)], {}, TypeError, "float64"),
        (args, {"axis": 2}, ValueError, "out of range"),
        (args, {"axis": -3}, ValueError, "out of range"),
        (args, {"axis": 1.0}, TypeError, "axis must be an int"),
        ([jnp.float32(1)] * 2 + args[2:], {"axis": 0}, ValueError, "rank >= 1|share one shape"),
    ]
    for a, kwargs, error, text in cases:
        with pytest.raises(error, match=text) as info:
            LN_FN[op](*a, **kwargs)
        assert f"jaxops.ops.{LN_FN[op].__name__}" in str(info.value)
        with pytest.raises(error, match=text):  # also at trace time under jit
            jax.jit(functools.partial(LN_FN[op], **kwargs))(*a)


def test_bn_bad_input(rng):
    d = make_bn(rng, (2, 3, 4), (f32, f32, f32))
    g = [d["dy"], d["x"], d["scale"], d["mean"], d["inv"]]
    t = [d["x"], d["scale"], d["b"], d["in_mean"], d["in_var"]]
    def with_(args, i, v):
        a = list(args)
        a[i] = v
        return a
    cases = [
        (ops.batch_normalization_grad, with_(g, 0, d["dy"].astype(f16)), TypeError, "share one dtype"),
        (ops.batch_normalization_grad, with_(g, 0, d["dy"][:1]), ValueError, "share one shape"),
        (ops.batch_normalization_grad, with_(g, 2, jnp.ones(4, f32)), ValueError, r"shape \(3,\)"),
        (ops.batch_normalization_grad, with_(g, 3, d["mean"].astype(f16)), TypeError, "share one dtype"),
        (ops.batch_normalization_grad, with_(g, 1, jnp.ones((2, 3, 4), jnp.int32)), TypeError, "float16"),
        (ops.batch_normalization_grad, [jnp.ones(3, f32)] * 2 + g[2:], ValueError, "rank >= 2"),
        (ops.batch_norm_internal, with_(t, 2, jnp.ones((3, 1), f32)), ValueError, r"shape \(3,\)"),
        (ops.batch_norm_internal, with_(t, 0, d["x"].astype(f64)), TypeError, "float64"),
        (ops.batch_norm_internal, with_(t, 4, None), TypeError, "input_var is required"),
    ]
    for fn, a, error, text in cases:
        kw = {"epsilon": 1e-5} if fn is ops.batch_normalization_grad else {}
        with pytest.raises(error, match=text) as info:
            fn(*a, **kw)
        assert f"jaxops.ops.{fn.__name__}" in str(info.value)
        if all(v is not None for v in a):
            with pytest.raises(error, match=text):
                jax.jit(functools.partial(fn, **kw))(*a)
    # epsilon is required by ORT's schema (and unused: the kernel reads the saved inverse std)
    with pytest.raises(TypeError, match="jaxops.ops.batch_normalization_grad: missing .*epsilon"):
        ops.batch_normalization_grad(*g)


def test_disable_routes_to_reference(rng, monkeypatch):
    args = make_ln(rng, "layer", (4, 9), -1, (f32, f32, f32))
    trace = lambda: str(jax.make_jaxpr(lambda *a: ops.layer_normalization_grad(*a))(*args))
    for value in ("all", "batch_norm_internal, layer_normalization_grad"):
        monkeypatch.setenv("JAXOPS_DISABLE", value)
        assert "jaxops_layer_normalization_grad" not in trace()
        for a, b in zip(ops.layer_normalization_grad(*args), ref.layer_normalization_grad(*args)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    monkeypatch.setenv("JAXOPS_DISABLE", "batch_norm_internal")
    assert "jaxops_layer_normalization_grad" in trace()


def test_ort_ops_table():
    ms = "com.microsoft"
    assert ops.ORT_OPS[(ms, "LayerNormalizationGrad")] is ops.layer_normalization_grad
    assert ops.ORT_OPS[(ms, "SimplifiedLayerNormalizationGrad")] is ops.simplified_layer_normalization_grad
    assert ops.ORT_OPS[(ms, "InvertibleLayerNormalizationGrad")] is ops.invertible_layer_normalization_grad
    assert ops.ORT_OPS[(ms, "BatchNormalizationGrad")] is ops.batch_normalization_grad
    assert ops.ORT_OPS[(ms, "BatchNormInternal")] is ops.batch_norm_internal


# The CUDA kernels switch paths here: register-cached rows (widths that are multiples of the
# 16-byte vector, up to 1024 vectors), streamed rows (longer, or odd widths), many groups.
LARGE = [((64, 4096), bf16), ((33, 8192), bf16), ((5, 8200), bf16), ((3, 4097), f32),
         ((7, 20000), f32), ((300, 1000), f16), ((2, 3, 512), f64)]


@pytest.mark.parametrize("op", LN_OPS)
@pytest.mark.parametrize("shape,dtype", LARGE, ids=str)
def test_ln_large_shapes(rng, op, shape, dtype):
    types = (dtype, f64 if dtype == f64 else f32, dtype)
    args = make_ln(rng, op, shape, -1, types)
    assert_ln_close(op, jax.jit(_ln_call(op))(*args), f64_expected(op, args, -1), args, ulps=64)


@pytest.mark.parametrize("shape", [(64, 16, 9, 9), (2, 300, 3), (512, 7)], ids=str)
def test_bn_large_shapes(rng, shape):
    d = make_bn(rng, shape, (bf16, f32, f32))
    outs = ops.batch_normalization_grad(d["dy"], d["x"], d["scale"], d["mean"], d["inv"],
                                        epsilon=1e-5)
    exp = ref.batch_normalization_grad(*[jnp.asarray(d[k], f64) for k in ("dy", "x", "scale", "mean", "inv")])
    for o, e in zip(outs, exp):
        assert_close(o, e, o.dtype, ulps=64)


@pytest.mark.gpu
@pytest.mark.parametrize("op", LN_OPS)
def test_gpu_many_rows_per_block_deterministic(rng, op):
    # thousands of rows: each block walks many rows (the prefetching loop) and many blocks'
    # partial column sums meet in col_sums; repeated runs must agree bit for bit
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA device")
    args = make_ln(rng, op, (4096, 4096), -1, (bf16, f32, bf16))
    fn = jax.jit(_ln_call(op))
    first = fn(*args)
    assert_ln_close(op, first, f64_expected(op, args, -1), args, ulps=64)
    for _ in range(3):
        for a, b in zip(fn(*args), first):
            np.testing.assert_array_equal(a, b)
    d = make_bn(rng, (64, 32, 14, 14), (bf16, f32, f32))
    g = jax.jit(functools.partial(ops.batch_normalization_grad, epsilon=1e-5))
    out = g(d["dy"], d["x"], d["scale"], d["mean"], d["inv"])
    for _ in range(3):
        for a, b in zip(g(d["dy"], d["x"], d["scale"], d["mean"], d["inv"]), out):
            np.testing.assert_array_equal(a, b)
