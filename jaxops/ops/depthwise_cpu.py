"""The CPU kernel of depthwise convolutions in training steps (ffi/cpu/depthwise.cc): x [N, C, H, W]
by w [C * M, 1, KH, KW] (output channel j reads input channel j // M), stride 1, f32, and its
transposes in x (dx) and in w (dw), one FFI call each.

conv_general takes it for the depthwise convolutions that windowed_conv ran on the CPU with
traced weights (a training step's forward, ConvGrad's dX and dW): XLA:CPU ran those as one slice
thunk a tap (ConvNeXt's 7x7: 49) and a stack of them for dW. Not a public op: conv_general and
ConvGrad call it; its derivatives of any order are the three kernels again (each is the
others' transpose), and off the CPU it lowers as XLA's convolution.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import geometry
from jaxops._src.op import Factors, Op, batch_at_front, is_undefined, is_zero, shape_of

_DIMS = ("NCHW", "OIHW", "NCHW")
# The kernel's loop code: a name or 0 -> the attribute's value (avx512 runs the AVX2 code).
ISAS = {0: 0, "best": 0, "generic": 1, "avx2": 2, "avx512": 3}


def _out(spatial, kernel, dilations, padding):
    return tuple(geometry.conv_out_sizes(spatial, kernel, (1, 1), dilations, padding))


def _check(x, w, dilations, padding):
    """x [N, C, H, W] and w [C * M, 1, KH, KW] as the forward reads them, and its output shape."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise TypeError(f"x and w must be float32, got {x.dtype} and {w.dtype}")
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"x [N, C, H, W] and w [C * M, 1, KH, KW] must have rank 4, got "
                         f"shapes {x.shape} and {w.shape}")
    if x.shape[1] < 1 or w.shape[1] != 1 or w.shape[0] % x.shape[1]:
        raise ValueError(f"w {w.shape} must be [C * M, 1, KH, KW] for x's C = {x.shape[1]}")
    if len(dilations) != 2 or min(dilations) < 1 or len(padding) != 2 \
            or min(p for pair in padding for p in pair) < 0:
        raise ValueError(f"dilations {dilations} must be two ints >= 1 and padding {padding} "
                         f"two (lo, hi) pairs >= 0")
    out = _out(x.shape[2:], w.shape[2:], dilations, padding)
    if min(out) < 1:
        raise ValueError(f"the window ({w.shape[2:]}, dilations {dilations}) is larger than "
                         f"the padded input ({x.shape[2:]}, padding {padding})")
    # the kernel's scratch, as ffi/cpu/depthwise.cc's geometry() bounds it: N * (M + 1)
    # zero-bordered planes of rows x pitch and a block of 64
    (rh, rw) = ((k - 1) * d for k, d in zip(w.shape[2:], dilations))
    rows, pitch = max(out[0], x.shape[2]) + rh + 1, max(out[1], x.shape[3]) + rw
    if x.shape[0] * (w.shape[0] // x.shape[1] + 1) * (rows * pitch + 64) > 1 << 31:
        raise ValueError(f"the kernel's scratch ({x.shape[0]} x {w.shape[0] // x.shape[1] + 1} "
                         f"planes of {rows} x {pitch}) must fit 2**31 elements")
    return (x.shape[0], w.shape[0], *out)


def _isa(isa):
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")


def _conv(x, w, dilations, padding):
    return lax.conv_general_dilated(x, w, (1, 1), padding, rhs_dilation=dilations,
                                    dimension_numbers=_DIMS, feature_group_count=x.shape[1],
                                    precision=lax.Precision.HIGHEST)


def _struct(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _same(name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {a.shape}")


# forward: (x, w) -> y

def _forward_shape(x, w, *, dilations, padding, isa=0):
    _isa(isa)
    return _struct(_check(x, w, dilations, padding))


def _forward_reference(x, w, *, dilations, padding, isa=0):
    return _conv(x, w, dilations, padding)


# dx: (dy, w) -> dx [N, *x_shape] (x_shape: (C, H, W))

def _dx_shape(dy, w, *, x_shape, dilations, padding, isa=0):
    _isa(isa)
    if dy.dtype != jnp.float32 or dy.ndim != 4 or len(x_shape) != 3:
        raise ValueError(f"dy must be a float32 [N, C * M, OH, OW] and x_shape (C, H, W), got "
                         f"{dy.dtype} {dy.shape} and {x_shape}")
    x = _struct((dy.shape[0], *x_shape))
    _same("dy", dy, _check(x, w, dilations, padding))
    return x


def _dx_reference(dy, w, *, x_shape, dilations, padding, isa=0):
    x = _struct((dy.shape[0], *x_shape))
    return jax.linear_transpose(lambda v: _conv(v, w, dilations, padding), x)(dy)[0]


# dw: (dy, x) -> dw [C * M, 1, *kernel]

def _dw_shape(dy, x, *, kernel, dilations, padding, isa=0):
    _isa(isa)
    if dy.dtype != jnp.float32 or dy.ndim != 4 or len(kernel) != 2:
        raise ValueError(f"dy must be a float32 [N, C * M, OH, OW] and kernel (KH, KW), got "
                         f"{dy.dtype} {dy.shape} and {kernel}")
    w = _struct((dy.shape[1], 1, *kernel))
    _same("dy", dy, _check(x, w, dilations, padding))
    return w


def _dw_reference(dy, x, *, kernel, dilations, padding, isa=0):
    w = _struct((dy.shape[1], 1, *kernel))
    return jax.linear_transpose(lambda v: _conv(x, v, dilations, padding), w)(dy)[0]


def _batch(op, args, dims, **params):
    """The batch joins the images where only the first operand has it and the kernel keeps
    the images apart (forward, dx); else one call a batch element."""
    a, da = args[0], dims[0]
    if op is not dw_op and dims[1] is None:
        a = jnp.moveaxis(a, da, 0)
        y = op.bind(a.reshape(-1, *a.shape[2:]), args[1], **params)
        return y.reshape(*a.shape[:2], *y.shape[1:]), 0
    return lax.map(lambda ops: op.bind(*ops, **params), tuple(batch_at_front(args, dims))), 0


def _ffi_attrs(*_, dilations, padding, isa=0, **__):
    (dh, dw), ((ph, _), (pw, _)) = dilations, padding
    return {"dh": np.int64(dh), "dw": np.int64(dw), "ph": np.int64(ph), "pw": np.int64(pw),
            "isa": np.int64(ISAS[isa])}


# The three are one bilinear family: each is linear in either operand, and each transpose is
# another of the three (<dx(dy, w), u> = <dy, forward(u, w)> = <dw(dy, u), w>), so jvp and
# transpose rules keep every derivative of any order on the kernels.

def _jvp(op, primals, tangents, **params):
    out = op.bind(*primals, **params)
    terms = [op.bind(*(t if k == i else p for k, p in enumerate(primals)), **params)
             for i, t in enumerate(tangents) if not is_zero(t)]
    return out, (functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(out))


def _linear(rule):
    """A transpose rule of the family: nothing for a zero cotangent; else `rule(ct, a, b,
    p)` with p the three kernels' shared params (dilations, padding, isa)."""
    def transpose(op, ct, a, b, *, dilations, padding, isa=0, **_):
        if is_zero(ct):
            return None, None
        return rule(ct, a, b, {"dilations": dilations, "padding": padding, "isa": isa})
    return transpose


@_linear
def _forward_transpose(ct, x, w, p):
    return (dx_op.bind(ct, w, x_shape=shape_of(x)[1:], **p) if is_undefined(x) else None,
            dw_op.bind(ct, x, kernel=shape_of(w)[2:], **p) if is_undefined(w) else None)


@_linear
def _dx_transpose(ct, dy, w, p):
    return (forward_op.bind(ct, w, **p) if is_undefined(dy) else None,
            dw_op.bind(dy, ct, kernel=shape_of(w)[2:], **p) if is_undefined(w) else None)


@_linear
def _dw_transpose(ct, dy, x, p):
    return (forward_op.bind(x, ct, **p) if is_undefined(dy) else None,
            dx_op.bind(dy, ct, x_shape=shape_of(x)[1:], **p) if is_undefined(x) else None)


# images shard; the planes, channels and the window stay whole (the factors in the order they
# first appear: Shardy wants them sorted). dw sums over the images: partial sums, psum'd.
_IMAGE = ("n", "c", "h", "w")
_KERNEL = ("o", "i", "kh", "kw")
_OUTPUT = ("n", "o", "oh", "ow")
_forward_factors = lambda *a, **p: Factors((_IMAGE, _KERNEL), (_OUTPUT,),
                                           ("c", "h", "w", "o", "i", "kh", "kw", "oh", "ow"))
_dx_factors = lambda *a, **p: Factors((_OUTPUT, _KERNEL), (_IMAGE,),
                                      ("o", "oh", "ow", "i", "kh", "kw", "c", "h", "w"))
_dw_factors = lambda *a, **p: Factors((_OUTPUT, _IMAGE), (_KERNEL,),
                                      ("o", "oh", "ow", "c", "h", "w", "i", "kh", "kw"),
                                      summed=("n",))
_off_cpu = lambda platform, *args, **params: platform != "cpu"
_rules = {"batch": _batch, "ffi_attrs": _ffi_attrs, "jvp": _jvp, "xla_when": _off_cpu}

forward_op = Op("depthwise_conv", shape=_forward_shape, reference=_forward_reference,
                target="jaxops_depthwise_conv", factors=_forward_factors,
                transpose=_forward_transpose, **_rules)
dx_op = Op("depthwise_conv_dx", shape=_dx_shape, reference=_dx_reference,
           target="jaxops_depthwise_conv_dx", factors=_dx_factors, transpose=_dx_transpose,
           **_rules)
dw_op = Op("depthwise_conv_dw", shape=_dw_shape, reference=_dw_reference,
           target="jaxops_depthwise_conv_dw", factors=_dw_factors, transpose=_dw_transpose,
           **_rules)


def _params(dilations, padding, isa):
    return {"dilations": tuple(int(d) for d in dilations),
            "padding": tuple((int(lo), int(hi)) for lo, hi in padding), "isa": isa}


def _in_f32(op, a, b, dilations, padding, isa, **params):
    """op on a and b in float32, returned in a's dtype (f16/bf16 computed in f32, rounded
    once)."""
    out = op(a.astype(jnp.float32), b.astype(jnp.float32), **params,
             **_params(dilations, padding, isa))
    return out.astype(a.dtype)


def forward(x, w, dilations, padding, isa=0):
    """y [N, C * M, OH, OW] = the depthwise convolution of x [N, C, H, W] by w [C * M, 1, KH,
    KW], stride 1, in x's dtype. `isa` picks the kernel's loop code (ISAS; 0: the best the CPU
    has): the tests run each."""
    return _in_f32(forward_op, x, w, dilations, padding, isa)


def dx(dy, w, x_shape, dilations, padding, isa=0):
    """The transpose of forward in x at dy [N, C * M, OH, OW]: dx [N, *x_shape] (x_shape: C,
    H, W)."""
    return _in_f32(dx_op, dy, w, dilations, padding, isa,
                   x_shape=tuple(int(d) for d in x_shape))


def dw(dy, x, kernel, dilations, padding, isa=0):
    """The transpose of forward in w at dy [N, C * M, OH, OW]: dw [C * M, 1, *kernel]."""
    return _in_f32(dw_op, dy, x, dilations, padding, isa, kernel=tuple(int(k) for k in kernel))


# The largest convolution the kernel takes (FLOPs): it runs on the calling thread; the corpus's
# are at most 2**20 (ConvNeXt's, batch 2), and larger ones are unmeasured: XLA's there.
MAX_FLOPS = 1 << 24


def applies(x, w_shape, strides, dilations, group, padding, lhs_dilation) -> bool:
    """Whether conv_general takes the kernel on the CPU for x [N, C, H, W] and w [O, C / group,
    KH, KW] (ONNX layouts): depthwise (group == C, one input channel a group), 2-D, stride 1,
    no input dilation, pads >= 0, f32 or narrower floats, at most MAX_FLOPS."""
    if not (x.ndim == 4 and len(w_shape) == 4 and group == x.shape[1] and w_shape[1] == 1
            and group > 1 and all(s == 1 for s in strides)
            and (lhs_dilation is None or all(d == 1 for d in lhs_dilation))
            and min(p for pair in padding for p in pair) >= 0
            and x.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)):
        return False
    out = _out(x.shape[2:], w_shape[2:], dilations, padding)
    return min(out) >= 1 and 2 * x.shape[0] * w_shape[0] * math.prod(out) \
        * math.prod(w_shape[2:]) <= MAX_FLOPS


__all__: list[str] = []  # conv_general's, not jaxops.ops functions
