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

from jaxops.ops import _validate as v

_DEFAULT_RATIO = 0.5


def _ratio(op, ratio):
    """ratio as a float scalar array (0.5 when absent); concrete values are range-checked."""
    if ratio is None:
        return jnp.asarray(_DEFAULT_RATIO, jnp.float32)
    ratio = jnp.asarray(ratio)
    if ratio.dtype not in v.FLOATS:
        v.fail(op, TypeError, f"ratio must be a float scalar, got {ratio.dtype}")
    if ratio.size != 1:
        v.fail(op, ValueError, f"ratio must be a scalar, got shape {ratio.shape}")
    ratio = ratio.reshape(())
    try:
        r = float(ratio)
    except jax.errors.ConcretizationTypeError:  # traced: checked by nobody, as documented
        return ratio
    if not 0.0 <= r < 1.0:
        v.fail(op, ValueError, f"ratio must be in [0, 1), got {r}")
    return ratio


def _training_mode(op, training_mode):
    """True/False for a concrete flag (absent: False); a traced flag stays an array."""
    if training_mode is None:
        return False
    t = jnp.asarray(training_mode)
    if t.dtype != jnp.bool_ or t.size != 1:
        v.fail(op, TypeError, f"training_mode must be a bool scalar, got {t.dtype}{t.shape}")
    try:
        return bool(t.reshape(()))
    except jax.errors.ConcretizationTypeError:
        return t.reshape(())


def _scaled(op, dy, keep, ratio, *, zero_ratio_passes):
    t = v.compute_dtype(dy.dtype)
    r = ratio.astype(t)
    out = jnp.where(keep, dy.astype(t) * (1 / (1 - r)), jnp.zeros((), t))
    if zero_ratio_passes and dy.dtype in (jnp.float32, jnp.float64):
        out = jnp.where(r == 0, dy.astype(t), out)
    return out.astype(dy.dtype)


def dropout_grad(dy, mask, ratio=None, training_mode=None):
    """ORT DropoutGrad: dx = dy / (1 - ratio) where mask, else 0.

    ratio defaults to 0.5; ratio == 0 returns f32/f64 dy unchanged; training_mode is
    ignored (ORT's quirks, see the module docstring)."""
    op = "dropout_grad"
    dy, mask = jnp.asarray(dy), jnp.asarray(mask)
    v.floats(op, dy=dy)
    v.boolean(op, "mask", mask)
    v.same_shape(op, dy=dy, mask=mask)
    _training_mode(op, training_mode)
    return _scaled(op, dy, mask, _ratio(op, ratio), zero_ratio_passes=True)


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


def _check_bits(op, mask, numel):
    if mask.dtype != jnp.uint32:
        v.fail(op, TypeError, f"mask must be uint32 bit words, got {mask.dtype}")
    words = -(-numel // 32)
    if mask.ndim != 1 or mask.shape[0] != words:
        v.fail(op, ValueError, f"mask must be 1-D with ceil(numel / 32) = {words} words, "
                               f"got shape {mask.shape}")


def bitmask_dropout_grad(dy, mask, ratio=None, training_mode=None):
    """ORT BitmaskDropoutGrad: DropoutGrad with a uint32 bit mask (element i kept iff bit
    i % 32 of mask[i // 32] is set, i indexing the flattened dy). ratio defaults to 0.5;
    ratio == 0 as in dropout_grad; training_mode is ignored. (ORT has no CPU kernel.)"""
    op = "bitmask_dropout_grad"
    dy, mask = jnp.asarray(dy), jnp.asarray(mask)
    v.floats(op, dy=dy)
    _check_bits(op, mask, dy.size)
    _training_mode(op, training_mode)
    keep = bits_to_mask(mask, dy.shape)
    return _scaled(op, dy, keep, _ratio(op, ratio), zero_ratio_passes=True)


def _softmax_axes(op, ndim, axis):
    axis = v.integer(op, "axis", axis)
    if ndim == 0 or not -ndim <= axis < ndim:
        v.fail(op, ValueError, f"axis {axis} is out of range for rank {ndim}")
    return tuple(range(axis % ndim, ndim))


def softmax_dropout_grad(dy, mask, softmax_y, ratio=None, *, axis):
    """ORT SoftmaxDropoutGrad: g = dy / (1 - ratio) where mask, else 0; then
    dx = softmax_y * (g - sum(g * softmax_y)), the sum over every dim from `axis` on (the
    pre-opset-13 softmax rule BiasSoftmaxDropout uses). `axis` is required, as in ORT; ratio
    defaults to 0.5. (ORT has no CPU kernel.)"""
    op = "softmax_dropout_grad"
    dy, mask, y = jnp.asarray(dy), jnp.asarray(mask), jnp.asarray(softmax_y)
    dtype = v.floats(op, dy=dy, softmax_y=y)
    v.boolean(op, "mask", mask)
    v.same_shape(op, dy=dy, mask=mask, softmax_y=y)
    axes = _softmax_axes(op, dy.ndim, axis)
    t = v.compute_dtype(dtype)
    r = _ratio(op, ratio).astype(t)
    g = jnp.where(mask, dy.astype(t) * (1 / (1 - r)), jnp.zeros((), t))
    yt = y.astype(t)
    return (yt * (g - jnp.sum(g * yt, axis=axes, keepdims=True))).astype(dtype)


def _key(op, key, seed):
    if key is not None:
        return key
    if seed is None:
        v.fail(op, TypeError, "needs a JAX PRNG key (keyword `key`) or an integer `seed`")
    return jax.random.key(v.integer(op, "seed", seed))


def _dropout(op, x, ratio, training_mode, key, seed):
    """(output, keep mask) of dropout on x in its compute dtype."""
    ratio = _ratio(op, ratio)
    training = _training_mode(op, training_mode)
    if training is False:  # known at trace time: no randomness, no key needed
        return x, jnp.ones(x.shape, jnp.bool_)
    u = jax.random.uniform(_key(op, key, seed), x.shape, jnp.float32)
    keep = u >= ratio.astype(jnp.float32)
    scale = 1 / (1 - ratio.astype(x.dtype))
    if training is not True:  # a traced flag: drop only where it is set
        keep = keep | ~training
        scale = jnp.where(training, scale, jnp.ones((), x.dtype))
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep


def bias_dropout(data, bias, residual=None, ratio=None, training_mode=None, *, key=None,
                 seed=None):
    """ORT BiasDropout: output = Dropout(data + bias) + residual, returns (output, mask).

    bias is 1-D over data's last dim; residual (optional) has data's shape. ratio defaults to
    0.5; training_mode defaults to false (no dropout, mask all true). See the module docstring
    for `key`/`seed`."""
    op = "bias_dropout"
    data, bias = jnp.asarray(data), jnp.asarray(bias)
    arrays = {"data": data, "bias": bias}
    if residual is not None:
        residual = jnp.asarray(residual)
        arrays["residual"] = residual
        v.same_shape(op, data=data, residual=residual)
    dtype = v.floats(op, **arrays)
    if data.ndim == 0 or bias.shape != data.shape[-1:]:
        v.fail(op, ValueError, f"bias must be 1-D with data's last dim, got bias {bias.shape} "
                               f"for data {data.shape}")
    t = v.compute_dtype(dtype)
    out, keep = _dropout(op, data.astype(t) + bias.astype(t), ratio, training_mode, key, seed)
    if residual is not None:
        out = out + residual.astype(t)
    return out.astype(dtype), keep


def bitmask_dropout(data, ratio=None, training_mode=None, *, key=None, seed=None):
    """ORT BitmaskDropout: Dropout whose mask output is uint32 bit words (see
    bitmask_dropout_grad); returns (output, mask). ratio defaults to 0.5, training_mode to
    false (no dropout, every mask bit of an element set)."""
    op = "bitmask_dropout"
    data = jnp.asarray(data)
    dtype = v.floats(op, data=data)
    t = v.compute_dtype(dtype)
    out, keep = _dropout(op, data.astype(t), ratio, training_mode, key, seed)
    return out.astype(dtype), mask_to_bits(keep)


def bias_softmax_dropout(data, bias, ratio=None, *, axis=1, is_inner_broadcast, key=None,
                         seed=None):
    """ORT BiasSoftmaxDropout: softmax_output = Softmax(data + bias) over every dim from
    `axis` on; (dropout_output, mask) = Dropout(softmax_output, ratio) in training mode.
    Returns (dropout_output, mask, softmax_output).

    bias broadcasts against data numpy-style (right-aligned; ORT's is_inner_broadcast only
    tells its kernel which of the two shapes it gets and is required, as in ORT, but not
    otherwise used). ratio defaults to 0.5. See the module docstring for `key`/`seed`."""
    op = "bias_softmax_dropout"
    data, bias = jnp.asarray(data), jnp.asarray(bias)
    dtype = v.floats(op, data=data, bias=bias)
    v.integer(op, "is_inner_broadcast", is_inner_broadcast)
    try:
        full = jnp.broadcast_shapes(data.shape, bias.shape)
    except ValueError:
        full = None
    if full != tuple(data.shape):
        v.fail(op, ValueError, f"bias {bias.shape} does not broadcast to data {data.shape}")
    axes = _softmax_axes(op, data.ndim, axis)
    t = v.compute_dtype(dtype)
    z = data.astype(t) + bias.astype(t)
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=axes, keepdims=True))
    e = jnp.exp(z)
    y = e / jnp.sum(e, axis=axes, keepdims=True)
    out, keep = _dropout(op, y, ratio, True, key, seed)
    return out.astype(dtype), keep, y.astype(dtype)


__all__ = ["bias_dropout", "bias_softmax_dropout", "bitmask_dropout", "bitmask_dropout_grad",
           "dropout_grad", "softmax_dropout_grad"]

_MS = "com.microsoft"
ORT_OPS = {
    (_MS, "DropoutGrad"): dropout_grad,
    (_MS, "BitmaskDropoutGrad"): bitmask_dropout_grad,
    (_MS, "SoftmaxDropoutGrad"): softmax_dropout_grad,
    (_MS, "BiasDropout"): bias_dropout,
    (_MS, "BitmaskDropout"): bitmask_dropout,
    (_MS, "BiasSoftmaxDropout"): bias_softmax_dropout,
}
