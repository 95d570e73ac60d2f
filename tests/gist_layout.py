"""An independent model of the GIST bit layouts, one element (or tile) at a time with Python
ints, written from the spec (ort-training-ops.md, GIST rows) and ORT's gist_impl.cu: the oracle
tests/test_gist.py compares jaxops.ops' vectorised code with. Slow: small inputs only."""
import math
import struct

import numpy as np


def f32_bits(x) -> int:
    return struct.unpack("<I", struct.pack("<f", float(np.float32(x))))[0]


def bits_f32(b: int) -> np.float32:
    return np.float32(struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0])


def binarize_encode(x):
    return np.array([v > 0 for v in np.ravel(x)], bool).reshape(np.shape(x))


def pack1_encode(x):
    flat = [bool(v > 0) for v in np.ravel(x)]
    out = []
    for j in range(0, len(flat), 8):
        byte = 0
        for k, bit in enumerate(flat[j:j + 8]):  # missing trailing elements: 0 bits
            if bit:
                byte |= 0x80 >> k
        out.append(byte)
    return np.array(out, np.uint8)


def pack1_decode(b):
    return np.array([bool(int(v) & (0x80 >> k)) for v in np.ravel(b) for k in range(8)], bool)


def _pack8_one(x, wide: bool) -> int:
    """One element, ORT's arithmetic: fields read from float32 bits, unsigned 32-bit wrap."""
    if x == 0:
        return 0
    i = f32_bits(x)
    if wide:  # float32 input
        m_size, e_size, e_mask, m_mask, r_mask, bias = 23, 8, 0x7F800000, 0x7FFFFF, 1 << 19, 127
    else:  # float16 input, ORT's constants applied to the float32 bits of the value
        m_size, e_size, e_mask, m_mask, r_mask, bias = 10, 5, 0x0F800000, 0x3FF, 0x7, 15
    sign = i >> (m_size + e_size)
    e = (((i & e_mask) >> m_size) - bias) % 2**32
    m = i & m_mask
    pe, pm = e >> (e_size - 5), m >> (m_size - 2)
    if m & r_mask:
        if pm == 3:
            pe, pm = pe + 1, 0
        else:
            pm += 1
    if pe >= 31:
        pe = 0
    return ((sign << 7) | (pe << 2) | pm) & 0xFF


def pack8_encode(x):
    x = np.asarray(x)
    wide = x.dtype == np.float32
    return np.array([_pack8_one(v, wide) for v in x.ravel()], np.uint8).reshape(x.shape)


def pack8_decode(b, dtype):
    wide = np.dtype(dtype) == np.float32
    m_size, e_size, bias = (23, 8, 127) if wide else (10, 5, 15)
    out = []
    for v in np.ravel(b):
        v = int(v)
        if v == 0:
            out.append(0.0)
            continue
        sign, pe, pm = v >> 7, (v >> 2) & 0x1F, v & 3
        bits = (sign << (m_size + e_size)) | ((pe << (e_size - 5 + m_size)) + bias) \
            | (pm << (m_size - 2))
        out.append(bits_f32(bits))
    return np.array(out, np.float32).astype(dtype).reshape(np.shape(b))


def pack16_encode(x):
    return np.asarray(x, np.float32).astype(np.float16)


def msfp15_encode(x):
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape, np.uint8)
    flat_in, flat_out = x.reshape(-1, 8), out.reshape(-1, 8)
    for t, tile in enumerate(flat_in):
        bits = [f32_bits(v) for v in tile]
        exps = [(b >> 23) & 0xFF for b in bits]
        shared = max(exps)
        if shared == 0xFF:  # inf/NaN somewhere: the whole tile is zeros
            continue
        for k, (b, e) in enumerate(zip(bits, exps)):
            sign, mag = 0, 0
            if e != 0:  # denormals flush to 0
                sign = b >> 31
                full = (b & 0x7FFFFF) | (1 << 23)  # 24-bit significand
                scaled = full >> (shared - e) if shared - e < 32 else 0
                seven = scaled >> 17  # 6 magnitude bits + 1 rounding bit
                mag = (seven + (seven != 127)) >> 1  # round half up, saturating at 63
            flat_out[t, k] = (((shared >> k) & 1) << 7) | (sign << 6) | mag
    return out


def msfp15_decode(b):
    b = np.asarray(b, np.uint8)
    out = np.zeros(b.shape, np.float32)
    flat_in, flat_out = b.reshape(-1, 8), out.reshape(-1, 8)
    for t, tile in enumerate(flat_in):
        shared = sum(((int(v) >> 7) & 1) << k for k, v in enumerate(tile))
        for k, v in enumerate(tile):
            mag = int(v) & 0x3F
            if mag == 0:
                continue
            lead = int(math.floor(math.log2(mag)))
            diff = 5 - lead
            exp = (shared - diff) % 2**32
            mant = (mag << (18 + diff)) & 0x7FFFFF
            flat_out[t, k] = bits_f32(((int(v) & 0x40) << 25) | ((exp << 23) % 2**32) | mant)
    return out
