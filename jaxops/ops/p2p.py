"""Send and Recv (com.microsoft): ORT's point-to-point transfers as one `lax.ppermute`.

ORT runs one graph per pipeline stage: rank a's graph holds Send(Remote=b), rank b's holds
Recv(Remote=a), and MPI/NCCL matches the two at run time. Under JAX every rank runs the same
program (SPMD, inside `jax.shard_map` or `pmap`), so a transfer is written once, as a pair:

    handle = ops.send(signal, 1, h, tag=0)                  # rank 1 is the destination
    signal, h_in = ops.recv(signal, 0, tag=0, send=handle)  # rank 0 is the source

or in one call, `ops.send_recv(signal, 0, 1, h)`. The pair is one ppermute of one buffer from
the source rank to the destination rank: the tensors packed back to back as bytes, each at a
256-byte-aligned offset, as ORT's Send packs them. The destination receives the source's
tensors; every other rank receives zeros (what ppermute gives a rank nobody sends to), so a
pipeline stage reads what it received only on the rank that stage runs on (see
docs/p2p.md for a 2-stage pipeline).

Ranks are positions along one mesh axis, the pipeline axis: `PIPELINE_AXIS` ("pipe") unless
`axis_name=` is given or a `with pipeline_axis("stage"): ...` block is open. They must be
known while tracing (Python ints or concrete arrays). Sending to one's own rank is refused,
as ORT refuses it; so is a rank outside the axis.

Signals: ORT requires each input signal to be true and sets the output signal to true once
the transfer is done. Here the output signal is the AND of the two input signals, made after
the received data (an optimization barrier ties them), and the transfer starts only after
both input signals exist, so ORT's ordering holds under XLA. A false signal that is known
while tracing is refused as ORT refuses it; a traced one cannot be checked and passes through.

Gradients: the transfer's VJP is the reverse transfer (destination to source) of the float
tensors' cotangents, also packed into one buffer; integer and bool tensors have none.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxops._src import rules
from jaxops._src.compat import mark_varying, varying_axes
from jaxops._src.spec import REQUIRED, define

PIPELINE_AXIS = "pipe"
_axis = contextvars.ContextVar("jaxops_pipeline_axis", default=None)
_ALIGN = 256  # ORT's Send starts every tensor at a multiple of 256 bytes
_MS = "com.microsoft"
_NO_MATRIX = ("a transfer between ranks of a named mesh axis: it runs only inside "
              "jax.shard_map/pmap with the pipeline axis bound, which the generic matrix does "
              "not set up; tests/test_p2p.py checks it per rank, with grads and vmap there")

# ONNX TensorProto element types that Send/Recv can carry (fixed-size, bitcastable to bytes)
ELEMENT_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32,
                 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32,
                 13: np.uint64, 16: jnp.bfloat16}


@contextlib.contextmanager
def pipeline_axis(name):
    """The mesh axis (or tuple of axes) that Send/Recv ranks index inside the block."""
    token = _axis.set(name)
    try:
        yield
    finally:
        _axis.reset(token)


def _axis_name(axis_name):
    if axis_name is not None:
        return axis_name
    return _axis.get() or PIPELINE_AXIS


@dataclasses.dataclass(frozen=True)
class Send:
    """A Send waiting for its Recv: what `send` returns and `recv(..., send=)` completes."""
    input_signal: jax.Array
    destination: int
    data: tuple
    tag: int
    axis_name: object


def _rank(remote, label):
    """A rank (ORT: an int64 scalar tensor) read on the host: it picks the ppermute's pairs,
    so it must be known while tracing. (Not a `static` input, which is a 1-D int sequence.)"""
    try:
        value = np.asarray(remote)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"{label} must be known while tracing (a Python int or a constant), "
                         "not computed from traced data") from None
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{label} must be one integer (ORT: int64 scalar), got "
                        f"{value.dtype}{list(value.shape)}")
    return int(value.reshape(()))


def _signal(signal, label):
    """ORT's signals: one bool, which must be true where it is known while tracing. (An "any"
    input: converted under jit, a constant would be a tracer and could not be checked.)"""
    rules.flag(label, jnp.asarray(signal))
    try:  # known while tracing (a Python bool, numpy, a constant)?
        known = np.asarray(signal)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if not known.reshape(()):
        raise ValueError(f"{label} is false; ORT requires it true before the transfer runs")


def _check_types(data, element_types, what):
    if element_types is None:
        return
    element_types = list(element_types)
    if len(element_types) != len(data):
        raise ValueError(f"element_types lists {len(element_types)} types for {len(data)} {what}")
    for i, (t, x) in enumerate(zip(element_types, data)):
        if t not in ELEMENT_TYPES:
            raise TypeError(f"element_types[{i}] = {t} is not a type Send/Recv can carry "
                            f"(ONNX types {sorted(ELEMENT_TYPES)})")
        want = jax.dtypes.canonicalize_dtype(ELEMENT_TYPES[t])
        if x.dtype != want:
            raise TypeError(f"element_types[{i}] is {want} but {what} {i} is {x.dtype}")


def _check_data(data):
    if not data:
        raise ValueError("needs at least one tensor to transfer")
    for i, x in enumerate(data):
        if x.dtype not in [jax.dtypes.canonicalize_dtype(t) for t in ELEMENT_TYPES.values()]:
            raise TypeError(f"data[{i}] is {x.dtype}; Send/Recv carry bool, integer and real "
                            "float tensors")


def _send_check(input_signal, remote, *data, tag, element_types, axis_name):
    _check_data(data)
    _check_types(data, element_types, "Data")
    _signal(input_signal, "input_signal")
    _rank(remote, "remote")
    rules.integer("tag", tag)


def _send(input_signal, remote, *data, tag, element_types, axis_name):
    return Send(jnp.asarray(input_signal).reshape(()), _rank(remote, "remote"), data, int(tag),
                _axis_name(axis_name))


send = define(
    "send", ort=(_MS, "Send"), inputs=("input_signal: any", "remote: any", "*data: array"),
    outputs=("OutputSignal",), attrs={"tag": REQUIRED, "element_types": None},
    options={"axis_name": None}, check=_send_check, reference=_send, no_matrix=_NO_MATRIX,
    doc="""ORT Send: `data` goes to rank `remote` of the pipeline axis. Returns a pending `Send`;
    the transfer happens in the `recv` that takes it (`recv(..., send=handle)`), which also
    gives this Send's OutputSignal (see the module docstring). element_types (ONNX type ints,
    ORT's required attribute) is checked against the data when given.""")


def _recv_check(input_signal, remote, *, tag, element_types, send, axis_name):
    if not isinstance(send, Send):
        raise TypeError("under SPMD a Recv completes a Send of the same program: pass "
                        "send=jaxops.ops.send(...) (or use jaxops.ops.send_recv)")
    axis = _axis_name(axis_name)
    if send.tag != rules.integer("tag", tag):
        raise ValueError(f"tag {tag} does not match the Send's tag {send.tag}")
    if send.axis_name != axis:
        raise ValueError(f"axis {axis!r} differs from the Send's {send.axis_name!r}")
    _check_types(send.data, element_types, "sent tensor")
    _signal(input_signal, "input_signal")
    _check_ranks(_rank(remote, "remote"), send.destination, axis)


def _recv(input_signal, remote, *, tag, element_types, send, axis_name):
    return _transfer(jnp.logical_and(send.input_signal, jnp.asarray(input_signal).reshape(())),
                     _rank(remote, "remote"), send.destination, send.data, send.axis_name)


recv = define(
    "recv", ort=(_MS, "Recv"), inputs=("input_signal: any", "remote: any"),
    outputs=("OutputSignal", "Data"), attrs={"tag": REQUIRED, "element_types": None},
    options={"send": None, "axis_name": None}, check=_recv_check, reference=_recv,
    no_matrix=_NO_MATRIX,
    doc="""ORT Recv: (OutputSignal, *Data) received from rank `remote` of the pipeline axis. Under
    SPMD it completes the pending `send` of the same transfer (its tag and axis must match);
    the destination rank receives the data, every other rank zeros. element_types (ONNX type
    ints) is checked against the sent tensors when given.""")


def _send_recv_check(input_signal, source, destination, *data, tag, axis_name):
    _check_data(data)
    _signal(input_signal, "input_signal")
    rules.integer("tag", tag)
    _check_ranks(_rank(source, "source"), _rank(destination, "destination"),
                 _axis_name(axis_name))


def _send_recv(input_signal, source, destination, *data, tag, axis_name):
    return _transfer(jnp.asarray(input_signal).reshape(()), _rank(source, "source"),
                     _rank(destination, "destination"), data, _axis_name(axis_name))


send_recv = define(
    "send_recv", ort=None,
    inputs=("input_signal: any", "source: any", "destination: any", "*data: array"),
    outputs=("OutputSignal", "Data"), attrs={"tag": 0}, options={"axis_name": None},
    check=_send_recv_check, reference=_send_recv, no_matrix=_NO_MATRIX,
    doc="""A Send on rank `source` and its Recv on rank `destination` in one call: returns
    (OutputSignal, *received). The same as `recv(input_signal, source, tag=tag,
    send=send(input_signal, destination, *data, tag=tag))`.""")


def _check_ranks(source, destination, axis):
    try:
        world = lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"mesh axis {axis!r} is not bound; call it inside jax.shard_map (or "
                         "pmap) over a mesh with that axis, or name the pipeline axis with "
                         "axis_name= / jaxops.ops.pipeline_axis") from e
    for what, rank in (("source", source), ("destination", destination)):
        if not 0 <= rank < world:
            raise ValueError(f"{what} rank {rank} is outside the {world} ranks of axis {axis!r}")
    if source == destination:
        raise ValueError(f"rank {source} sends to itself; ORT refuses same-rank Send/Recv")


def _transfer(signal, source, destination, data, axis):
    """The checked transfer (see _check_ranks): one packed ppermute source -> destination."""
    # the transfer starts once the signal exists
    signal, data = lax.optimization_barrier((signal, data))
    axes = {axis} if isinstance(axis, str) else set(axis)
    # every operand typed as varying over the axis, so the custom VJP's cotangents are too
    # (jax's own AD sums an invariant operand's cotangent over the axis)
    data = [mark_varying(x, axes - varying_axes(x)) for x in data]
    received = _move(axis, (source, destination), *data)
    # whatever waits on the output signal waits for the received data
    signal, received = lax.optimization_barrier((signal, tuple(received)))
    return (signal, *received)


def _to_bytes(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).ravel()
    return lax.bitcast_convert_type(x, jnp.uint8).ravel()


def _from_bytes(b, shape, dtype):
    if dtype == jnp.bool_:
        return (b != 0).reshape(shape)
    size = jnp.dtype(dtype).itemsize
    if size > 1:
        b = b.reshape(-1, size)
    return lax.bitcast_convert_type(b, dtype).reshape(shape)


def _packed_ppermute(axis, pair, data):
    """One ppermute of `data` packed into one byte buffer, each tensor 256-byte aligned."""
    pieces, offsets, end = [], [], 0
    for x in data:
        pad = -end % _ALIGN
        if pad:
            pieces.append(jnp.zeros(pad, jnp.uint8))
        offsets.append(end + pad)
        pieces.append(_to_bytes(x))
        end += pad + x.size * x.dtype.itemsize
    buffer = lax.ppermute(jnp.concatenate(pieces), axis, [pair])
    return [_from_bytes(buffer[o:o + x.size * x.dtype.itemsize], x.shape, x.dtype)
            for o, x in zip(offsets, data)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _move(axis, pair, *data):
    return _packed_ppermute(axis, pair, data)


def _move_fwd(axis, pair, *data):
    return _move(axis, pair, *data), None


def _move_bwd(axis, pair, _, cotangents):
    # ppermute's transpose is the reverse permutation; only float tensors carry cotangents
    floats = [i for i, ct in enumerate(cotangents)
              if jnp.issubdtype(ct.dtype, jnp.floating)]
    back = _move(axis, pair[::-1], *[cotangents[i] for i in floats]) if floats else []
    grads = [None] * len(cotangents)
    for i, g in zip(floats, back):
        grads[i] = g
    return tuple(grads)


_move.defvjp(_move_fwd, _move_bwd)


__all__ = ["PIPELINE_AXIS", "Send", "pipeline_axis", "recv", "send", "send_recv"]
