"""GIST activation compression for training: keep a layer's input compressed between the forward
and the backward pass, as ORT's GIST graph transformer did with its Gist*Encoder/Decoder pairs.

    layer = gist_checkpoint(lambda x, w, b: jax.nn.gelu(x @ w + b), format="pack16")
    y = layer(x, w, b)          # forward as usual; saves pack16(x), w and b, nothing else

`gist_checkpoint(f, format, argnums=0)` returns f with a `jax.custom_jvp`: the primal pass runs
f and encodes the `argnums` arguments in `format`; the tangent is jax.jvp of f at the decoded
values (the other arguments, a layer's weights, as they are), inside `jax.checkpoint`, so
reverse mode saves the encoded values instead of f's intermediate values and its backward
decodes them and transposes f's jvp there (rematerialisation from a compressed input). So the
saved memory per layer is the compressed input alone, the gradient is f's exact gradient at
the decoded input, and forward mode gives the same derivative (jvp at the decoded input).

Formats:
  "pack16"    float32 -> float16 (GistPack16; 2 bytes per element). Gradients are f's at
              x rounded to float16 (relative error 2^-11 per element; |x| > 65504 overflows).
  "msfp15"    float32 -> 1 byte per element in 8-element tiles along the last axis with a
              shared exponent (GistPackMsfp15; the last dim must be a multiple of 8). Each
              element is off by at most 1/32 of its tile's largest magnitude (tiles whose
              largest magnitude is below 2^-121 decode to ORT's wrapped-exponent bits).
  "binarize"  the sign alone (GistBinarize: 1 byte per element),
  "pack1"     the sign alone, 8 per byte (GistPack1): for f whose backward needs only whether
              x > 0, such as jax.nn.relu or leaky_relu, i.e. piecewise linear with its one kink
              at 0 and no other argument whose gradient needs x's value. The backward runs at
              x~ = +1 where x > 0 and -1 elsewhere (x == 0 counts as negative, as ORT's ReluGrad
              has it), exact for such f and wrong for any other.
ORT's GistPack8 is not offered: its decoder does not invert its encoder (jaxops.ops.gist).

Compression pays when the saved inputs dominate a step's memory; a layer pays for it with one
extra encode and decode pass and the recomputation of f in the backward. Two
`lax.optimization_barrier`s make XLA keep the packed bytes: without them it fuses encode+decode
into the backward (reading, so keeping, the float32 input) and hoists the decode out of order.
Measured on CPU with jax 0.12 (tests/test_gist_checkpoint.py), temp memory of the gradient of
4 gelu layers in float32 activations [512, 128]: plain autodiff 10, jax.checkpoint 4, pack16 3.5,
msfp15 2; jax 0.8's XLA keeps more buffers (docs/gist.md).
"""
import functools

import jax
import jax.numpy as jnp

from jaxops.ops import gist as ops

_FLOAT, _BOOL = 1, 9  # ONNX element types for the decoders' `to`


def _f32_only(fmt, x):
    if x.dtype != jnp.float32:
        raise TypeError(f"jaxops.nn.gist_checkpoint: format {fmt!r} stores float32 inputs, "
                        f"got {x.dtype}")


def _tiled_f32(fmt, x):
    _f32_only(fmt, x)
    if x.ndim == 0 or x.shape[-1] % 8:
        raise ValueError(f"jaxops.nn.gist_checkpoint: format {fmt!r} needs the last dim to be a "
                         f"multiple of 8 (one MSFP tile), got shape {x.shape}")


def _sign_only(fmt, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jaxops.nn.gist_checkpoint: format {fmt!r} needs a float input, "
                        f"got {x.dtype}")


def _sign(bits, like):
    return jnp.where(bits, 1, -1).astype(like.dtype)


# format -> (check(format, x), encode(x), decode(saved, x-like ShapeDtypeStruct))
_FORMATS = {
    "pack16": (_f32_only, ops.gist_pack16_encoder,
               lambda s, like: ops.gist_pack16_decoder(s, to=_FLOAT)),
    "msfp15": (_tiled_f32, ops.gist_pack_msfp15_encoder,
               lambda s, like: ops.gist_pack_msfp15_decoder(s, to=_FLOAT)),
    "binarize": (_sign_only, lambda x: x > 0, _sign),
    "pack1": (_sign_only, lambda x: ops.gist_pack1_encoder(x > 0),
              lambda s, like: _sign(ops.gist_pack1_decoder(s, to=_BOOL)[:like.size]
                                    .reshape(like.shape), like)),
}


def gist_checkpoint(f, format="pack16", *, argnums=0):
    """f with its `argnums` arguments (int or tuple of ints; arrays) saved for the backward pass
    in GIST `format` ("pack16", "msfp15", "binarize", "pack1"; see the module docstring) and
    every intermediate value of f recomputed there. f's arguments are arrays or pytrees of
    arrays, its output any pytree of arrays."""
    if format not in _FORMATS:
        why = (" (ORT's GistPack8 decoder does not invert its encoder)"
               if format == "pack8" else "")
        raise ValueError(f"jaxops.nn.gist_checkpoint: format must be one of "
                         f"{', '.join(map(repr, _FORMATS))}, got {format!r}{why}")
    check, encode, decode = _FORMATS[format]
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"jaxops.nn.gist_checkpoint: argnums must be an int or a tuple of ints, "
                        f"got {argnums!r}")

    @functools.wraps(f)
    def wrapped(*args):
        picked = sorted({i + len(args) if i < 0 else i for i in nums})
        if picked[0] < 0 or picked[-1] >= len(args):
            raise ValueError(f"jaxops.nn.gist_checkpoint: argnums {argnums} out of range for "
                             f"{len(args)} arguments")
        likes = {}
        for i in picked:
            x = jnp.asarray(args[i])
            check(format, x)
            likes[i] = jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jax.custom_jvp
        def run(*a):
            return f(*a)

        @jax.checkpoint  # the backward recomputes from the saved values alone
        def tangent(saved, tangents):
            restored = tuple(decode(s, likes[i]) if i in likes else s for i, s in enumerate(saved))
            return jax.jvp(f, restored, tangents)[1]

        @run.defjvp
        def run_jvp(primals, tangents):
            # the barrier keeps XLA from fusing encode+decode into the backward, which would
            # read (and so keep alive) the uncompressed input instead of the packed bytes
            packed = jax.lax.optimization_barrier({i: encode(primals[i]) for i in likes})
            saved = tuple(packed[i] if i in likes else x for i, x in enumerate(primals))
            return f(*primals), tangent(saved, tuple(tangents))

        return run(*(jnp.asarray(a) if i in likes else a for i, a in enumerate(args)))

    return wrapped


__all__ = ["gist_checkpoint"]
