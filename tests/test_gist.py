"""GIST encoders/decoders (XLA code) against an independent per-element model of ORT's bit
layouts (gist_layout.py); round trips (hypothesis) with NaN, inf, denormals and zeros; jit,
vmap, sharding, bad input. ORT 1.19.2 has no usable CPU kernel for these ops (Binarize's crash,
the others are CUDA-only), so there is no ORT comparison."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import gist_layout as model
from jaxops import ops
from jaxops.ops import gist as gist_module
from jaxops.reference import gist as gist_reference
from helpers import on_cpu_devices

F16, F32, F64 = np.float16, np.float32, np.float64
FLOAT, BOOL, HALF, DOUBLE = 1, 9, 10, 11  # ONNX element types for `to`

# the ops jitted: one compilation per shape (eager dispatch compiles every primitive); the
# eager path is checked against these in test_jit_matches_eager
jops = SimpleNamespace(**{name: jax.jit(getattr(ops, name), static_argnames=(
    ("to",) if name.endswith("decoder") else ())) for name in gist_module.__all__})

SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-42, 1.0, -1.0, 3.0, 0.75, 65504.0,
           65520.0, 7e4, 6e-8, 2.0**-24, 1.5, 1.75, 1.875, 1 - 2.0**-24, 2.0**-126, 3e38]


def _floats(rng, shape, dtype, specials=True):
    """Random values over many binades, with the special values mixed in."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    if specials:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, min(flat.size, len(SPECIAL)), replace=False)
        flat[idx] = np.array(SPECIAL)[:len(idx)]
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _same_floats(got, want):
    """Equal values (NaN where NaN; +0 and -0 told apart)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


# ------------------------------------------------------------------ against the layout model

@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=["f16", "f32", "f64"])
@pytest.mark.parametrize("to,out", [(HALF, F16), (FLOAT, F32), (DOUBLE, F64)], ids=str)
def test_binarize(rng, dtype, to, out):
    x = _floats(rng, (3, 5, 7), dtype)
    bits = jops.gist_binarize_encoder(x)
    assert bits.dtype == jnp.bool_ and bits.shape == x.shape
    np.testing.assert_array_equal(bits, model.binarize_encode(x))
    y = jops.gist_binarize_decoder(bits, to=to)
    assert y.dtype == out and y.shape == x.shape
    np.testing.assert_array_equal(y, np.where(x > 0, 1, 0).astype(out))


@pytest.mark.parametrize("dtype", [np.bool_, F32], ids=["bool", "f32"])
@pytest.mark.parametrize("shape", [(16,), (3, 8), (2, 3, 5), (1,), (0,), (9,)], ids=str)
def test_pack1_encoder(rng, dtype, shape):
    x = _floats(rng, shape, F32) if dtype == F32 else rng.random(shape) > 0.5
    packed = jops.gist_pack1_encoder(x)
    n = (int(np.prod(shape)) + 7) // 8
    assert packed.dtype == jnp.uint8 and packed.shape == (n,)
    np.testing.assert_array_equal(packed, model.pack1_encode(x))


def test_pack1_bit_order():
    x = np.array([1, 0, 0, 0, 0, 0, 0, 1, 0, 1], np.float32)  # a partial second byte
    np.testing.assert_array_equal(jops.gist_pack1_encoder(x), [0x81, 0x40])


@pytest.mark.parametrize("to,out", [(BOOL, np.bool_), (FLOAT, F32)], ids=["bool", "f32"])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (0,)], ids=str)
def test_pack1_decoder(rng, to, out, shape):
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    y = jops.gist_pack1_decoder(b, to=to)
    assert y.dtype == out and y.shape == (8 * b.size,)
    np.testing.assert_array_equal(y, model.pack1_decode(b).astype(out))


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_pack8_encoder(rng, dtype):
    x = _floats(rng, (6, 40), dtype)
    x.flat[:4] = [0.0, -0.0, 1.0, 3.0]
    packed = jops.gist_pack8_encoder(x)
    assert packed.dtype == jnp.uint8 and packed.shape == x.shape
    np.testing.assert_array_equal(packed, model.pack8_encode(x))
    assert not packed.reshape(-1)[:2].any()  # zeros written (ORT leaves them unwritten)


@pytest.mark.parametrize("to,out", [(FLOAT, F32), (HALF, F16)], ids=["f32", "f16"])
def test_pack8_decoder_every_byte(to, out):
    b = np.arange(256, dtype=np.uint8).reshape(16, 16)
    y = jops.gist_pack8_decoder(b, to=to)
    assert y.dtype == out and y.shape == b.shape
    _same_floats(y, model.pack8_decode(b, out))


def test_pack8_is_orts_non_invertible_layout():
    """The documented facts of ORT's layout, kept as ORT computes them."""
    x = np.array([1.0, 3.0, -2.5], np.float32)
    np.testing.assert_array_equal(jops.gist_pack8_encoder(x), [0, 2, 129])
    y = np.asarray(jops.gist_pack8_decoder(jops.gist_pack8_encoder(x), to=FLOAT))
    assert y[0] == 0 and 0 < y[1] < 1e-38  # 3.0 comes back as a float32 denormal
    h = jops.gist_pack8_encoder(_floats(np.random.default_rng(0), (64,), F16))
    assert set(np.unique(h)) <= {0, 0x80}
    assert not np.asarray(jops.gist_pack8_decoder(np.arange(256, dtype=np.uint8), to=HALF)).any()


def test_pack16(rng):
    x = _floats(rng, (4, 33), F32)
    h = jops.gist_pack16_encoder(x)
    assert h.dtype == jnp.float16 and h.shape == x.shape
    with np.errstate(over="ignore"):
        _same_floats(h, model.pack16_encode(x))
    y = jops.gist_pack16_decoder(h, to=FLOAT)
    assert y.dtype == jnp.float32
    _same_floats(y, np.asarray(h).astype(F32))


@pytest.mark.parametrize("shape", [(8,), (3, 16), (2, 2, 24)], ids=str)
def test_msfp15_encoder(rng, shape):
    x = _floats(rng, shape, F32, specials=False)
    x.reshape(-1, 8)[0, :3] = [0.0, -0.0, 1e-40]  # zeros and a denormal in a normal tile
    if x.size >= 16:
        x.reshape(-1, 8)[1, 5] = np.nan  # a whole tile of zeros
    packed = jops.gist_pack_msfp15_encoder(x)
    assert packed.dtype == jnp.uint8 and packed.shape == shape
    np.testing.assert_array_equal(packed, model.msfp15_encode(x))


@pytest.mark.parametrize("shape", [(8,), (4, 16)], ids=str)
def test_msfp15_decoder(rng, shape):
    b = rng.integers(0, 256, shape, dtype=np.uint8)  # any bytes, tiny shared exponents included
    y = jops.gist_pack_msfp15_decoder(b, to=FLOAT)
    assert y.dtype == jnp.float32 and y.shape == shape
    _same_floats(y, model.msfp15_decode(b))


def test_msfp15_known_tile():
    x = np.array([1.0, -0.5, 0.25, 3.0, 0.0, 1e-40, 2.0**-7, 1.96875 * 2], np.float32)
    y = np.asarray(jops.gist_pack_msfp15_decoder(jops.gist_pack_msfp15_encoder(x), to=FLOAT))
    # Es = exponent of 3.9375 (2^1): the grid is 2^(1-5) = 1/16; 3.9375 = 63/16 exactly
    np.testing.assert_array_equal(y, [1.0, -0.5, 0.25, 3.0, 0.0, 0.0, 0.0, 3.9375])


@pytest.mark.parametrize("shape", [(8,), (5, 24), (3, 4, 16), (4099, 8)], ids=str)
def test_msfp15_kernels_match_the_reference(rng, shape, monkeypatch):
    """The FFI kernels (CPU here, CUDA on a GPU) against jaxops.reference.gist on random bit
    patterns: every exponent, NaN, inf and denormal turns up; 4099 tiles leave partial blocks."""
    x = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        x.reshape(-1, 8)[::3] *= 2.0**-100  # tiles of small numbers as well
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    hlo = jax.jit(ops.gist_pack_msfp15_encoder).lower(x).as_text()
    assert "jaxops_gist_pack_msfp15_encoder" in hlo  # the kernel, not XLA code
    packed, y = _msfp15_enc(x), _msfp15_dec(b)
    np.testing.assert_array_equal(packed, gist_reference.msfp15_encoder(x))
    _same_floats(y, gist_reference.msfp15_decoder(b))
    monkeypatch.setenv("JAXOPS_DISABLE", "gist_pack_msfp15_encoder,gist_pack_msfp15_decoder")
    np.testing.assert_array_equal(ops.gist_pack_msfp15_encoder(x), packed)
    _same_floats(ops.gist_pack_msfp15_decoder(b, to=FLOAT), y)


# ------------------------------------------------------------------ round trips (hypothesis)

def _f32_arrays(shape):
    return hnp.arrays(np.float32, shape, elements=st.floats(
        width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))


PROPERTY = settings(max_examples=50, deadline=None)
# jitted round trips: one compilation per shape (eager dispatch compiles every primitive)
_binarize = jax.jit(lambda x: ops.gist_binarize_decoder(ops.gist_binarize_encoder(x), to=FLOAT))
_pack1 = jax.jit(lambda x, to: ops.gist_pack1_decoder(ops.gist_pack1_encoder(x), to=to),
                 static_argnums=1)
_pack16 = jax.jit(lambda x: ops.gist_pack16_decoder(ops.gist_pack16_encoder(x), to=FLOAT))
_msfp15_enc = jax.jit(ops.gist_pack_msfp15_encoder)
_msfp15_dec = jax.jit(lambda b: ops.gist_pack_msfp15_decoder(b, to=FLOAT))
_pack8_enc = jax.jit(ops.gist_pack8_encoder)
_pack8_dec = jax.jit(ops.gist_pack8_decoder, static_argnames="to")


@PROPERTY
@given(_f32_arrays((4, 16)))
def test_binarize_round_trip(x):
    y = _binarize(x)
    np.testing.assert_array_equal(y, (x > 0).astype(F32))


@PROPERTY
@given(hnp.arrays(np.bool_, st.sampled_from([(5,), (64,), (3, 7, 3)])))
def test_pack1_round_trip_is_lossless_for_bools(b):
    y = np.asarray(_pack1(b, BOOL))
    np.testing.assert_array_equal(y[:b.size], b.reshape(-1))
    assert not y[b.size:].any() and y.size == 8 * ((b.size + 7) // 8)


@PROPERTY
@given(_f32_arrays((4, 16)))
def test_pack1_round_trip_of_floats(x):
    y = _pack1(x, FLOAT)
    np.testing.assert_array_equal(y, (x > 0).astype(F32).reshape(-1))


@PROPERTY
@given(_f32_arrays((4, 16)))
def test_pack16_round_trip_within_half_an_f16_ulp(x):
    y = np.asarray(_pack16(x))
    with np.errstate(over="ignore"):
        _same_floats(y, x.astype(F16).astype(F32))  # = RNE to float16
    finite = np.isfinite(x) & (np.abs(x) <= 65504)
    # half an ulp of float16: 2^-11 relative for normals, 2^-25 absolute below 2^-14
    bound = np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(y[finite].astype(F64) - x[finite]) <= bound[finite])
    big = np.isfinite(x) & (np.abs(x) >= 65520)  # rounds to inf
    assert np.all(np.isinf(y[big]))


@PROPERTY
@given(_f32_arrays((3, 16)))
def test_msfp15_round_trip_within_the_tile_grid(x):
    packed = _msfp15_enc(x)
    np.testing.assert_array_equal(packed, model.msfp15_encode(x))
    y = np.asarray(_msfp15_dec(packed))
    _same_floats(y, model.msfp15_decode(np.asarray(packed)))
    for xt, yt in zip(x.reshape(-1, 8), y.reshape(-1, 8)):
        es = int(((xt.view(np.uint32) >> 23) & 0xFF).max())
        if es == 0xFF or es == 0:  # inf/NaN or only zeros/denormals: all +0
            assert not yt.any()
            continue
        if es < 6:  # ORT's decoder wraps the exponent there: its bits, checked above
            continue
        err = np.abs(yt.astype(F64) - np.where(np.abs(xt) < 2.0**-126, 0, xt))
        assert np.all(err <= 2.0 ** (es - 132)), (xt, yt)
        assert np.all(err <= np.abs(xt.astype(F64)).max() / 32)


@PROPERTY
@given(_f32_arrays((2, 16)), st.sampled_from([F32, F16]))
def test_pack8_matches_the_model(x, dtype):
    with np.errstate(over="ignore"):
        x = x.astype(dtype)
    packed = _pack8_enc(x)
    np.testing.assert_array_equal(packed, model.pack8_encode(x))
    _same_floats(_pack8_dec(packed, to=FLOAT if dtype == F32 else HALF),
                 model.pack8_decode(np.asarray(packed), dtype))


# ------------------------------------------------------------------ transformations

# (name, function of one array, input maker)
def _f32(rng, shape):
    return jnp.asarray(_floats(rng, shape, F32, specials=False))


def _bytes(rng, shape):
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))


ALL = [
    ("gist_binarize_encoder", ops.gist_binarize_encoder, _f32),
    ("gist_binarize_decoder", lambda b: ops.gist_binarize_decoder(b, to=FLOAT),
     lambda rng, s: jnp.asarray(rng.random(s) > 0.5)),
    ("gist_pack1_encoder", ops.gist_pack1_encoder, _f32),
    ("gist_pack1_decoder", lambda b: ops.gist_pack1_decoder(b, to=FLOAT), _bytes),
    ("gist_pack8_encoder", ops.gist_pack8_encoder, _f32),
    ("gist_pack8_decoder", lambda b: ops.gist_pack8_decoder(b, to=FLOAT), _bytes),
    ("gist_pack16_encoder", ops.gist_pack16_encoder, _f32),
    ("gist_pack16_decoder", lambda h: ops.gist_pack16_decoder(h, to=FLOAT),
     lambda rng, s: _f32(rng, s).astype(jnp.float16)),
    ("gist_pack_msfp15_encoder", ops.gist_pack_msfp15_encoder, _f32),
    ("gist_pack_msfp15_decoder", lambda b: ops.gist_pack_msfp15_decoder(b, to=FLOAT), _bytes),
]
IDS = [a[0] for a in ALL]


def _equal(got, want):
    _same_floats(got, want) if jnp.issubdtype(want.dtype, jnp.floating) else \
        np.testing.assert_array_equal(got, want)


# tests/test_op_matrix.py runs jit, vmap (axes 0, 1, -1) and a sharded input for every op,
# comparing within tolerances; bool and byte outputs (and 0/1 floats) are exact there. The ops
# with other float outputs are checked here bit for bit (NaN, signed zeros, float32 denormals).
FLOAT_OUT = [a for a in ALL if a[0] in ("gist_pack8_decoder", "gist_pack16_encoder",
                                        "gist_pack16_decoder", "gist_pack_msfp15_decoder")]


@pytest.mark.parametrize("name,fn,maker", FLOAT_OUT, ids=[a[0] for a in FLOAT_OUT])
def test_jit_matches_eager(rng, name, fn, maker):
    x = maker(rng, (4, 16))
    _equal(jax.jit(fn)(x), fn(x))


@pytest.mark.parametrize("name,fn,maker", FLOAT_OUT, ids=[a[0] for a in FLOAT_OUT])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_vmap(rng, name, fn, maker, axis):
    x = maker(rng, (3, 2, 16))  # 3 examples of [2, 16] along axis 0
    one = jax.jit(fn)
    want = jnp.stack([one(x[k]) for k in range(3)])
    got = jax.vmap(fn, in_axes=axis)(jnp.moveaxis(x, 0, axis))
    _equal(got, want)


@pytest.mark.parametrize("name,fn,maker", ALL, ids=IDS)
def test_sharded_input_is_not_gathered(rng, name, fn, maker):
    """Beyond the matrix's check: no collective-permute either (a byte or tile never spans
    shards), and the values bit for bit."""
    mesh = Mesh(np.array(on_cpu_devices(4)), ("x",))
    x = maker(rng, (8, 16))
    placed = jax.device_put(x, NamedSharding(mesh, P("x")))
    jitted = jax.jit(fn)
    hlo = jitted.lower(placed).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    out = jitted(placed)
    assert out.sharding.spec[:1] == ("x",)
    _equal(out, jitted(x))


# ------------------------------------------------------------------ bad input

BAD_DTYPE = [
    ("gist_binarize_encoder", ops.gist_binarize_encoder, jnp.ones(8, jnp.bfloat16)),
    ("gist_binarize_decoder", lambda b: ops.gist_binarize_decoder(b, to=FLOAT), jnp.ones(8)),
    ("gist_pack1_encoder", ops.gist_pack1_encoder, jnp.ones(8, jnp.float64)),
    ("gist_pack1_decoder", lambda b: ops.gist_pack1_decoder(b, to=FLOAT), jnp.ones(8, jnp.int8)),
    ("gist_pack8_encoder", ops.gist_pack8_encoder, jnp.ones(8, jnp.float64)),
    ("gist_pack8_decoder", lambda b: ops.gist_pack8_decoder(b, to=FLOAT), jnp.ones(8, jnp.int32)),
    ("gist_pack16_encoder", ops.gist_pack16_encoder, jnp.ones(8, jnp.float16)),
    ("gist_pack16_decoder", lambda b: ops.gist_pack16_decoder(b, to=FLOAT), jnp.ones(8)),
    ("gist_pack_msfp15_encoder", ops.gist_pack_msfp15_encoder, jnp.ones(8, jnp.bfloat16)),
    ("gist_pack_msfp15_decoder", lambda b: ops.gist_pack_msfp15_decoder(b, to=FLOAT),
     jnp.ones(8, jnp.float32)),
]


@pytest.mark.parametrize("name,fn,bad", BAD_DTYPE, ids=[b[0] for b in BAD_DTYPE])
def test_bad_dtype(name, fn, bad):
    for call in (fn, jax.jit(fn)):
        with pytest.raises(TypeError, match=f"jaxops.ops.{name}: X must be"):
            call(bad)


@pytest.mark.parametrize("name,to", [("gist_binarize_decoder", BOOL), ("gist_pack1_decoder", 10),
                                     ("gist_pack8_decoder", DOUBLE),
                                     ("gist_pack16_decoder", HALF),
                                     ("gist_pack_msfp15_decoder", 16)])
def test_bad_to(name, to):
    fn = getattr(ops, name)
    x = {"gist_binarize_decoder": jnp.ones(8, bool),
         "gist_pack16_decoder": jnp.ones(8, jnp.float16)}.get(name, jnp.ones(8, jnp.uint8))
    with pytest.raises(ValueError, match=f"jaxops.ops.{name}: to must be one of"):
        fn(x, to=to)
    with pytest.raises(TypeError, match=f"jaxops.ops.{name}: to must be an int"):
        fn(x, to="float")
    with pytest.raises(TypeError, match="to"):
        fn(x)  # required, as in ORT


@pytest.mark.parametrize("shape", [(), (5,), (3, 12)], ids=str)
def test_msfp15_partial_tile_is_an_error(shape):
    for name, x in [("gist_pack_msfp15_encoder", jnp.ones(shape, jnp.float32)),
                    ("gist_pack_msfp15_decoder", jnp.ones(shape, jnp.uint8))]:
        fn = getattr(ops, name)
        with pytest.raises(ValueError, match=f"jaxops.ops.{name}: X's last dim must be a "
                                             "multiple of 8"):
            fn(x) if name.endswith("encoder") else fn(x, to=FLOAT)


def test_ort_ops_table():
    for op_type in ["GistBinarizeEncoder", "GistBinarizeDecoder", "GistPack1Encoder",
                    "GistPack1Decoder", "GistPack8Encoder", "GistPack8Decoder",
                    "GistPack16Encoder", "GistPack16Decoder", "GistPackMsfp15Encoder",
                    "GistPackMsfp15Decoder"]:
        snake = "gist_" + {"PackMsfp15": "pack_msfp15"}.get(
            op_type[4:-7], op_type[4:-7].lower()) + "_" + op_type[-7:].lower()
        assert ops.ORT_OPS[("com.microsoft", op_type)] is getattr(ops, snake)


def test_onnx_graph_runs_through_ort_ops():
    """The importer maps com.microsoft GIST nodes (with ORT's `to`) through ORT_OPS."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from jaxops import onnx as jonnx
    ms = "com.microsoft"
    nodes = [helper.make_node("GistPack1Encoder", ["x"], ["p"], domain=ms),
             helper.make_node("GistPack1Decoder", ["p"], ["y"], domain=ms, to=FLOAT),
             helper.make_node("GistPackMsfp15Encoder", ["x"], ["q"], domain=ms),
             helper.make_node("GistPackMsfp15Decoder", ["q"], ["z"], domain=ms, to=FLOAT)]
    graph = helper.make_graph(
        nodes, "gist", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(ms, 1)])
    program = jonnx.load(proto)
    x = _floats(np.random.default_rng(0), (2, 8), F32, specials=False)
    y, z = program(program.params, x=x)
    np.testing.assert_array_equal(y, (x > 0).reshape(-1).astype(F32))
    _same_floats(z, model.msfp15_decode(model.msfp15_encode(x)))
