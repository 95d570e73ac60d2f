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

from jaxops._src.compat import mark_varying, varying_axes
from jaxops.ops._args import static_inputs

PIPELINE_AXIS = "pipe"
_axis = contextvars.ContextVar("jaxops_pipeline_axis", default=None)
_ALIGN = 256  # ORT's Send starts every tensor at a multiple of 256 bytes

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


def _static_rank(op, remote, what):
    try:
        value = np.asarray(remote)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"jaxops.ops.{op}: {what} must be known while tracing (a Python int "
                         "or a constant), not computed from traced data") from None
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"jaxops.ops.{op}: {what} must be one integer (ORT: int64 scalar), got "
                        f"{value.dtype}{list(value.shape)}")
    return int(value.reshape(()))


def _signal(op, signal, what):
    try:  # known while tracing (a Python bool, numpy, a constant)?
        known = np.asarray(signal)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        known = None
    signal = jnp.asarray(signal)
    if signal.dtype != jnp.bool_ or signal.size != 1:
        raise TypeError(f"jaxops.ops.{op}: {what} must be one bool, got "
                        f"{signal.dtype}{list(signal.shape)}")
    if known is not None and not known.reshape(()):
        raise ValueError(f"jaxops.ops.{op}: {what} is false; ORT requires it true before the "
                         "transfer runs")
    return signal.reshape(())


def _check_types(op, data, element_types, what):
    if element_types is None:
        return
    element_types = list(element_types)
    if len(element_types) != len(data):
        raise ValueError(f"jaxops.ops.{op}: element_types lists {len(element_types)} types for "
                         f"{len(data)} {what}")
    for i, (t, x) in enumerate(zip(element_types, data)):
        if t not in ELEMENT_TYPES:
            raise TypeError(f"jaxops.ops.{op}: element_types[{i}] = {t} is not a type Send/Recv "
                            f"can carry (ONNX types {sorted(ELEMENT_TYPES)})")
        want = jax.dtypes.canonicalize_dtype(ELEMENT_TYPES[t])
        if x.dtype != want:
            raise TypeError(f"jaxops.ops.{op}: element_types[{i}] is {want} but {what} {i} is "
                            f"{x.dtype}")


def _data(op, data):
    data = tuple(jnp.asarray(x) for x in data)
    if not data:
        raise ValueError(f"jaxops.ops.{op}: needs at least one tensor to transfer")
    for i, x in enumerate(data):
        if x.dtype not in [jax.dtypes.canonicalize_dtype(t) for t in ELEMENT_TYPES.values()]:
            raise TypeError(f"jaxops.ops.{op}: tensor {i} is {x.dtype}; Send/Recv carry bool, "
                            "integer and real float tensors")
    return data


@static_inputs('remote')
def send(input_signal, remote, *data, tag, element_types=None, axis_name=None) -> Send:
    """ORT Send: `data` goes to rank `remote` of the pipeline axis. Returns a pending `Send`;
    the transfer happens in the `recv` that takes it (`recv(..., send=handle)`), which also
    gives this Send's OutputSignal (see the module docstring). element_types (ONNX type ints,
    ORT's required attribute) is checked against the data when given."""
    data = _data("send", data)
    _check_types("send", data, element_types, "Data")
    return Send(_signal("send", input_signal, "InputSignal"),
                _static_rank("send", remote, "Remote"), data, int(tag), _axis_name(axis_name))


@static_inputs('remote')
def recv(input_signal, remote, *, tag, element_types=None, send=None, axis_name=None):
    """ORT Recv: (OutputSignal, *Data) received from rank `remote` of the pipeline axis. Under
    SPMD it completes the pending `send` of the same transfer (its tag and axis must match);
    the destination rank receives the data, every other rank zeros. element_types (ONNX type
    ints) is checked against the sent tensors when given."""
    if not isinstance(send, Send):
        raise TypeError("jaxops.ops.recv: under SPMD a Recv completes a Send of the same "
                         "program: pass send=jaxops.ops.send(...) (or use jaxops.ops.send_recv)")
    axis = _axis_name(axis_name)
    if send.tag != int(tag):
        raise ValueError(f"jaxops.ops.recv: tag {tag} does not match the Send's tag {send.tag}")
    if send.axis_name != axis:
        raise ValueError(f"jaxops.ops.recv: axis {axis!r} differs from the Send's "
                         f"{send.axis_name!r}")
    _check_types("recv", send.data, element_types, "sent tensor")
    signal = _signal("recv", input_signal, "InputSignal")
    source = _static_rank("recv", remote, "Remote")
    return _transfer("recv", jnp.logical_and(send.input_signal, signal), source,
                     send.destination, send.data, axis)


@static_inputs('source', 'destination')
def send_recv(input_signal, source, destination, *data, tag=0, axis_name=None):
    """A Send on rank `source` and its Recv on rank `destination` in one call: returns
    (OutputSignal, *received). The same as `recv(input_signal, source, tag=tag,
    send=send(input_signal, destination, *data, tag=tag))`."""
    data = _data("send_recv", data)
    signal = _signal("send_recv", input_signal, "input_signal")
    return _transfer("send_recv", signal, _static_rank("send_recv", source, "source"),
                     _static_rank("send_recv", destination, "destination"), data,
                     _axis_name(axis_name))


def _transfer(op, signal, source, destination, data, axis):
    try:
        world = lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"jaxops.ops.{op}: mesh axis {axis!r} is not bound; call it inside "
                         "jax.shard_map (or pmap) over a mesh with that axis, or name the "
                         "pipeline axis with axis_name= / jaxops.ops.pipeline_axis") from e
    for what, rank in (("source", source), ("destination", destination)):
        if not 0 <= rank < world:
            raise ValueError(f"jaxops.ops.{op}: {what} rank {rank} is outside the {world} ranks "
                             f"of axis {axis!r}")
    if source == destination:
        raise ValueError(f"jaxops.ops.{op}: rank {source} sends to itself; ORT refuses "
                         "same-rank Send/Recv")
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

ORT_OPS = {
    ("com.microsoft", "Send"): send,
    ("com.microsoft", "Recv"): recv,
}
