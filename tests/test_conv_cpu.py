"""The CPU convolution kernel (jaxops/ops/conv_cpu.py, ffi/include/jaxops/conv.h): XLA's values on
fresh inputs at shapes that leave partial tiles (pixels not a multiple of 6 or 12, channels not
of 16 or 32) with every tile code the CPU has, strides, dilations and pads that reach past the
input, groups, the epilogue (a folded BatchNormalization's scale and shift, a Relu's or Clip's
bounds; NaN kept); jit, vmap, gradients of any order (the reference's), sharding by images, clear
errors;
and conv_general takes it only where it is chosen (the channels-last CPU path of an inference
forward)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.test_util import check_grads

from helpers import on_cpu_devices
from jaxops.ops import conv_cpu
from jaxops.ops.conv import conv_general

# (x [N, H, W, C], w [KH, KW, C / groups, O], strides, dilations, padding[, groups])
CASES = [
    ((2, 32, 32, 3), (7, 7, 3, 64), (2, 2), (1, 1), ((3, 3), (3, 3))),      # DeepLabV3's stem
    ((2, 8, 8, 16), (3, 3, 16, 24), (2, 2), (1, 1), ((1, 1), (1, 1))),
    ((2, 4, 4, 48), (3, 3, 48, 40), (1, 1), (4, 4), ((4, 4), (4, 4))),      # dilated past the map
    ((3, 5, 7, 5), (2, 3, 5, 17), (1, 2), (2, 1), ((0, 2), (1, 0))),        # asymmetric
    ((1, 6, 6, 4), (1, 1, 4, 33), (1, 1), (1, 1), ((0, 0), (0, 0))),        # 1x1
    ((1, 3, 2, 1), (3, 2, 1, 1), (3, 1), (1, 2), ((2, 3), (0, 1))),         # one channel
    # pads and strides far beyond the image: no zero-bordered copy of it (it would be ~32 MB)
    ((1, 4, 4, 2), (3, 3, 2, 4), (1000, 1000), (1, 1), ((1000, 1000), (1000, 1000))),
    ((2, 16, 16, 16), (3, 3, 8, 16), (2, 2), (1, 1), ((1, 1), (1, 1)), 2),  # RegNet's groups
    # groups of 40 outputs (two panels and a partial one), dilated and asymmetric: tap by tap
    ((1, 7, 6, 15), (3, 2, 5, 120), (1, 2), (2, 1), ((2, 0), (1, 1)), 3),
    ((2, 5, 5, 32), (3, 3, 4, 32), (1, 1), (1, 1), ((0, 0), (0, 0)), 8),    # 4-channel groups
    # outputs in bands of the taps inside x (conv.h's spans): DeepLabV3's dilated 3x3 at 4x4;
    # bands of more than one chunk of pixels; a band split in rows only, read tap by tap
    # (dilated rows) with checks; grouped, split in rows only
    ((2, 4, 4, 32), (3, 3, 32, 48), (1, 1), (2, 2), ((2, 2), (2, 2))),
    ((4, 40, 40, 16), (3, 3, 16, 20), (1, 1), (12, 12), ((12, 12), (12, 12))),
    ((2, 9, 30, 16), (3, 3, 16, 17), (1, 1), (4, 3), ((4, 4), (1, 1))),
    ((1, 9, 20, 16), (3, 3, 8, 16), (1, 1), (4, 1), ((4, 4), (1, 1)), 2),
    # tiles across bands computing their union of taps (conv.h's merged cost): read in the
    # zero-bordered copy (5x5 stride 2; pads wider than the kernel's reach, outputs beyond
    # the image; grouped), packed with checks (dilated rows, no copy: both axes, columns only;
    # grouped)
    ((3, 10, 10, 8), (5, 5, 8, 18), (2, 2), (1, 1), ((2, 2), (2, 2))),
    ((1, 20, 20, 8), (3, 3, 8, 8), (1, 1), (1, 1), ((6, 6), (6, 6))),
    ((2, 7, 7, 32), (3, 3, 16, 32), (1, 1), (1, 1), ((1, 1), (1, 1)), 2),
    ((2, 12, 12, 16), (3, 3, 16, 20), (1, 1), (2, 2), ((2, 2), (2, 2))),
    ((1, 9, 11, 24), (3, 3, 24, 20), (1, 1), (1, 2), ((1, 1), (2, 2))),
    ((1, 9, 9, 16), (3, 3, 8, 16), (1, 1), (2, 2), ((2, 2), (2, 2)), 2),
]
IDS = ["stem7x7", "3x3s2", "dilated", "asymmetric", "1x1", "c1", "huge_pads", "grouped",
       "grouped_wide", "grouped_4", "bands", "bands_chunks", "bands_rows", "bands_grouped",
       "merged_5x5s2", "merged_wide_pads", "merged_grouped", "merged_checked",
       "merged_columns", "merged_grouped_checked"]


def _inputs(case, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(case[0]), dtype),
            jnp.asarray(rng.standard_normal(case[1]), dtype))


def _params(case):
    return dict(strides=case[2], dilations=case[3], padding=case[4],
                groups=case[5] if len(case) > 5 else 1)


def _kernel(case, **epilogue):
    """f(x, w[, scale, shift]): the kernel at case's geometry."""
    return lambda x, w, *affine: conv_cpu.conv_nhwc(x, w, *case[2:5], _params(case)["groups"],
                                                   *affine, **epilogue)


def _ref(case, lo=-np.inf, hi=np.inf):
    """The reference of _kernel(case, lo=lo, hi=hi)."""
    def f(x, w, *affine):
        o = w.shape[-1]
        scale, shift = affine or (jnp.ones(o, jnp.float32), jnp.zeros(o, jnp.float32))
        return conv_cpu._reference(x, w, scale, shift, **_params(case), affine=bool(affine),
                                   lo=lo, hi=hi)
    return f


def _close(a, b, k):
    # f32 sums of k products of O(1) terms, in another order than XLA's at worst
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=8 * k ** 0.5 * 1.2e-7 * 4)


@pytest.mark.parametrize("isa", ["best", "generic", "avx2", "avx512"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_xla_and_is_one_ffi_call(case, isa):
    # every tile code the CPU has (one it lacks runs the best below it): 6- and 12-pixel
    # tiles, one- and two-panel tiles, partial tiles of each
    x, w = _inputs(case, seed=hash(case) % 1000)
    f = jax.jit(_kernel(case, isa=isa))
    _close(f(x, w), _ref(case)(x, w), np.prod(case[1][:3]))
    hlo = f.lower(x, w).compile().as_text()
    if jax.default_backend() == "cpu":
        assert hlo.count("jaxops_conv_nhwc") >= 1 and "convolution(" not in hlo
    else:  # the CPU's kernel: elsewhere XLA's convolution
        assert "jaxops_conv_nhwc" not in hlo


@pytest.mark.parametrize("case", [CASES[1], CASES[-3]], ids=[IDS[1], IDS[-3]])
def test_vmap_every_pattern_and_vmap_grad(case):
    xs, ws = zip(*(_inputs(case, seed=s) for s in range(3)))
    xb, wb = jnp.stack(xs), jnp.stack(ws)
    ref, f = _ref(case), _kernel(case)
    k = np.prod(case[1][:3])
    _close(jax.vmap(f)(xb, wb), jax.vmap(ref)(xb, wb), k)
    _close(jax.vmap(f, (0, None))(xb, ws[0]), jax.vmap(ref, (0, None))(xb, ws[0]), k)
    _close(jax.vmap(f, (None, 0))(xs[0], wb), jax.vmap(ref, (None, 0))(xs[0], wb), k)
    _close(jax.vmap(f, (3, 4))(jnp.moveaxis(xb, 0, 3), jnp.moveaxis(wb, 0, 4)),
           jax.vmap(ref)(xb, wb), k)
    g = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1)))
    gr = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(ref(x, w))), (0, 1)))
    # the forwards differ by f32 rounding; w's gradient sums that over every output pixel
    pixels = np.prod(jax.eval_shape(f, xs[0], ws[0]).shape[:3])
    tol = 1e-4 * max(1.0, (pixels / 512) ** 0.5)
    for a, b in zip(g(xb, wb), gr(xb, wb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES[1:4] + CASES[-1:], ids=IDS[1:4] + IDS[-1:])
def test_gradients_any_order(case):
    x, w = _inputs(case)
    check_grads(_kernel(case), (x, w), order=2, modes=("fwd", "rev"), eps=1e-2, atol=5e-2,
                rtol=5e-2)


@pytest.mark.parametrize("case", [CASES[1], CASES[-3]], ids=[IDS[1], IDS[-3]])
def test_sharded_images_without_gather(case):
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x, w = _inputs(case)
    x = jnp.concatenate([x, x + 1.0])  # 4 images
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
    f = jax.jit(_kernel(case))
    hlo = f.lower(placed, w).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "jaxops_conv_nhwc" in hlo
    out = f(placed, w)
    assert out.sharding.spec[:1] == ("x",)
    _close(out, _ref(case)(x, w), np.prod(case[1][:3]))
    # output channels sharded: a shard of a grouped convolution's would not hold whole groups
    w_placed = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, None, None, "x")))
    _close(f(x, w_placed), _ref(case)(x, w), np.prod(case[1][:3]))


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize("isa", ["best", "avx2"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_more_threads_give_the_same_bits(case, isa, threads):
    # each case with enough images to be shared (conv.h's kShareFlops, 2 MFLOP a thread; the
    # two tiniest stay short of it), its chunks claimed by the calling and the helper threads
    # (as many as the CPUs allow): every output from the same tile as on one thread; packed
    # weights and the epilogue too
    out = jax.eval_shape(_kernel(case), *_inputs(case)).shape
    flops = 2 * np.prod(out) * np.prod(case[1][:3])
    n = case[0][0] * min(128, -(-(threads << 21) // int(flops)))  # threads' worth of FLOPs
    case = ((n, *case[0][1:]), *case[1:])
    x, w = _inputs(case, seed=5)
    o, groups = case[1][3], _params(case)["groups"]
    rng = np.random.default_rng(6)
    scale, shift = (jnp.asarray(rng.standard_normal(o), jnp.float32) for _ in range(2))
    one = jax.jit(_kernel(case, isa=isa, lo=-0.5))(x, w, scale, shift)
    two = jax.jit(_kernel(case, isa=isa, lo=-0.5, threads=threads))(x, w, scale, shift)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(two))
    packed = conv_cpu.pack_weights(w, groups)
    two_packed = jax.jit(lambda x, p: conv_cpu.conv_nhwc(
        x, p, *case[2:5], groups, out_channels=o, threads=threads))(x, packed)
    np.testing.assert_array_equal(np.asarray(two_packed),
                                  np.asarray(jax.jit(_kernel(case, isa=isa))(x, w)))


def test_threads_follow_kernel_threads():
    # conv_nchw's count: jaxops.cpu.kernel_threads() (1 unless kernel_threads_as says more)
    from jaxops.cpu import kernel_threads, kernel_threads_as
    x = jnp.zeros((2, 16, 8, 8), jnp.float32)
    w = jnp.zeros((24, 16, 3, 3), jnp.float32)

    def threads_in_hlo():
        f = jax.jit(lambda x, w: conv_cpu.conv_nchw(x, w, (1, 1), (1, 1), ((1, 1), (1, 1))))
        text = f.lower(x, w).as_text()
        return int(text.split("threads = ")[1].split(" ")[0])
    assert kernel_threads() == 1 and threads_in_hlo() == 1
    with kernel_threads_as(2):
        assert kernel_threads() == 2 and threads_in_hlo() == 2
    with kernel_threads_as(7):
        assert threads_in_hlo() == 7
    with pytest.raises(ValueError, match="threads"):
        with kernel_threads_as(0):
            pass


def test_large_ones_take_as_many_threads_as_xla_has(monkeypatch):
    # above MAX_FLOPS (ResNet's 154 MFLOP stem): XLA:CPU's thread count, whatever
    # kernel_threads() says (1: a program on XLA's own pool)
    x = jnp.zeros((2, 3, 128, 128), jnp.float32)
    w = jnp.zeros((64, 3, 7, 7), jnp.float32)
    assert conv_cpu.large(x.shape, w.shape, (2, 2), (1, 1), ((3, 3), (3, 3)), 1)
    assert not conv_cpu.large((2, 3, 32, 32), w.shape, (2, 2), (1, 1), ((3, 3), (3, 3)), 1)

    def threads_in_hlo():
        f = jax.jit(lambda x, w: conv_cpu.conv_nchw(x, w, (2, 2), (1, 1), ((3, 3), (3, 3))))
        return int(f.lower(x, w).as_text().split("threads = ")[1].split(" ")[0])
    for xla in (1, 2, 3, 16):
        monkeypatch.setattr(conv_cpu, "xla_threads", lambda xla=xla: xla)
        assert threads_in_hlo() == xla


@pytest.mark.parametrize("x_shape, w_shape, params, dtype, error, match", [
    ((2, 8, 8, 16), (3, 3, 16, 24), {}, jnp.float64, TypeError, "float32"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {}, jnp.int32, TypeError, "float32"),
    ((8, 8, 16), (3, 3, 16, 24), {}, jnp.float32, ValueError, "rank 4"),
    ((2, 8, 8, 16), (3, 3, 15, 24), {}, jnp.float32, ValueError, "input channels"),
    ((2, 8, 8, 16), (3, 3, 8, 24), {"groups": 4}, jnp.float32, ValueError, "input channels"),
    ((2, 8, 8, 16), (3, 3, 8, 25), {"groups": 2}, jnp.float32, ValueError, "divide"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"groups": 0}, jnp.float32, ValueError, "groups"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"strides": (0, 1)}, jnp.float32, ValueError, ">= 1"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"padding": ((-1, 0), (0, 0))}, jnp.float32, ValueError,
     ">= 0"),
    ((2, 2, 2, 16), (3, 3, 16, 24), {"padding": ((0, 0), (0, 0))}, jnp.float32, ValueError,
     "larger than"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"isa": "sse"}, jnp.float32, ValueError, "isa"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"threads": 0}, jnp.float32, ValueError, "threads"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"threads": 2.0}, jnp.float32, ValueError, "threads"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"scale": jnp.ones(23, jnp.float32), "shift": jnp.ones(23, jnp.float32)},
     jnp.float32, ValueError, r"\[O\]"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"scale": jnp.ones(24, jnp.float32)}, jnp.float32, ValueError,
     "comes with a shift"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"scale": jnp.ones(24, jnp.int32),
                                     "shift": jnp.ones(24, jnp.float32)}, jnp.float32, TypeError, "float32"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"lo": 1.0, "hi": 0.0}, jnp.float32, ValueError, "lo <= hi"),
    ((2, 8, 8, 16), (3, 3, 16, 24), {"lo": np.nan}, jnp.float32, ValueError, "lo <= hi"),
])
def test_bad_input_is_a_clear_error(x_shape, w_shape, params, dtype, error, match):
    p = {"strides": (1, 1), "dilations": (1, 1), "padding": ((1, 1), (1, 1)), **params}
    x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype)
    with pytest.raises(error, match=match) as e:
        conv_cpu.conv_nhwc(x, w, **p)
    assert "conv_nhwc" in str(e.value)


@pytest.mark.parametrize("isa", ["best", "generic", "avx2", "avx512"])
@pytest.mark.parametrize("bounds", [(-np.inf, np.inf), (0.0, np.inf), (0.0, 6.0), (-0.5, 0.25)],
                         ids=["affine", "relu", "relu6", "clip"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[-2]],
                         ids=[IDS[0], IDS[3], IDS[-2]])
def test_epilogue_matches_the_reference_nan_included(case, bounds, isa):
    # a folded BatchNormalization's per-channel scale and shift, then the clamp, in the
    # tile's store (one- and two-panel tiles, partial columns); a NaN input stays NaN
    x, w = _inputs(case, seed=7)
    x = x.at[0, 1, 1, 0].set(jnp.nan)
    rng = np.random.default_rng(8)
    o = case[1][3]
    scale, shift = (jnp.asarray(rng.standard_normal(o), jnp.float32) for _ in range(2))
    lo, hi = bounds
    out = jax.jit(_kernel(case, lo=lo, hi=hi, isa=isa))(x, w, scale, shift)
    ref = _ref(case, lo, hi)(x, w, scale, shift)
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out).any()
    finite = ~np.isnan(np.asarray(ref))
    np.testing.assert_allclose(np.asarray(out)[finite], np.asarray(ref)[finite], rtol=0,
                               atol=8 * np.prod(case[1][:3]) ** 0.5 * 1.2e-7 * 4 * 3)
    assert float(jnp.nanmin(out)) >= lo and float(jnp.nanmax(out)) <= hi


def test_epilogue_vmap_and_gradients():
    case = CASES[1]
    rng = np.random.default_rng(9)
    x, w = _inputs(case)
    scales = jnp.asarray(rng.standard_normal((3, case[1][3])), jnp.float32)
    shifts = jnp.asarray(rng.standard_normal((3, case[1][3])), jnp.float32)
    f, ref = _kernel(case, lo=0.0), _ref(case, lo=0.0)
    k = np.prod(case[1][:3])
    # the affine operands batched, x and w not
    _close(jax.vmap(f, (None, None, 0, 0))(x, w, scales, shifts),
           jax.vmap(ref, (None, None, 0, 0))(x, w, scales, shifts), k)
    _close(jax.vmap(f, (None, None, 0, None))(x, w, scales, shifts[0]),
           jax.vmap(ref, (None, None, 0, None))(x, w, scales, shifts[0]), k)
    check_grads(lambda x, w, a, b: f(x, w, a, b) ** 2, (x, w, scales[0], shifts[0]), order=2,
                modes=("fwd", "rev"), eps=1e-2, atol=5e-2, rtol=5e-2)


def _lowered(platform, x_shape, w_shape, strides, padding, dilations=(1, 1), dtype=jnp.float32,
             channels_last=True):
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    w = jax.ShapeDtypeStruct(w_shape, dtype)
    group = x_shape[1] // w_shape[1]
    f = jax.jit(lambda x, w: conv_general(x, w, strides, padding, dilations, group, dense=True,
                                          channels_last=channels_last))
    return f.trace(x, w).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("x_shape, w_shape, strides, padding, taken", [
    ((2, 3, 32, 32), (64, 3, 7, 7), (2, 2), [(3, 3)] * 2, True),     # a 7x7 stem
    ((2, 16, 8, 8), (24, 16, 3, 3), (2, 2), [(1, 1)] * 2, True),
    ((2, 16, 8, 8), (24, 16, 1, 1), (1, 1), [(0, 0)] * 2, False),    # 1x1: a matmul
    ((2, 3, 32, 32), (16, 3, 3, 3), (2, 2), [(1, 1)] * 2, True),     # a 3-channel 3x3 stem
    ((2, 1, 28, 28), (16, 1, 3, 3), (1, 1), [(1, 1)] * 2, False),    # 9 taps: a gather
    ((2, 16, 16, 16), (16, 8, 3, 3), (2, 2), [(1, 1)] * 2, True),    # groups of 8
    ((2, 16, 16, 16), (32, 1, 3, 3), (1, 1), [(1, 1)] * 2, False),   # depthwise (x2)
    ((2, 3, 32, 32), (16, 3, 4, 4), (4, 4), [(0, 0)] * 2, False),    # patchify: a reorder
    ((2, 3, 128, 128), (64, 3, 7, 7), (2, 2), [(3, 3)] * 2, True),   # 154 MFLOP
])
def test_conv_general_takes_it_where_chosen(monkeypatch, x_shape, w_shape, strides, padding,
                                            taken):
    # whatever XLA:CPU's thread count (large ones too: they take as many helpers)
    for xla in (1, 2, 16):
        monkeypatch.setattr(conv_cpu, "xla_threads", lambda xla=xla: xla)
        assert ("jaxops_conv_nhwc" in _lowered("cpu", x_shape, w_shape, strides, padding)) \
            == taken, xla
    # not without channels_last (a training graph's), in f64, nor on a GPU
    assert "jaxops_conv_nhwc" not in _lowered("cpu", x_shape, w_shape, strides, padding,
                                              channels_last=False)
    assert "jaxops_conv_nhwc" not in _lowered("cpu", x_shape, w_shape, strides, padding,
                                              dtype=jnp.float64)
    assert "jaxops_conv_nhwc" not in _lowered("cuda", x_shape, w_shape, strides, padding)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_conv_general_values_in_every_float(dtype):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), dtype)
    w = jnp.asarray(rng.standard_normal((24, 16, 3, 3)), dtype)
    f = jax.jit(lambda x, w: conv_general(x, w, (2, 2), [(1, 1)] * 2, (1, 1), 1, dense=True,
                                          channels_last=True))
    ref = lax.conv_general_dilated(x.astype(jnp.float32), w.astype(jnp.float32), (2, 2),
                                   [(1, 1)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                   precision=lax.Precision.HIGHEST).astype(dtype)
    out = f(x, w)
    assert out.dtype == dtype
    tol = 2 * float(jnp.finfo(dtype).eps) * float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=0, atol=max(tol, 1e-4))


def _packed(case, **epilogue):
    """f(x, panels[, scale, shift]): the kernel at case's geometry on pack_weights' panels."""
    groups, o = _params(case)["groups"], case[1][3]
    return lambda x, p, *affine: conv_cpu.conv_nhwc(x, p, *case[2:5], groups, *affine,
                                                    out_channels=o, **epilogue)


@pytest.mark.parametrize("isa", ["best", "avx2"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_weights_give_the_same_bits(case, isa):
    # the panels the kernel would pack, given packed (a constant's, folded by XLA): the same
    # tiles over the same values, so the same bits; pack and unpack are inverses
    x, w = _inputs(case, seed=hash(case) % 997)
    groups = _params(case)["groups"]
    p = conv_cpu.pack_weights(w, groups)
    o = case[1][3]
    assert p.shape == (groups, -(-(o // groups) // 16), case[1][0], case[1][1] * case[1][2], 16)
    assert np.array_equal(conv_cpu.unpack_weights(p, case[1][2], o), w)
    rng = np.random.default_rng(4)
    scale, shift = (jnp.asarray(rng.standard_normal(o), jnp.float32) for _ in range(2))
    for affine, bounds in (((), {}), ((scale, shift), {"lo": 0.0})):
        want = jax.jit(_kernel(case, isa=isa, **bounds))(x, w, *affine)
        got = jax.jit(_packed(case, isa=isa, **bounds))(x, p, *affine)
        assert np.array_equal(np.asarray(got), np.asarray(want))
    _close(got, _ref(case, lo=0.0)(x, w, scale, shift), np.prod(case[1][:3]))


def test_packed_weights_vmap_gradients_and_sharding():
    case = CASES[-3]  # grouped
    groups, o = _params(case)["groups"], case[1][3]
    xs, ws = zip(*(_inputs(case, seed=s) for s in range(3)))
    xb = jnp.stack(xs)
    pb = jnp.stack([conv_cpu.pack_weights(w, groups) for w in ws])
    f, ref, k = _packed(case), _ref(case), np.prod(case[1][:3])
    _close(jax.vmap(f)(xb, pb), jax.vmap(ref)(xb, jnp.stack(ws)), k)
    _close(jax.vmap(f, (0, None))(xb, pb[0]), jax.vmap(ref, (0, None))(xb, ws[0]), k)
    _close(jax.vmap(f, (None, 0))(xs[0], pb), jax.vmap(ref, (None, 0))(xs[0], jnp.stack(ws)), k)
    g = jax.vmap(jax.grad(lambda x, p: jnp.sum(jnp.sin(f(x, p))), (0, 1)))(xb, pb)
    gr = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(ref(x, w))), (0, 1)))(xb, jnp.stack(ws))
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(gr[0]), rtol=1e-4, atol=1e-4)
    unpacked = jax.vmap(lambda p: conv_cpu.unpack_weights(p, case[1][2], o))(g[1])
    np.testing.assert_allclose(np.asarray(unpacked), np.asarray(gr[1]), rtol=1e-4, atol=1e-4)
    check_grads(f, (xs[0], pb[0]), order=2, modes=("fwd", "rev"), eps=1e-2, atol=5e-2,
                rtol=5e-2)
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x4 = jnp.concatenate([xb[0], xb[1]])  # 4 images
    placed = jax.device_put(x4, NamedSharding(mesh, PartitionSpec("x")))
    fj = jax.jit(f)
    hlo = fj.lower(placed, pb[0]).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "jaxops_conv_nhwc" in hlo
    out = fj(placed, pb[0])
    assert out.sharding.spec[:1] == ("x",)
    _close(out, ref(x4, ws[0]), k)


@pytest.mark.parametrize("w_shape, params, match", [
    ((1, 2, 3, 48, 16), {}, "out_channels"),                              # O not given
    ((1, 2, 3, 48, 16), {"out_channels": 33}, "packed w"),                 # 3 panels wanted
    ((1, 2, 3, 47, 16), {"out_channels": 24}, "packed w"),                 # KW * C / G split
    ((1, 2, 3, 48, 8), {"out_channels": 24}, "packed w"),                  # panel width
    ((2, 1, 3, 24, 16), {"out_channels": 24}, "packed w"),                 # groups
    ((1, 2, 3, 48, 16), {"out_channels": 24, "groups": 3}, "divide"),
    ((1, 2, 3, 48, 16), {"out_channels": -1}, "out_channels"),
    ((3, 3, 16, 24), {"out_channels": 23}, "out_channels"),               # rank 4: w's O
    ((3, 3, 16, 24, 1, 1), {}, "rank 4"),
])
def test_bad_packed_weights_are_a_clear_error(w_shape, params, match):
    p = {"strides": (2, 2), "dilations": (1, 1), "padding": ((1, 1), (1, 1)), **params}
    x, w = jnp.zeros((2, 8, 8, 16), jnp.float32), jnp.zeros(w_shape, jnp.float32)
    with pytest.raises(ValueError, match=match) as e:
        conv_cpu.conv_nhwc(x, w, **p)
    assert "conv_nhwc" in str(e.value)


def test_conv_general_packs_constant_weights_once():
    # a constant weight (program.jit()'s params): XLA folds its panels, the kernel reads them
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 16, 8, 8)), jnp.float32)
    w = np.asarray(rng.standard_normal((24, 16, 3, 3)), np.float32)

    def f(constant_w):
        return jax.jit(lambda x: conv_general(x, jnp.asarray(w), (2, 2), [(1, 1)] * 2, (1, 1),
                                              1, dense=True, channels_last=True,
                                              constant_w=constant_w))
    hlo = f(True).lower(x).compile().as_text()
    call = next(line for line in hlo.splitlines() if "custom_call_target=\"jaxops_conv_nhwc\"" in line)
    assert "f32[1,2,3,48,16]" in call and "transpose(" not in hlo.split("ENTRY")[1].split(call)[0]
    assert "f32[1,2,3,48,16]" not in f(False).lower(x).compile().as_text()
    assert np.array_equal(np.asarray(f(True)(x)), np.asarray(f(False)(x)))


@pytest.mark.parametrize("isa", ["best", "generic", "avx2", "avx512"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[-2]], ids=[IDS[0], IDS[3], IDS[-2]])
def test_shift_alone_matches_the_reference(case, isa):
    # a bias (a BatchNormalization folded into constant weights): sum + shift, then the clamp
    x, w = _inputs(case, seed=11)
    shift = jnp.asarray(np.random.default_rng(12).standard_normal(case[1][3]), jnp.float32)
    out = jax.jit(lambda x, w, s: conv_cpu.conv_nhwc(x, w, *case[2:5], _params(case)["groups"],
                                                     None, s, lo=0.0, isa=isa))(x, w, shift)
    ref = conv_cpu._reference(x, w, shift, shift, **_params(case), affine=2, lo=0.0)
    _close(out, ref, np.prod(case[1][:3]))
    want = jnp.maximum(conv_cpu._reference(x, w, shift, shift, **_params(case)) + shift, 0)
    _close(out, want, np.prod(case[1][:3]))
