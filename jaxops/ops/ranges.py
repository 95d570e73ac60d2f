"""take_ranges: pieces of a flat buffer, each from its own offset, in one CPU kernel call
(ffi/cpu/ranges.cc). Not an ORT op: the packed training state (jaxops/onnx/packed.py) takes its
weight matrices out of their flat buffer with it where XLA:CPU has more than one thread.

XLA:CPU copies each slice of a buffer in a thunk of its own; slices of a jitted step's
parameter buffer are independent of each other and of the inputs, so each is a source of the
program's thunk graph, and with more than one intra-op thread the executor hands ready thunks
to other threads, whose wakes and hand-offs cost more than these small programs take
(docs/performance.md, issue 24's twelfth and thirteenth sessions). One kernel call is one
thunk. Off the CPU the pieces lower as XLA's slices; derivatives and vmap are the slices'.
"""
import math
import operator

import jax
import numpy as np

from jaxops._src.op import Factors, Op
from jaxops.ops.concat import BYTE_DTYPES


def _check(flat, pieces):
    if flat.ndim != 1:
        raise ValueError(f"flat must have rank 1, got shape {flat.shape}")
    if np.dtype(flat.dtype) not in BYTE_DTYPES:
        raise TypeError(f"flat has unsupported dtype {flat.dtype} (floats, ints, bool)")
    for k, (offset, shape) in enumerate(pieces):
        offset = operator.index(offset)
        if any(operator.index(d) < 0 for d in shape):
            raise ValueError(f"piece {k} has a negative dim: {shape}")
        if offset < 0 or offset + math.prod(shape) > flat.shape[0]:
            raise ValueError(f"piece {k} ({math.prod(shape)} elements from offset {offset}) "
                             f"reaches outside flat's {flat.shape[0]} elements")


def _shape(flat, *, pieces):
    _check(flat, pieces)
    return tuple(jax.ShapeDtypeStruct(shape, flat.dtype) for _, shape in pieces)


def _reference(flat, *, pieces):
    """Slices along the last axis (leading axes: a vmap's batch)."""
    lead = flat.shape[:-1]
    return tuple(flat[..., o:o + math.prod(s)].reshape(*lead, *s) for o, s in pieces)


def _batch(op, args, dims, *, pieces):
    (flat,), (d,) = args, dims
    return _reference(jax.numpy.moveaxis(flat, d, 0), pieces=pieces), (0,) * len(pieces)


def _factors(flat, *, pieces):
    # nothing shards: a piece needs its range of flat whole
    outs = tuple(tuple(f"p{k}_{j}" for j in range(len(s))) for k, (_, s) in enumerate(pieces))
    return Factors((("flat",),), outs, ("flat", *(f for dims in outs for f in dims)))


_TAKE = Op("take_ranges", shape=_shape, reference=_reference, batch=_batch,
           target="jaxops_take_ranges", factors=_factors, multiple_results=True,
           ffi_attrs=lambda flat, *, pieces: {
               "offsets": tuple(o for o, _ in pieces)},
           xla_when=lambda platform, *args, **params: platform != "cpu")


def take_ranges(flat, pieces) -> tuple[jax.Array, ...]:
    """(flat[o:o + prod(s)].reshape(s) for o, s in pieces): `flat` 1-D, `pieces` a sequence
    of (offset, shape) pairs (static), which may leave gaps and overlap."""
    pieces = tuple((operator.index(o), tuple(map(operator.index, s))) for o, s in pieces)
    return _TAKE(flat, pieces=pieces) if pieces else ()


__all__: list[str] = []  # the packed state's helper, not a jaxops.ops function
