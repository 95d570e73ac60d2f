"""Dropout gradients (com.microsoft DropoutGrad, BitmaskDropoutGrad, SoftmaxDropoutGrad) and
the training forwards real graphs pair them with (BiasDropout, BitmaskDropout,
BiasSoftmaxDropout; the plain ONNX Dropout forward belongs to the importer).

ORT's rules, kept here:
- `ratio` is an optional input, default 0.5 when absent (None); a concrete ratio outside
  [0, 1) raises ValueError as ORT does (a traced one cannot be checked: 1 gives inf).
- kept elements are scaled by 1 / (1 - ratio), computed in the compute dtype (f32 for
  f16/bf16/f32, f64 for f64; ORT's f64 kernel forms the scale with float precision only).
- DropoutGrad and BitmaskDropoutGrad with ratio == 0 return dY unchanged and ignore the mask
  for f32/f64 dY, but apply the mask (scale 1) for f16 -- both as ORT 1.19.2 CPU does -- and
  for bf16 (which ORT's CPU kernel lacks; assumed like f16). SoftmaxDropoutGrad always
  applies the mask. (A mask from a ratio-0 forward is all true, so real graphs never see the
  difference.)
- `training_mode` of the gradient ops is accepted and IGNORED (ORT 1.19.2 scales by
  1/(1-ratio) even for training_mode=False).
- Bit masks are uint32 words: element i (of the flattened tensor) is kept iff bit i % 32 of
  word i // 32 is set; the mask has ceil(numel / 32) words.

Randomness: ORT draws from its own generator (a `seed` attribute or a global one), which no
other implementation reproduces. The forwards here take an explicit JAX PRNG key as the
keyword `key`; without one, an integer `seed` (ORT's attribute) makes `jax.random.key(seed)`.
An element is kept where a uniform [0, 1) draw is >= ratio. With training_mode false or
absent (ORT's default for the forwards) nothing is dropped and the mask is all true.

All of this is XLA code: jit, vmap, autodiff (through the kept-element scaling; masks are
not differentiable) and sharding need no extra rules.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxops._src import rules
from jaxops._src.spec import REQUIRED, Matrix, define

_DEFAULT_RATIO = 0.5


# ------------------------------------------------------------------------------------------
# Argument rules (plain messages: the public functions prefix the op's name)


def _check_ratio(ratio):
    """ratio (its float dtype is the input kind's rule) holds one value; a concrete one lies
    in [0, 1) (a traced one cannot be checked: 1 gives inf)."""
    if ratio is None:
        return
    if ratio.size != 1:
        raise ValueError(f"ratio must be a scalar, got shape {ratio.shape}")
    try:
        r = float(ratio.reshape(()))
    except jax.errors.ConcretizationTypeError:  # traced: checked by nobody, as documented
        return
    if not 0.0 <= r < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {r}")


def _check_training(training_mode):
    if training_mode is not None:
        rules.flag("training_mode", training_mode)


def _check_key(training, key, seed):
    """A forward that may drop needs randomness: a key, else an integer seed."""
    if seed is not None:
        rules.integer("seed", seed)
    if training is not False and key is None and seed is None:
        raise TypeError("needs a JAX PRNG key (keyword `key`) or an integer `seed`")


def _softmax_axes(ndim, axis):
    return tuple(range(rules.axis(axis, ndim), ndim))


# ------------------------------------------------------------------------------------------
# Shared pieces


def _ratio(ratio):
    """ratio as a float scalar array (0.5 when absent)."""
    if ratio is None:
        return jnp.asarray(_DEFAULT_RATIO, jnp.float32)
    return ratio.reshape(())


def _training(training_mode):
    """True/False for a concrete flag (absent: False); a traced flag stays an array."""
    if training_mode is None:
        return False
    t = training_mode.reshape(())
    try:
        return bool(t)
    except jax.errors.ConcretizationTypeError:
        return t


def _scaled(dy, keep, ratio, *, zero_ratio_passes):
    t = rules.compute_dtype(dy.dtype)
    r = ratio.astype(t)
    out = jnp.where(keep, dy.astype(t) * (1 / (1 - r)), jnp.zeros((), t))
    if zero_ratio_passes and dy.dtype in (jnp.float32, jnp.float64):
        out = jnp.where(r == 0, dy.astype(t), out)
    return out.astype(dy.dtype)


def bits_to_mask(words, shape):
    """Unpacks a uint32 bit mask (bit i % 32 of word i // 32) to a bool array of `shape`."""
    n = int(np.prod(shape))
    # shifts and reshapes only (no gather), so a sharded mask unpacks shard by shard
    bits = (words[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return (bits.reshape(-1)[:n] == 1).reshape(shape)


def mask_to_bits(mask):
    """Packs a bool array into uint32 words, bit i % 32 of word i // 32; the unused high bits
    of the last word are 0."""
    flat = mask.reshape(-1)
    words = -(-flat.size // 32)
    padded = jnp.zeros(words * 32, jnp.uint32).at[:flat.size].set(flat.astype(jnp.uint32))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(padded.reshape(words, 32) << shifts, axis=1, dtype=jnp.uint32)


def _dropout(x, ratio, training, key, seed):
    """(output, keep mask) of dropout on x in its compute dtype; ratio a scalar array,
    training True/False or a traced bool."""
    if training is False:  # known at trace time: no randomness, no key needed
        return x, jnp.ones(x.shape, jnp.bool_)
    key = jax.random.key(seed) if key is None else key
    u = jax.random.uniform(key, x.shape, jnp.float32)
    keep = u >= ratio.astype(jnp.float32)
    scale = 1 / (1 - ratio.astype(x.dtype))
    if training is not True:  # a traced flag: drop only where it is set
        keep = keep | ~training
        scale = jnp.where(training, scale, jnp.ones((), x.dtype))
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep


# ------------------------------------------------------------------------------------------
# The gradients


def _check_dropout_grad(dy, mask, ratio, training_mode):
    rules.same_shape(dy=dy, mask=mask)
    _check_ratio(ratio)
    _check_training(training_mode)


def _dropout_grad(dy, mask, ratio, training_mode):
    return _scaled(dy, mask, _ratio(ratio), zero_ratio_passes=True)


def _check_bitmask_grad(dy, mask, ratio, training_mode):
    if mask.dtype != jnp.uint32:
        raise TypeError(f"mask must be uint32 bit words, got {mask.dtype}")
    words = -(-dy.size // 32)
    if mask.ndim != 1 or mask.shape[0] != words:
        raise ValueError(f"mask must be 1-D with ceil(numel / 32) = {words} words, got shape "
                         f"{mask.shape}")
    _check_ratio(ratio)
    _check_training(training_mode)


def _bitmask_dropout_grad(dy, mask, ratio, training_mode):
    return _scaled(dy, bits_to_mask(mask, dy.shape), _ratio(ratio), zero_ratio_passes=True)


def _check_softmax_grad(dy, mask, softmax_y, ratio, *, axis):
    rules.same_dtype(dy=dy, softmax_y=softmax_y)
    rules.same_shape(dy=dy, mask=mask, softmax_y=softmax_y)
    rules.axis(axis, dy.ndim)
    _check_ratio(ratio)


def _softmax_dropout_grad(dy, mask, softmax_y, ratio, *, axis):
    axes = _softmax_axes(dy.ndim, axis)
    t = rules.compute_dtype(dy.dtype)
    r = _ratio(ratio).astype(t)
    g = jnp.where(mask, dy.astype(t) * (1 / (1 - r)), jnp.zeros((), t))
    yt = softmax_y.astype(t)
    return (yt * (g - jnp.sum(g * yt, axis=axes, keepdims=True))).astype(dy.dtype)


# ------------------------------------------------------------------------------------------
# The forwards


def _check_bias_dropout(data, bias, residual, ratio, training_mode, *, seed, key):
    rules.same_dtype(data=data, bias=bias, residual=residual)
    if residual is not None:
        rules.same_shape(data=data, residual=residual)
    if data.ndim == 0 or bias.shape != data.shape[-1:]:
        raise ValueError(f"bias must be 1-D with data's last dim, got bias {bias.shape} for "
                         f"data {data.shape}")
    _check_ratio(ratio)
    _check_training(training_mode)
    _check_key(_training(training_mode), key, seed)


def _bias_dropout(data, bias, residual, ratio, training_mode, *, seed, key):
    t = rules.compute_dtype(data.dtype)
    out, keep = _dropout(data.astype(t) + bias.astype(t), _ratio(ratio),
                         _training(training_mode), key, seed)
    if residual is not None:
        out = out + residual.astype(t)
    return out.astype(data.dtype), keep


def _check_bitmask_dropout(data, ratio, training_mode, *, seed, key):
    _check_ratio(ratio)
    _check_training(training_mode)
    _check_key(_training(training_mode), key, seed)


def _bitmask_dropout(data, ratio, training_mode, *, seed, key):
    t = rules.compute_dtype(data.dtype)
    out, keep = _dropout(data.astype(t), _ratio(ratio), _training(training_mode), key, seed)
    return out.astype(data.dtype), mask_to_bits(keep)


def _check_bias_softmax_dropout(data, bias, ratio, *, axis, is_inner_broadcast, seed, key):
    rules.same_dtype(data=data, bias=bias)
    rules.integer("is_inner_broadcast", is_inner_broadcast)
    try:
        full = jnp.broadcast_shapes(data.shape, bias.shape)
    except ValueError:
        full = None
    if full != tuple(data.shape):
        raise ValueError(f"bias {bias.shape} does not broadcast to data {data.shape}")
    rules.axis(axis, data.ndim)
    _check_ratio(ratio)
    _check_key(True, key, seed)


def _bias_softmax_dropout(data, bias, ratio, *, axis, is_inner_broadcast, seed, key):
    axes = _softmax_axes(data.ndim, axis)
    t = rules.compute_dtype(data.dtype)
    z = data.astype(t) + bias.astype(t)
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=axes, keepdims=True))
    e = jnp.exp(z)
    y = e / jnp.sum(e, axis=axes, keepdims=True)
    out, keep = _dropout(y, _ratio(ratio), True, key, seed)
    return out.astype(data.dtype), keep, y.astype(data.dtype)


# ------------------------------------------------------------------------------------------
# The specs. Matrix rows: [N, C] operands; the gradients with a traced ratio ([1], a value in
# [0.1, 0.6)), the forwards in training mode with a fixed seed (every example and every call
# draws the same mask, so vmap and jit agree with the per-example calls).


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _mask(rng, shape):
    return jnp.asarray(rng.random(shape) > 0.4)


def _ratio_input(rng, dtype):
    return jnp.asarray([rng.uniform(0.1, 0.6)], dtype)


def _softmax(rng, shape, dtype):
    return jax.nn.softmax(jnp.asarray(rng.standard_normal(shape)), -1).astype(dtype)


_MS = "com.microsoft"
_TRAINING = {"ratio": 0.3, "training_mode": True, "seed": 0}

dropout_grad = define(
    "dropout_grad", ort=(_MS, "DropoutGrad"),
    inputs=("dy: float", "mask: bool", "ratio?: float", "training_mode?: bool"),
    outputs=("dx",), check=_check_dropout_grad, reference=_dropout_grad,
    doc="""ORT DropoutGrad: dx = dy / (1 - ratio) where mask, else 0.

    ratio defaults to 0.5; ratio == 0 returns f32/f64 dy unchanged; training_mode is
    ignored (ORT's quirks, see the module docstring).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype), _mask(rng, shape),
                                             _ratio_input(rng, dtype)), grad=(0, 2)))

bitmask_dropout_grad = define(
    "bitmask_dropout_grad", ort=(_MS, "BitmaskDropoutGrad"),
    inputs=("dy: float", "mask", "ratio?: float", "training_mode?: bool"),
    outputs=("dx",), check=_check_bitmask_grad, reference=_bitmask_dropout_grad,
    doc="""ORT BitmaskDropoutGrad: DropoutGrad with a uint32 bit mask (element i kept iff bit
    i % 32 of mask[i // 32] is set, i indexing the flattened dy). ratio defaults to 0.5;
    ratio == 0 as in dropout_grad; training_mode is ignored. (ORT has no CPU kernel.)""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             mask_to_bits(_mask(rng, shape)),
                                             _ratio_input(rng, dtype)), grad=(0, 2)))

softmax_dropout_grad = define(
    "softmax_dropout_grad", ort=(_MS, "SoftmaxDropoutGrad"),
    inputs=("dy: float", "mask: bool", "softmax_y: float", "ratio?: float"), outputs=("dx",),
    attrs={"axis": REQUIRED}, check=_check_softmax_grad, reference=_softmax_dropout_grad,
    doc="""ORT SoftmaxDropoutGrad: g = dy / (1 - ratio) where mask, else 0; then
    dx = softmax_y * (g - sum(g * softmax_y)), the sum over every dim from `axis` on (the
    pre-opset-13 softmax rule BiasSoftmaxDropout uses). `axis` is required, as in ORT; ratio
    defaults to 0.5. (ORT has no CPU kernel.)""",
    # axis -1 keeps dim 0 a row dim, which shards with no gather
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype), _mask(rng, shape),
                                             _softmax(rng, shape, dtype),
                                             _ratio_input(rng, dtype)),
                  attrs={"axis": -1}, grad=(0, 2, 3)))

bias_dropout = define(
    "bias_dropout", ort=(_MS, "BiasDropout"),
    inputs=("data: float", "bias: float", "residual?: float", "ratio?: float",
            "training_mode?: bool"),
    outputs=("output", "mask"), attrs={"seed": None}, options={"key": None},
    check=_check_bias_dropout, reference=_bias_dropout,
    doc="""ORT BiasDropout: output = Dropout(data + bias) + residual, returns (output, mask).

    bias is 1-D over data's last dim; residual (optional) has data's shape. ratio defaults to
    0.5; training_mode defaults to false (no dropout, mask all true). See the module docstring
    for `key`/`seed`.""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             _normal(rng, shape[-1:], dtype),
                                             _normal(rng, shape, dtype)),
                  attrs=_TRAINING, grad=(0, 1, 2)))

bitmask_dropout = define(
    "bitmask_dropout", ort=(_MS, "BitmaskDropout"),
    inputs=("data: float", "ratio?: float", "training_mode?: bool"), outputs=("output", "mask"),
    attrs={"seed": None}, options={"key": None}, check=_check_bitmask_dropout,
    reference=_bitmask_dropout,
    doc="""ORT BitmaskDropout: Dropout whose mask output is uint32 bit words (see
    bitmask_dropout_grad); returns (output, mask). ratio defaults to 0.5, training_mode to
    false (no dropout, every mask bit of an element set).""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),), attrs=_TRAINING,
                  grad=(0,)))

bias_softmax_dropout = define(
    "bias_softmax_dropout", ort=(_MS, "BiasSoftmaxDropout"),
    inputs=("data: float", "bias: float", "ratio?: float"),
    outputs=("dropout_output", "mask", "softmax_output"),
    attrs={"axis": 1, "is_inner_broadcast": REQUIRED, "seed": None}, options={"key": None},
    check=_check_bias_softmax_dropout, reference=_bias_softmax_dropout,
    doc="""ORT BiasSoftmaxDropout: softmax_output = Softmax(data + bias) over every dim from
    `axis` on; (dropout_output, mask) = Dropout(softmax_output, ratio) in training mode.
    Returns (dropout_output, mask, softmax_output).

    bias broadcasts against data numpy-style (right-aligned; ORT's is_inner_broadcast only
    tells its kernel which of the two shapes it gets and is required, as in ORT, but not
    otherwise used). ratio defaults to 0.5. See the module docstring for `key`/`seed`.""",
    matrix=Matrix(lambda rng, shape, dtype: (_normal(rng, shape, dtype),
                                             _normal(rng, shape[-1:], dtype)),
                  attrs={"ratio": 0.3, "axis": -1, "is_inner_broadcast": 0, "seed": 0},
                  grad=(0, 1)))


__all__ = ["bias_dropout", "bias_softmax_dropout", "bitmask_dropout", "bitmask_dropout_grad",
           "dropout_grad", "softmax_dropout_grad"]
