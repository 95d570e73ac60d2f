"""Elementwise ONNX ops: arithmetic, math functions, comparison, logical, bitwise, Cast."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ..registry import handler
from ._util import xp, np_dtype, is_float


def _unary(name, np_name=None, since=1):
    fname = np_name or name.lower()

    @handler(name, since=since)
    def fn(ctx, x):
        m = xp(x)
        return getattr(m, fname)(x)

    fn.__name__ = fname
    return fn


for _name, _np in [("Abs", "abs"), ("Neg", "negative"), ("Exp", "exp"), ("Log", "log"),
                   ("Sqrt", "sqrt"), ("Floor", "floor"), ("Ceil", "ceil"), ("Sin", "sin"),
                   ("Cos", "cos"), ("Tan", "tan"), ("Asin", "arcsin"), ("Acos", "arccos"),
                   ("Atan", "arctan"), ("Sinh", "sinh"), ("Cosh", "cosh"), ("Asinh", "arcsinh"),
                   ("Acosh", "arccosh"), ("Atanh", "arctanh"), ("Tanh", "tanh"), ("Sign", "sign"),
                   ("Round", "round"), ("IsNaN", "isnan"), ("Not", "logical_not"),
                   ("BitwiseNot", "invert")]:
    _unary(_name, _np)


@handler("Reciprocal")
def reciprocal(ctx, x):
    return xp(x).reciprocal(x) if is_float(x.dtype) else 1 / x


@handler("Erf")
def erf(ctx, x):
    return jax.scipy.special.erf(x).astype(x.dtype)


@handler("IsInf", since=10)
def isinf(ctx, x, *, detect_negative=1, detect_positive=1):
    m = xp(x)
    pos = (x == np.inf) if detect_positive else m.zeros(x.shape, bool)
    neg = (x == -np.inf) if detect_negative else m.zeros(x.shape, bool)
    return m.logical_or(pos, neg)


@handler("Identity")
def identity(ctx, x):
    return x


def _binary(name, np_name):
    @handler(name)
    def fn(ctx, a, b, **_legacy):  # opset < 7 broadcast/axis attributes are ignored
        return getattr(xp(a, b), np_name)(a, b)

    fn.__name__ = np_name
    return fn


for _name, _np in [("Add", "add"), ("Sub", "subtract"), ("Mul", "multiply"),
                   ("Equal", "equal"), ("Less", "less"), ("Greater", "greater"),
                   ("LessOrEqual", "less_equal"), ("GreaterOrEqual", "greater_equal"),
                   ("And", "logical_and"), ("Or", "logical_or"), ("Xor", "logical_xor"),
                   ("BitwiseAnd", "bitwise_and"), ("BitwiseOr", "bitwise_or"),
                   ("BitwiseXor", "bitwise_xor")]:
    _binary(_name, _np)


@handler("Div")
def div(ctx, a, b, **_legacy):
    m = xp(a, b)
    if is_float(a.dtype):
        return m.divide(a, b)
    # integer division truncates toward zero (C semantics), unlike floor_divide
    q = m.floor_divide(a, b)
    fix = (m.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return (q + fix.astype(q.dtype)).astype(a.dtype)


@handler("Mod", since=10)
def mod(ctx, a, b, *, fmod=0):
    m = xp(a, b)
    if fmod:
        return m.fmod(a, b)
    return m.remainder(a, b)  # result takes the divisor's sign


@handler("Pow")
def pow_(ctx, x, y, **_legacy):
    m = xp(x, y)
    if is_float(x.dtype):
        return m.power(x, y.astype(x.dtype) if is_float(y.dtype) else y).astype(x.dtype)
    if is_float(y.dtype):
        return m.power(x.astype(y.dtype), y).astype(x.dtype)
    return m.power(x, y.astype(x.dtype)).astype(x.dtype)


@handler("BitShift", since=11)
def bitshift(ctx, x, y, *, direction):
    m = xp(x, y)
    return m.left_shift(x, y) if direction == "LEFT" else m.right_shift(x, y)


def _variadic(name, fold):
    @handler(name)
    def fn(ctx, *xs):
        m = xp(*xs)
        out = xs[0]
        for x in xs[1:]:
            out = fold(m, out, x)
        return out

    return fn


_variadic("Max", lambda m, a, b: m.maximum(a, b))
_variadic("Min", lambda m, a, b: m.minimum(a, b))
_variadic("Sum", lambda m, a, b: m.add(a, b))


@handler("Mean")
def mean(ctx, *xs):
    m = xp(*xs)
    out = xs[0]
    for x in xs[1:]:
        out = m.add(out, x)
    return (out / len(xs)).astype(xs[0].dtype)


@handler("Where", since=9)
def where(ctx, cond, x, y):
    return xp(cond, x, y).where(cond, x, y)


@handler("Clip")
def clip_6(ctx, x, *, min=-3.4028234663852886e38, max=3.4028234663852886e38, **_legacy):
    m = xp(x)
    return m.clip(x, np.asarray(min, x.dtype), np.asarray(max, x.dtype))


@handler("Clip", since=11)
def clip_11(ctx, x, lo=None, hi=None):
    m = xp(x, lo, hi)
    if lo is not None:
        x = m.maximum(x, lo)
    if hi is not None:
        x = m.minimum(x, hi)
    return x


def _small_float_cast(x, to, saturate, round_mode):
    """ONNX saturation for 8/4-bit floats: values beyond the range (infinities included)
    clamp to +-max. E8M0 (powers of two) rounds by `round_mode`."""
    m = xp(x)
    if to == np.dtype(jnp.float8_e8m0fnu) and is_float(x.dtype):
        lg = m.log2(m.abs(x.astype(np.float32)))
        e = {"up": m.ceil, "down": m.floor, "nearest": m.round}[round_mode](lg)
        # build the exponent byte directly: 2**-127 is a subnormal float32 that XLA flushes
        e = m.clip(e, -127, 127) if saturate else m.where(m.abs(e) > 127, np.nan, e)
        bits = m.where(m.isnan(e), 255, e + 127).astype(np.uint8)
        if m is np:
            return bits.view(to)
        return jax.lax.bitcast_convert_type(bits, to)
    if saturate and is_float(x.dtype):
        big = np.asarray(float(jnp.finfo(to).max), x.dtype)
        x = m.clip(x, -big, big)
    return x.astype(to)


_SMALL_INTS = {np.dtype(jnp.int4): (4, True), np.dtype(jnp.uint4): (4, False),
               np.dtype(jnp.int2): (2, True), np.dtype(jnp.uint2): (2, False)}


def _small_int_cast(x, to):
    """4/2-bit integers wrap around, like a C cast to a narrower integer."""
    bits, signed = _SMALL_INTS[to]
    m = xp(x)
    v = x.astype(np.int64) % (1 << bits)
    if signed:
        v = m.where(v >= (1 << (bits - 1)), v - (1 << bits), v)
    return v.astype(to)


def cast_to(x, to, saturate=1, round_mode="up"):
    to = np.dtype(to)
    if x.dtype == to:
        return x
    if to in _SMALL_INTS and x.dtype not in _SMALL_INTS:
        return _small_int_cast(x, to)
    if is_float(to) and to.itemsize == 1 or to == np.dtype(jnp.float4_e2m1fn):
        return _small_float_cast(x, to, saturate, round_mode)
    if to == np.bool_:
        return x != 0
    return x.astype(to)


@handler("Cast")
def cast(ctx, x, *, to, saturate=1, round_mode="up"):
    if isinstance(to, str):  # opset 1 names the type as a string
        to = getattr(__import__("onnx").TensorProto, to.upper())
    return cast_to(x, np_dtype(to), saturate, round_mode)


@handler("CastLike", since=15)
def cast_like(ctx, x, like, *, saturate=1, round_mode="up"):
    return cast_to(x, like.dtype, saturate, round_mode)
