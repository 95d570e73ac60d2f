"""GIST activation compression (com.microsoft): GistBinarize, GistPack1, GistPack8, GistPack16
and GistPackMsfp15, each an Encoder/Decoder pair, bit for bit as ORT's CUDA kernels
(orttraining/training_ops/cuda/gist/gist_impl.cu) compute them, except where this docstring
says otherwise.

Binarize, pack1, pack8 and pack16 are plain XLA code: elementwise bit arithmetic that XLA
fuses with its producer or consumer, where a kernel would be a fusion barrier that must
round-trip through memory. They support jit, vmap, sharding and (where it means anything)
autodiff with no extra rules; `JAXOPS_DISABLE` does not apply to them. Msfp15's encoder and
decoder need a whole 8-element tile per element, which XLA splits into a reduction and a
second pass over X: they are FFI ops with CUDA kernels and C++ CPU handlers (ffi/*/gist.*),
their pure-JAX definitions in jaxops/reference/gist.py (bench/gist.py measures all ten against
copy bandwidth). tests/gist_layout.py is an independent per-element model of the bit layouts
that the tests compare with.

Decoders take ORT's required `to` attribute (an ONNX TensorProto element type: 1 float,
9 bool, 10 float16, 11 double) and accept only the types ORT registers for them.

Formats (N = X.size):
- Binarize: Y = X > 0 (bool, X's shape); decoder: 1 where X else 0. NaN and -0 give False.
- Pack1: 1 bit per element, 8 per byte, most significant bit first: byte j holds X.flat[8j+k] > 0
  in bit 0x80 >> k. Encoder output is 1-D [ceil(N/8)]; the decoder returns 1-D [8 * X.size]
  (ORT's shapes: the caller reshapes). A trailing partial byte is padded with 0 bits (ORT's
  kernel reads past the end of X there).
- Pack8: ORT's 8-bit layout, sign | 5 "exponent" bits | 2 mantissa bits, computed as ORT does:
  with the input's float32 bits, e = biased exponent - bias (unsigned, so |X| < 1 wraps),
  pack_e = e >> (e_size - 5), pack_m = the top 2 mantissa bits, plus 1 (carrying into pack_e
  at 3) where ORT's rounding mask hits the mantissa (f32: bit 19 alone, not the bit below the
  kept two), pack_e >= 31 -> 0, the sign on top; X == 0 -> 0. The decoder
  builds sign | pack_e << (e_size - 5 + m_size) + bias | pack_m << (m_size - 2); byte 0 -> 0.
  ORT's kernel leaves the output byte unwritten for X == 0 (it assigns the pointer); jaxops
  writes 0. NOTE: ORT's pack8 is NOT a working codec and jaxops keeps its bits: the decoder does
  not invert the encoder (f32: 1.0 encodes to 0 and decodes to 0.0; 3.0 decodes to 5.9e-39),
  and for float16 (fields read from the float32 bits of the value with f16 masks) the encoder
  yields 0x80 or 0 and the decoder yields +0.0 for every byte. Use pack16 or msfp15 to compress.
- Pack16: Y = float16(X) rounded to nearest even (overflow to inf, NaN kept); decoder exact.
- PackMsfp15: tiles of 8 consecutive elements along the last axis share the largest biased
  exponent Es of the tile; each byte = bit i of Es (element i of the tile, bit 7) | sign (bit 6)
  | 6-bit magnitude round-half-up(|X| / 2^(Es - 132)) (saturating at 63). Denormals encode as 0;
  a tile holding inf or NaN encodes as all zeros. Decoding gives +-m * 2^(Es - 132) (m = 0 ->
  +0.0), so a tile's error is at most 2^(Es - 132) <= max|X| / 32, for tiles with Es >= 6
  (smaller ones decode to ORT's wrapped-exponent bits). The last dim must be a multiple of 8:
  a partial tile cannot hold the 8 exponent bits (ORT's kernel then computes a wrong tile
  stride and reads outside X), so jaxops raises ValueError.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.op import Factors, Op, batch_at_front
from jaxops._src.spec import REQUIRED, Matrix, define
from jaxops.reference import gist as ref

# ONNX TensorProto element types the decoders' `to` may name
_TO = {1: jnp.float32, 9: jnp.bool_, 10: jnp.float16, 11: jnp.float64}
_NAMES = {jnp.float16: "float16", jnp.float32: "float32", jnp.float64: "float64",
          jnp.bool_: "bool", jnp.uint8: "uint8"}
_U32 = jnp.uint32


def _dtype_of(X, dtypes):
    if X.dtype not in dtypes:
        raise TypeError(f"X must be {' or '.join(_NAMES[d] for d in dtypes)}, got {X.dtype}")


def _to(to, dtypes):
    """The decoder's output dtype from ORT's `to` (an ONNX element type)."""
    to = rules.integer("to", to)
    if _TO.get(to) not in dtypes:
        codes = ", ".join(f"{c} ({_NAMES[d]})" for c, d in _TO.items() if d in dtypes)
        raise ValueError(f"to must be one of {codes}, got {to}")
    return _TO[to]


_MS = "com.microsoft"


def _f32_maker(last=None):
    """Matrix inputs: float32 X at the leading shape (a last dim of `last` when given), the
    dtype asked for ignored (the encoders take float32)."""
    def make(rng, shape, dtype):
        full = (*shape, last) if last else shape
        return (jnp.asarray(rng.standard_normal(full), jnp.float32),)
    return make


def _bytes_maker(last=None):
    def make(rng, shape, dtype):
        full = (*shape, last) if last else shape
        return (jnp.asarray(rng.integers(0, 256, full, dtype=np.uint8)),)
    return make


def _encoder(name, op_type, dtypes, reference, doc, make=None):
    """An XLA-coded encoder: X of `dtypes` -> reference(X)."""
    return define(name, ort=(_MS, op_type), inputs=("X",), outputs=("Y",),
                  check=lambda X: _dtype_of(X, dtypes), reference=reference, doc=doc,
                  matrix=Matrix(make or _f32_maker()))


def _decoder(name, op_type, dtypes, to_dtypes, reference, doc, make):
    """An XLA-coded decoder: X of `dtypes` -> reference(X, dtype of `to`)."""
    def check(X, *, to):
        _dtype_of(X, dtypes)
        _to(to, to_dtypes)
    return define(name, ort=(_MS, op_type), inputs=("X",), outputs=("Y",),
                  attrs={"to": REQUIRED}, check=check,
                  reference=lambda X, *, to: reference(X, _TO[int(to)]), doc=doc,
                  matrix=Matrix(make, attrs={"to": next(c for c, d in _TO.items()
                                                        if d in to_dtypes)}))


def _u32(x):
    return jnp.asarray(x, _U32)


_SIGNED = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
_INF_BITS = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}


def _positive(X):
    """X > 0 from X's bits: exact for denormals, which XLA's CPU (and a GPU with FTZ) treats as
    zero in float comparisons; ORT's kernels compare without flushing. Bools pass through."""
    if X.dtype == jnp.bool_:
        return X
    size = X.dtype.itemsize
    bits = jax.lax.bitcast_convert_type(X, _SIGNED[size])
    return (bits > 0) & (bits <= _INF_BITS[size])  # sign clear, not zero, not NaN


def _lane(shape, dtype):
    """The index along the last axis (an iota, which XLA folds into the fused loop; a constant
    array operand would be read per element and blocks vectorisation on CPU)."""
    return jax.lax.broadcasted_iota(dtype, shape, len(shape) - 1)


# ---------------------------------------------------------------------------- binarize


gist_binarize_encoder = _encoder(
    "gist_binarize_encoder", "GistBinarizeEncoder", (jnp.float16, jnp.float32, jnp.float64),
    _positive,
    """ORT GistBinarizeEncoder: Y = X > 0 (bool, X's shape). X float16, float32 or float64.""")

gist_binarize_decoder = _decoder(
    "gist_binarize_decoder", "GistBinarizeDecoder", (jnp.bool_,),
    (jnp.float16, jnp.float32, jnp.float64), lambda X, dtype: X.astype(dtype),
    """ORT GistBinarizeDecoder: Y = 1 where X else 0, in `to` (10 float16, 1 float, 11 double).""",
    lambda rng, shape, dtype: (jnp.asarray(rng.random(shape) > 0.5),))


# ---------------------------------------------------------------------------- pack1

def _bit_shifts(shape):  # element k of a byte -> bit 0x80 >> k
    return jnp.asarray(7, jnp.uint8) - _lane(shape, jnp.uint8)


def _pack1_encode(X):
    bits = _positive(X).reshape(-1)
    pad = -bits.size % 8
    if pad:
        bits = jnp.pad(bits, (0, pad))
    bits = bits.reshape(-1, 8).astype(jnp.uint8)
    bytes_ = bits << _bit_shifts(bits.shape)
    return jnp.bitwise_or.reduce(bytes_, axis=1)


def _pack1_decode(X, dtype):
    wide = jnp.broadcast_to(X.reshape(-1, 1), (X.size, 8))
    bits = (wide & (jnp.uint8(0x80) >> _lane(wide.shape, jnp.uint8))) != 0
    return bits.reshape(-1).astype(dtype)


gist_pack1_encoder = _encoder(
    "gist_pack1_encoder", "GistPack1Encoder", (jnp.bool_, jnp.float32), _pack1_encode,
    """ORT GistPack1Encoder: X > 0 packed 8 per byte, most significant bit first, into a 1-D
    uint8 array of ceil(X.size / 8) bytes; a trailing partial byte is padded with 0 bits.
    X bool or float32.""", make=_f32_maker(8))  # 8 elements a row: a byte never spans shards

gist_pack1_decoder = _decoder(
    "gist_pack1_decoder", "GistPack1Decoder", (jnp.uint8,), (jnp.bool_, jnp.float32),
    _pack1_decode,
    """ORT GistPack1Decoder: Y[i] = bit (0x80 >> i % 8) of X.flat[i // 8], as `to` (9 bool or
    1 float); 1-D with 8 * X.size elements. X uint8.""", _bytes_maker())


# ---------------------------------------------------------------------------- pack8

# ORT's field sizes per input width: (mantissa bits, exponent bits, exponent mask, mantissa
# mask, rounding-bit mask, bias). For float16 ORT applies these to the value's FLOAT32 bits.
_PACK8 = {
    np.dtype(np.float32): (23, 8, 0x7F800000, 0x007FFFFF, 0x00080000, 127),
    np.dtype(np.float16): (10, 5, 0x0F800000, 0x000003FF, 0x00000007, 15),
}


def _f32_bits(X):
    """The bits of float32(X). A float16 NaN widens as IEEE says (sign and payload kept, as
    numpy and ORT's CPU kernel do) on every platform: a GPU's conversion gives one canonical
    NaN (0x7FFFFFFF), whose bit 15 would set the sign of ORT's float16 pack8 byte."""
    i = jax.lax.bitcast_convert_type(X.astype(jnp.float32), _U32)
    if X.dtype != jnp.float16:
        return i
    h = jax.lax.bitcast_convert_type(X, jnp.uint16).astype(_U32)
    return jnp.where(jnp.isnan(X), ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13), i)


def _pack8_encode(X):
    m_size, e_size, e_mask, m_mask, round_mask, bias = _PACK8[np.dtype(X.dtype)]
    i = _f32_bits(X)
    s = i >> (m_size + e_size)
    e = ((i & e_mask) >> m_size) - _u32(bias)  # wraps below the bias, as ORT's uint32 does
    m = i & m_mask
    pack_e = e >> (e_size - 5)
    pack_m = m >> (m_size - 2)
    up = (m & round_mask) > 0
    carry = up & (pack_m == 3)
    pack_e = jnp.where(carry, pack_e + 1, pack_e)
    pack_m = jnp.where(carry, 0, jnp.where(up, pack_m + 1, pack_m))
    pack_e = jnp.where(pack_e >= 31, 0, pack_e)
    byte = ((s << 7) | (pack_e << 2) | pack_m).astype(jnp.uint8)  # keeps the low 8 bits, as ORT
    return jnp.where((i & 0x7FFFFFFF) == 0, jnp.uint8(0), byte)  # +-0 by its bits: see _positive


def _pack8_decode(X, dtype):
    m_size, e_size, _, _, _, bias = _PACK8[np.dtype(dtype)]
    b = X.astype(_U32)
    s = b >> 7
    pack_e = (b & 0x7C) >> 2
    pack_m = b & 0x3
    bits = (s << (m_size + e_size)) | ((pack_e << (e_size - 5 + m_size)) + _u32(bias)) \
        | (pack_m << (m_size - 2))
    # ORT reinterprets these bits as a float32 (also for float16, whose bits are < 2^16: a
    # float32 denormal that rounds to +0.0 in float16)
    y = jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
    return jnp.where(X == 0, jnp.zeros((), dtype), y)


gist_pack8_encoder = _encoder(
    "gist_pack8_encoder", "GistPack8Encoder", (jnp.float32, jnp.float16), _pack8_encode,
    """ORT GistPack8Encoder: ORT's sign | 5 | 2 bit byte of each element of X (float32 or
    float16), X's shape; 0 for X == 0 (where ORT leaves the byte unwritten). Not invertible:
    see the module docstring.""")

gist_pack8_decoder = _decoder(
    "gist_pack8_decoder", "GistPack8Decoder", (jnp.uint8,), (jnp.float32, jnp.float16),
    _pack8_decode,
    """ORT GistPack8Decoder: ORT's decoding of GistPack8Encoder bytes into `to` (1 float or
    10 float16); byte 0 -> 0. Not the encoder's inverse: see the module docstring.""",
    _bytes_maker())


# ---------------------------------------------------------------------------- pack16


def _pack16_encode(X):
    # The barrier keeps the rounding: XLA (xla_allow_excess_precision, on by default) drops
    # an f32 -> f16 -> f32 pair of converts, so a jitted encode + decode on a GPU returned X
    # itself (65520 stayed 65520 instead of inf) and the f16 tensor was never stored.
    return jax.lax.optimization_barrier(X.astype(jnp.float16))


gist_pack16_encoder = _encoder(
    "gist_pack16_encoder", "GistPack16Encoder", (jnp.float32,), _pack16_encode,
    """ORT GistPack16Encoder: float32 X to float16, round to nearest even.""")

gist_pack16_decoder = _decoder(
    "gist_pack16_decoder", "GistPack16Decoder", (jnp.float16,), (jnp.float32,),
    lambda X, dtype: X.astype(dtype),
    """ORT GistPack16Decoder: float16 X to `to` (1 float), exactly.""",
    lambda rng, shape, dtype: (jnp.asarray(rng.standard_normal(shape), jnp.float16),))


# ---------------------------------------------------------------------------- msfp15

def _msfp15_shape(in_dtype, out_dtype):
    def shape(X):
        if X.dtype != in_dtype:
            raise TypeError(f"X must be {_NAMES[in_dtype]}, got {X.dtype}")
        if X.ndim == 0 or X.shape[-1] % ref.TILE:
            raise ValueError(f"X's last dim must be a multiple of {ref.TILE} (one MSFP tile), "
                             f"got shape {X.shape}")
        return jax.ShapeDtypeStruct(X.shape, out_dtype)
    return shape


def _tile_factors(X):
    """Elementwise over tiles: any dim may be sharded but the last, which holds the tiles."""
    dims = tuple(f"d{i}" for i in range(X.ndim))
    return Factors((dims,), (dims,), replicated=dims[-1:])


def _msfp15_op(name, reference, in_dtype, out_dtype):
    return Op(name, shape=_msfp15_shape(in_dtype, out_dtype), reference=reference,
              batch=lambda op, args, dims: (op.bind(*batch_at_front(args, dims)), 0),
              target=f"jaxops_{name}", ffi_attrs=lambda X: {}, factors=_tile_factors)


# CUDA kernels (16-byte float accesses, 8-byte tile accesses): as XLA code the tile's shared exponent is a reduction of
# its own and X is read twice (44% and 67% of copy bandwidth on an H100, 2026-11-22).
_MSFP15_ENCODER = _msfp15_op("gist_pack_msfp15_encoder", ref.msfp15_encoder, jnp.float32,
                             jnp.uint8)
_MSFP15_DECODER = _msfp15_op("gist_pack_msfp15_decoder", ref.msfp15_decoder, jnp.uint8,
                             jnp.float32)


gist_pack_msfp15_encoder = define(
    "gist_pack_msfp15_encoder", ort=(_MS, "GistPackMsfp15Encoder"), inputs=("X",),
    outputs=("Y",), op=_MSFP15_ENCODER, reference=ref.msfp15_encoder,
    matrix=Matrix(_f32_maker(ref.TILE)),
    doc="""ORT GistPackMsfp15Encoder: float32 X (last dim a multiple of 8) to one uint8 per element
    in 8-element tiles along the last axis with a shared exponent; see the module docstring.""")

gist_pack_msfp15_decoder = define(
    "gist_pack_msfp15_decoder", ort=(_MS, "GistPackMsfp15Decoder"), inputs=("X",),
    outputs=("Y",), attrs={"to": REQUIRED},
    check=lambda X, *, to: (_to(to, (jnp.float32,)), _MSFP15_DECODER.check(X)),
    kernel=lambda X, *, to: _MSFP15_DECODER.bind(X),
    reference=lambda X, *, to: ref.msfp15_decoder(X),
    matrix=Matrix(_bytes_maker(ref.TILE), attrs={"to": 1}),
    doc="""ORT GistPackMsfp15Decoder: GistPackMsfp15Encoder's bytes (last dim a multiple of 8) back
    to `to` (1 float): +-m * 2^(Es - 132), m the 6-bit magnitude, Es the tile's exponent.""")


__all__ = ["gist_binarize_decoder", "gist_binarize_encoder", "gist_pack16_decoder",
           "gist_pack16_encoder", "gist_pack1_decoder", "gist_pack1_encoder",
           "gist_pack8_decoder", "gist_pack8_encoder", "gist_pack_msfp15_decoder",
           "gist_pack_msfp15_encoder"]
