"""Sequences and optionals. A sequence is a Python list of arrays (a pytree, so it passes
through jit/grad/vmap); an empty optional is None. Positions must be known without the data.
Values pass through untouched, so numpy stays numpy."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxops.onnx.registry import handler


def _seq(ctx, s, what="input_sequence"):
    if not isinstance(s, (list, tuple)):
        raise ctx.error(f"{what} must be a sequence, got {type(s).__name__}")
    return list(s)


def _position(ctx, pos, n, *, insert=False):
    p = ctx.static(pos, "position")
    if p.size != 1 or p.dtype.kind not in "iu":
        raise ctx.error(f"position must be one integer, got {p.dtype} of shape {p.shape}")
    p = int(p.reshape(()))
    hi = n if insert else n - 1
    if not -n <= p <= hi:
        raise ctx.error(f"position {p} is out of range for a sequence of length {n}")
    return p + n if p < 0 else p


def _concat(parts, axis):
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis)
    return jnp.concatenate([jnp.asarray(p) for p in parts], axis)


@handler("SequenceEmpty", since=11)
def sequence_empty(ctx, *, dtype=1):
    return []


@handler("SequenceConstruct", since=11)
def sequence_construct(ctx, *inputs):
    return list(inputs)


@handler("SequenceAt", since=11)
def sequence_at(ctx, input_sequence, position):
    s = _seq(ctx, input_sequence)
    return s[_position(ctx, position, len(s))]


@handler("SequenceLength", since=11)
def sequence_length(ctx, input_sequence):
    return np.array(len(_seq(ctx, input_sequence)), np.int64)


@handler("SequenceInsert", since=11)
def sequence_insert(ctx, input_sequence, tensor, position=None):
    s = _seq(ctx, input_sequence)
    at = len(s) if position is None else _position(ctx, position, len(s), insert=True)
    return s[:at] + [tensor] + s[at:]


@handler("SequenceErase", since=11)
def sequence_erase(ctx, input_sequence, position=None):
    s = _seq(ctx, input_sequence)
    if not s:
        raise ctx.error("cannot erase from an empty sequence")
    at = len(s) - 1 if position is None else _position(ctx, position, len(s))
    return s[:at] + s[at + 1:]


@handler("SplitToSequence", since=11)
def split_to_sequence(ctx, input, split=None, *, axis=0, keepdims=1):
    x = input
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise ctx.error(f"axis {axis} is out of range for rank {ndim}")
    axis %= ndim
    n = np.shape(x)[axis]
    xp = np if isinstance(x, np.ndarray) else jnp
    if split is None:
        parts = [xp.take(x, i, axis=axis) for i in range(n)]
        return parts if not keepdims else [xp.expand_dims(p, axis) for p in parts]
    sizes = ctx.static(split, "split")
    if sizes.ndim == 0:
        step = int(sizes)
        if step <= 0:
            raise ctx.error(f"split must be positive, got {step}")
        sizes = [step] * (n // step) + ([n % step] if n % step else [])
    else:
        sizes = [int(v) for v in sizes]
        if any(v < 0 for v in sizes) or sum(sizes) != n:
            raise ctx.error(f"split sizes {sizes} do not add up to the axis length {n}")
    bounds = np.cumsum([0] + sizes)
    return [xp.take(x, xp.arange(int(a), int(b)), axis=axis)
            for a, b in zip(bounds[:-1], bounds[1:])]


@handler("ConcatFromSequence", since=11)
def concat_from_sequence(ctx, input_sequence, *, axis, new_axis=0):
    s = _seq(ctx, input_sequence)
    if not s:
        raise ctx.error("cannot concatenate an empty sequence")
    ndim = np.ndim(s[0]) + (1 if new_axis else 0)
    if not -ndim <= axis < ndim:
        raise ctx.error(f"axis {axis} is out of range for rank {ndim}")
    axis %= ndim
    if new_axis:
        s = [(np if isinstance(p, np.ndarray) else jnp).expand_dims(p, axis) for p in s]
    return _concat(s, axis)


@handler("SequenceMap", since=17)
def sequence_map(ctx, input_sequence, *additional_inputs, body):
    s = _seq(ctx, input_sequence)
    extra = list(additional_inputs)
    for e in extra:
        if isinstance(e, (list, tuple)) and len(e) != len(s):
            raise ctx.error(f"additional sequence of length {len(e)} for an input sequence of "
                            f"length {len(s)}")
    results = [ctx.run_graph(body, x, *[e[i] if isinstance(e, (list, tuple)) else e
                                        for e in extra])
               for i, x in enumerate(s)]
    n_out = len(body.output)
    outs = [[r[k] for r in results] for k in range(n_out)]
    return tuple(outs) if n_out > 1 else outs[0]


@handler("Optional", since=15)
def optional(ctx, input=None, *, type=None):
    return input


@handler("OptionalHasElement", since=15)
def optional_has_element(ctx, input=None):
    return np.array(input is not None)


@handler("OptionalGetElement", since=15)
def optional_get_element(ctx, input):
    if input is None:
        raise ctx.error("the optional is empty")
    return input
