"""The CPU depthwise convolution kernels (jaxops/ops/depthwise_cpu.py, ffi/cpu/depthwise.cc): the
forward, dx and dw match XLA's convolution and its transposes on fresh inputs with both loop codes,
at planes that leave partial blocks, multipliers, dilations and pads past the kernel's reach;
an inf or NaN in x stays where the reference has it; jit, vmap (every pattern, vmap of grad),
gradients of any order (the family's own transposes), sharding by images with no gather, clear
errors; and conv_general/ConvGrad take them only where chosen (a training step's depthwise
convolutions on the CPU, stride 1)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.test_util import check_grads

from helpers import on_cpu_devices
from jaxops.ops import conv, depthwise_cpu

# (x [N, C, H, W], multiplier, kernel, dilations, padding)
CASES = [
    ((2, 16, 8, 8), 1, (7, 7), (1, 1), ((3, 3), (3, 3))),    # ConvNeXt's, two blocks a plane
    ((2, 32, 4, 4), 1, (7, 7), (1, 1), ((3, 3), (3, 3))),    # taps reaching past the plane
    ((1, 3, 5, 7), 2, (3, 2), (2, 1), ((1, 0), (2, 3))),     # multiplier, dilated, asymmetric
    ((2, 4, 6, 6), 1, (3, 3), (1, 1), ((0, 0), (0, 0))),     # unpadded
    ((1, 2, 3, 3), 3, (5, 5), (1, 1), ((4, 4), (4, 5))),     # pads wider than the reach
    ((3, 5, 9, 4), 1, (1, 3), (1, 3), ((0, 2), (6, 0))),
    ((1, 8, 20, 21), 1, (3, 3), (1, 1), ((1, 1), (1, 1))),   # planes of many blocks
]
IDS = ["convnext8", "convnext4", "multiplier", "unpadded", "wide_pads", "rows", "blocks"]
ISAS = ["best", "generic", "avx2"]


def _inputs(case, seed=0, dtype=jnp.float32):
    (n, c, h, w), m, kernel, dil, pad = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, c, h, w)), dtype)
    wt = jnp.asarray(rng.standard_normal((c * m, 1, *kernel)), dtype)
    y = jax.eval_shape(lambda: depthwise_cpu.forward(x, wt, dil, pad))
    dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
    return x, wt, dy


def _fns(case, isa="best"):
    """(forward, dx, dw) of the kernels at case's geometry, and of the references."""
    x_shape, _, kernel, dil, pad = case
    p = {"dilations": dil, "padding": pad}
    ours = (lambda x, w: depthwise_cpu.forward(x, w, dil, pad, isa),
            lambda dy, w: depthwise_cpu.dx(dy, w, x_shape[1:], dil, pad, isa),
            lambda dy, x: depthwise_cpu.dw(dy, x, kernel, dil, pad, isa))
    refs = (lambda x, w: depthwise_cpu._forward_reference(x, w, **p),
            lambda dy, w: depthwise_cpu._dx_reference(dy, w, x_shape=x_shape[1:], **p),
            lambda dy, x: depthwise_cpu._dw_reference(dy, x, kernel=kernel, **p))
    return ours, refs


def _close(a, b, k):
    # f32 sums of k products of O(1) terms, in another order than XLA's
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=8 * k ** 0.5 * 1.2e-7 * 4)


def _terms(case):
    """How many products the forward/dx sums (taps x multiplier) and dw sums (images x pixels)."""
    (n, _, h, w), m, kernel, _, _ = case
    return np.prod(kernel) * m, n * h * w * 4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_xla_and_is_one_ffi_call_each(case, isa):
    x, w, dy = _inputs(case, seed=hash(case) % 1000)
    (f, fx, fw), (rf, rx, rw) = _fns(case, isa)
    k_taps, k_pixels = _terms(case)
    for fn, ref, args, k, target in [(f, rf, (x, w), k_taps, "jaxops_depthwise_conv\""),
                                     (fx, rx, (dy, w), k_taps, "jaxops_depthwise_conv_dx"),
                                     (fw, rw, (dy, x), k_pixels, "jaxops_depthwise_conv_dw")]:
        jitted = jax.jit(fn)
        _close(jitted(*args), ref(*args), k)
        hlo = jitted.lower(*args).compile().as_text()
        assert target.strip('"') in hlo and "convolution(" not in hlo


@pytest.mark.parametrize("case", CASES[:3], ids=IDS[:3])
def test_non_finite_inputs_as_the_reference(case):
    # dw's flat loops multiply the zeros past each dy row by x pixels no output reads: a plane
    # of x with an inf or a NaN goes row by row, so they reach only the taps that read them
    x, w, dy = _inputs(case, seed=5)
    x = x.at[0, 0, 1, 1].set(jnp.inf).at[-1, -1, 0, 0].set(jnp.nan)
    w = w.at[0, 0, 0, 0].set(jnp.inf)
    (f, fx, fw), (rf, rx, rw) = _fns(case)
    for fn, ref, args in [(f, rf, (x, w)), (fx, rx, (dy, w)), (fw, rw, (dy, x))]:
        out, expected = np.asarray(fn(*args)), np.asarray(ref(*args))
        assert np.array_equal(np.isnan(out), np.isnan(expected))
        assert np.array_equal(np.isinf(out), np.isinf(expected))
        finite = np.isfinite(expected)
        assert finite.any() and not finite.all()
        np.testing.assert_allclose(out[finite], expected[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_vmap_every_pattern_and_vmap_grad(case):
    triples = [_inputs(case, seed=s) for s in range(3)]
    xs, ws, dys = zip(*triples)
    xb, wb, dyb = jnp.stack(xs), jnp.stack(ws), jnp.stack(dys)
    k_taps, k_pixels = _terms(case)
    for fn, ref, (a, b), (a0, b0), k in zip(*_fns(case), [(xb, wb), (dyb, wb), (dyb, xb)],
                                            [(xs[0], ws[0]), (dys[0], ws[0]), (dys[0], xs[0])],
                                            [k_taps, k_taps, k_pixels]):
        _close(jax.vmap(fn)(a, b), jax.vmap(ref)(a, b), k)
        _close(jax.vmap(fn, (0, None))(a, b0), jax.vmap(ref, (0, None))(a, b0), k)
        _close(jax.vmap(fn, (None, 0))(a0, b), jax.vmap(ref, (None, 0))(a0, b), k)
        _close(jax.vmap(fn, (2, 1))(jnp.moveaxis(a, 0, 2), jnp.moveaxis(b, 0, 1)),
               jax.vmap(ref)(a, b), k)
    f, rf = _fns(case)[0][0], _fns(case)[1][0]
    g = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1)))
    gr = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(rf(x, w))), (0, 1)))
    for a, b in zip(g(xb, wb), gr(xb, wb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES[1:4], ids=IDS[1:4])
def test_gradients_any_order_on_the_kernels(case):
    x, w, dy = _inputs(case, seed=2)
    for fn, args in zip(_fns(case)[0], [(x, w), (dy, w), (dy, x)]):
        check_grads(lambda a, b: fn(a, b) ** 2, args, order=2, modes=("fwd", "rev"), eps=1e-2,
                    atol=5e-2, rtol=5e-2)
    # a gradient's jaxpr holds only the kernels: the transposes are the family's own
    f = _fns(case)[0][0]
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1)))(x, w))
    assert "jaxops_depthwise_conv_dx" in jaxpr and "jaxops_depthwise_conv_dw" in jaxpr
    assert "conv_general_dilated" not in jaxpr


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_sharded_images_without_gather(case):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x, w, dy = _inputs(case)
    x, dy = jnp.concatenate([x] * (4 // x.shape[0] + 1))[:4], \
        jnp.concatenate([dy] * (4 // dy.shape[0] + 1))[:4]  # 4 images
    shard = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("x")))
    k_taps, k_pixels = _terms(case)
    for fn, ref, args, k in zip(*_fns(case), [(x, w), (dy, w), (dy, x)],
                                [k_taps, k_taps, 4 * k_pixels]):
        placed = [shard(a) if a.shape[0] == 4 else a for a in args]
        jitted = jax.jit(fn)
        hlo = jitted.lower(*placed).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo and "jaxops_depthwise" in hlo
        out = jitted(*placed)
        if out.shape[0] == 4:  # the forward's and dx's images stay sharded; dw is psum'd
            assert out.sharding.spec[:1] == ("x",)
        _close(out, ref(*args), k)


X, W, DY = (2, 4, 6, 6), (4, 1, 3, 3), (2, 4, 6, 6)
z = lambda shape: jnp.zeros(shape, jnp.float32)  # (the tests run with x64 on)


@pytest.mark.parametrize("call, error, match", [
    (lambda: depthwise_cpu.forward_op(jnp.zeros(X, jnp.float64), jnp.zeros(W, jnp.float64),
                                      dilations=(1, 1), padding=((1, 1), (1, 1))),
     TypeError, "float32"),
    (lambda: depthwise_cpu.forward_op(z(X[1:]), z(W), dilations=(1, 1),
                                      padding=((1, 1), (1, 1))), ValueError, "rank 4"),
    (lambda: depthwise_cpu.forward_op(z(X), z((6, 1, 3, 3)), dilations=(1, 1),
                                      padding=((1, 1), (1, 1))), ValueError, r"C \* M"),
    (lambda: depthwise_cpu.forward_op(z(X), z((4, 2, 3, 3)), dilations=(1, 1),
                                      padding=((1, 1), (1, 1))), ValueError, r"C \* M"),
    (lambda: depthwise_cpu.forward_op(z(X), z(W), dilations=(0, 1),
                                      padding=((1, 1), (1, 1))), ValueError, ">= 1"),
    (lambda: depthwise_cpu.forward_op(z(X), z(W), dilations=(1, 1),
                                      padding=((-1, 1), (1, 1))), ValueError, ">= 0"),
    (lambda: depthwise_cpu.forward_op(z(X), z((4, 1, 9, 3)), dilations=(1, 1),
                                      padding=((1, 1), (1, 1))), ValueError, "larger than"),
    (lambda: depthwise_cpu.forward_op(z(X), z(W), dilations=(1, 1),
                                      padding=((1, 1), (1, 1)), isa="sse"), ValueError, "isa"),
    # pads from a hostile model: refused before any buffer is sized from them
    (lambda: depthwise_cpu.forward_op(z(X), z(W), dilations=(1, 1),
                                      padding=((1 << 16, 1 << 16), (1 << 16, 1 << 16))),
     ValueError, "2\\*\\*31"),
    (lambda: depthwise_cpu.forward_op(z(X), z(W), dilations=(1 << 40, 1),
                                      padding=((1, 1), (1, 1))), ValueError, "larger than"),
    (lambda: depthwise_cpu.dx_op(z((2, 4, 5, 6)), z(W), x_shape=X[1:],
                                 dilations=(1, 1), padding=((1, 1), (1, 1))),
     ValueError, "dy must have shape"),
    (lambda: depthwise_cpu.dx_op(jnp.zeros(DY, jnp.int32), z(W), x_shape=X[1:],
                                 dilations=(1, 1), padding=((1, 1), (1, 1))),
     ValueError, "float32"),
    (lambda: depthwise_cpu.dw_op(z(DY), z((2, 4, 6, 5)), kernel=(3, 3),
                                 dilations=(1, 1), padding=((1, 1), (1, 1))),
     ValueError, "dy must have shape"),
    (lambda: depthwise_cpu.dw_op(z(DY), z(X), kernel=(3,), dilations=(1, 1),
                                 padding=((1, 1), (1, 1))), ValueError, "kernel"),
])
def test_bad_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match) as e:
        call()
    assert "depthwise_conv" in str(e.value)


def _lowered(platform, x_shape, w_shape, strides, padding, dtype=jnp.float32, grad=False):
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    w = jax.ShapeDtypeStruct(w_shape, dtype)
    attrs = {"group": x_shape[1] // w_shape[1], "strides": list(strides),
             "pads": [p for p, _ in padding] + [p for _, p in padding]}
    if grad:  # ConvGrad's dX and dW
        y = jax.eval_shape(lambda x, w: conv.conv(x, w, **attrs), x, w)
        f = jax.jit(lambda dy, x, w: conv.conv_grad(dy, x, w, **attrs)[:2])
        return f.trace(jax.ShapeDtypeStruct(y.shape, dtype), x, w).lower(
            lowering_platforms=(platform,)).as_text()
    f = jax.jit(lambda x, w: conv.conv(x, w, **attrs))
    return f.trace(x, w).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("x_shape, w_shape, strides, padding, taken", [
    ((2, 16, 8, 8), (16, 1, 7, 7), (1, 1), [(3, 3)] * 2, True),      # ConvNeXt's
    ((2, 16, 16, 16), (32, 1, 3, 3), (1, 1), [(1, 1)] * 2, True),    # multiplier 2
    ((2, 64, 8, 8), (64, 1, 5, 5), (2, 2), [(2, 2)] * 2, False),     # strided: windowed_conv
    ((2, 16, 16, 16), (16, 4, 3, 3), (1, 1), [(1, 1)] * 2, False),   # groups of 4 channels
    ((8, 96, 56, 56), (96, 1, 7, 7), (1, 1), [(3, 3)] * 2, False),   # 944 MFLOP: XLA's
])
def test_conv_and_conv_grad_take_it_where_chosen(x_shape, w_shape, strides, padding, taken):
    for grad, targets in [(False, ["jaxops_depthwise_conv\""]),
                          (True, ["jaxops_depthwise_conv_dx", "jaxops_depthwise_conv_dw"])]:
        text = _lowered("cpu", x_shape, w_shape, strides, padding, grad=grad)
        for target in targets:
            assert (target.strip('"') in text) == taken, (grad, target)
        # not in f64, nor on a GPU
        assert "jaxops_depthwise" not in _lowered("cpu", x_shape, w_shape, strides, padding,
                                                  dtype=jnp.float64, grad=grad)
        assert "jaxops_depthwise" not in _lowered("cuda", x_shape, w_shape, strides, padding,
                                                  grad=grad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64])
def test_conv_grad_values_in_every_float(dtype):
    # ConvGrad at ConvNeXt's geometry against XLA's convolution transposed, in f32
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), dtype)
    w = jnp.asarray(rng.standard_normal((16, 1, 7, 7)), dtype)
    dy = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), dtype)
    attrs = {"group": 16, "pads": [3, 3, 3, 3]}
    y = jax.jit(lambda x, w: conv.conv(x, w, **attrs))(x, w)
    dx, dw, db = jax.jit(lambda dy, x, w: conv.conv_grad(dy, x, w, **attrs))(dy, x, w)
    f32 = lambda a: a.astype(jnp.float32)

    def ref(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), [(3, 3)] * 2,
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        feature_group_count=16, precision=lax.Precision.HIGHEST)
    ry, vjp = jax.vjp(ref, f32(x), f32(w))
    rdx, rdw = vjp(f32(dy))
    eps = float(jnp.finfo(dtype).eps)
    for out, expected in [(y, ry), (dx, rdx), (dw, rdw), (db, f32(dy).sum((0, 2, 3)))]:
        assert out.dtype == dtype
        scale = float(jnp.max(jnp.abs(expected)))
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                                   rtol=0, atol=max(4 * eps, 1e-5) * scale)


@pytest.mark.parametrize("attrs, match", [
    ({"dh": 1 << 40}, "scratch planes"),       # a reach that would size a vast scratch
    ({"dh": 0}, ">= 1"),
    ({"ph": -1}, ">= 0"),
    ({"isa": 7}, "isa"),
])
def test_the_target_refuses_hostile_attributes(attrs, match):
    # a registered FFI target is public: past the Python checks it refuses, never crashes
    from jaxops._src.ffi import available_platforms
    available_platforms()
    call = jax.ffi.ffi_call("jaxops_depthwise_conv", jax.ShapeDtypeStruct(X, jnp.float32))
    params = {"dh": 1, "dw": 1, "ph": 1, "pw": 1, "isa": 0, **attrs}
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda x, w: call(
            x, w, **{k: np.int64(v) for k, v in params.items()}))(z(X), z(W)))
