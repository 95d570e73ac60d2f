"""Pure-JAX GistPackMsfp15Encoder / GistPackMsfp15Decoder: the test oracle and the
`JAXOPS_DISABLE` fallback of their kernels (the format: jaxops/ops/gist.py's docstring).
X's last dim is a multiple of 8 (the ops check it)."""
import jax
import jax.numpy as jnp

TILE = 8
_U32 = jnp.uint32


def _tiles(X):
    return X.reshape(*X.shape[:-1], X.shape[-1] // TILE, TILE)


def _lane(shape):
    return jax.lax.broadcasted_iota(_U32, shape, len(shape) - 1)


def msfp15_encoder(X):
    """float32 X -> one uint8 per element."""
    i = jax.lax.bitcast_convert_type(_tiles(X), _U32)
    exp = (i >> 23) & 0xFF
    shared = jnp.max(exp, axis=-1, keepdims=True)
    diff = shared - exp
    mant = ((i & 0x007FFFFF) | 0x00800000) >> jnp.minimum(diff, 31)
    mant = jnp.where(diff > 31, 0, mant) >> 17  # 7 bits: 6 kept, 1 to round on
    mant = jnp.where(mant == 127, mant, mant + 1) >> 1
    sign = (i >> 25) & 0x40
    value = jnp.where(exp == 0, 0, sign | mant)  # denormals flush to +0
    byte = (((shared >> _lane(i.shape)) & 1) << 7) | value
    byte = jnp.where(shared == 0xFF, 0, byte)  # inf or NaN in the tile: all zeros
    return byte.astype(jnp.uint8).reshape(X.shape)


def msfp15_decoder(X):
    """uint8 X -> float32: +-m * 2^(Es - 132), m the 6-bit magnitude, Es the tile's exponent."""
    b = _tiles(X).astype(_U32)
    shared = jnp.sum((b >> 7) << _lane(b.shape), axis=-1, keepdims=True, dtype=_U32)
    m = b & 0x3F
    lead = 31 - jax.lax.clz(jnp.maximum(m, 1))  # position of the leading 1 of m
    diff = 5 - lead
    exp = shared - diff  # wraps for tiny tiles, as ORT's uint32 does
    mant = (m << (18 + diff)) & 0x007FFFFF
    bits = ((b & 0x40) << 25) | (exp << 23) | mant
    y = jnp.where(m == 0, 0.0, jax.lax.bitcast_convert_type(bits, jnp.float32))
    return y.reshape(X.shape)
