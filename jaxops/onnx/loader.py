"""Reading a model safely: parse errors, external data kept inside the model's folder."""
from __future__ import annotations

import os
import stat
from typing import Callable

import onnx

from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.program import Program, subgraphs


def load(model, *, base_dir: str | os.PathLike | None = None,
         python_ops: dict[str, Callable] | None = None, constants=(),
         max_bytes: int | None = None, precision: str | None = None) -> Program:
    """Imports an ONNX model (a path, serialized bytes or a ModelProto) as a `Program`.

    base_dir: the folder that external-data paths are relative to (default: the model file's
      folder, or the working directory for bytes and protos); no path may leave it.
    python_ops: ORT PythonOp nodes name Python code; they are refused unless their
      `func_name` is a key here, whose function then runs as fn(*inputs, **attributes).
    constants: names of float initializers to keep static numpy rather than params (for
      float inputs that must be known while tracing, e.g. Resize's scales).
    max_bytes: the memory budget: every size the model gives (initializer and sparse tensor
      dims, declared shapes, shape inputs and attributes of nodes) is checked against it
      before anything is allocated or traced, per value (dense sparse tensors together); a
      larger one is refused with an OnnxImportError naming the node. Default: half the
      machine's physical memory (`jaxops.onnx.program.default_max_bytes`).
    precision: None (or "f32") computes as the graph declares; "bf16" is mixed precision as
      torch's bf16 autocast does it: matmuls and convolutions in bfloat16 with float32
      accumulation, softmax, normalizations, reductions, losses, gradient accumulation and
      optimizers in float32, the ops between them in the dtype of their activations
      (`jaxops.onnx.precision` has the rule). "f16" (which needs loss scaling) is refused.

    Fails with one `OnnxImportError` listing every unsupported (domain, op_type, version).
    """
    try:
        proto = read_model(model, base_dir=base_dir)
    except MemoryError:  # a file (or its external data) larger than the memory left
        raise OnnxImportError("the model does not fit in memory (MemoryError while reading "
                              "it)") from None
    return Program(proto, python_ops=python_ops, constants=constants, max_bytes=max_bytes,
                   precision=precision)


def read_model(model, *, base_dir=None) -> onnx.ModelProto:
    """The ModelProto with its external data read in (a copy where that changes it)."""
    if isinstance(model, onnx.ModelProto):
        proto = model
        folder = base_dir if base_dir is not None else os.getcwd()
    elif isinstance(model, (bytes, bytearray, memoryview)):
        proto = _parse(bytes(model), "the given bytes")
        folder = base_dir if base_dir is not None else os.getcwd()
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise OnnxImportError(f"cannot read {path!r}: {e}") from None
        proto = _parse(data, repr(path))
        folder = base_dir if base_dir is not None else os.path.dirname(os.path.abspath(path))
    else:
        raise OnnxImportError(f"load() takes a path, bytes or an onnx.ModelProto, got "
                              f"{type(model).__name__}")
    if not proto.HasField("graph"):
        raise OnnxImportError("the model has no graph")
    external = [t for t in _tensors(proto.graph)
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        if proto is model:
            proto = onnx.ModelProto()
            proto.CopyFrom(model)  # the caller's proto stays as it was
            external = [t for t in _tensors(proto.graph)
                        if t.data_location == onnx.TensorProto.EXTERNAL]
        for t in external:
            _read_external(t, os.fspath(folder))
    return proto


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise OnnxImportError(f"{what} is not an ONNX model (protobuf: {e})") from None
    return proto


def _tensors(graph, depth=0):
    """Every TensorProto that can hold data: initializers, Constant/attribute tensors, in
    subgraphs too."""
    if depth > 64:
        raise OnnxImportError("the model's subgraphs nest more than 64 deep")
    yield from graph.initializer
    for s in graph.sparse_initializer:
        yield s.values
        yield s.indices
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
                yield a.sparse_tensor.indices
        for g in subgraphs(node):
            yield from _tensors(g, depth + 1)


def _read_external(t: onnx.TensorProto, folder: str):
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    what = f"initializer {t.name!r}: external data {location!r}"
    if not location:
        raise OnnxImportError(f"initializer {t.name!r}: external data without a location")
    if "\0" in location:  # os.path would raise a bare ValueError ("embedded null byte")
        raise OnnxImportError(f"initializer {t.name!r}: external data location {location!r} "
                              "holds a NUL byte")
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, location))
    if os.path.isabs(location) or os.path.commonpath([root, path]) != root:
        raise OnnxImportError(f"{what} lies outside the model's folder {root!r}: refused")
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise OnnxImportError(f"{what}: offset/length are not integers") from None
    if offset < 0 or (length is not None and length < 0):
        raise OnnxImportError(f"{what}: negative offset or length")
    try:
        # Only regular files: opening a FIFO to read blocks until a writer comes (forever), and
        # a device has no end. O_NONBLOCK makes the open return at once; fstat then tells what
        # was opened (checking before opening would race with the file being swapped).
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OnnxImportError(f"{what} is not a regular file: refused")
            size = st.st_size
            if offset + (length or 0) > size:
                raise OnnxImportError(f"{what}: offset {offset} + length {length} runs past "
                                      f"the end of the file ({size} bytes)")
            with open(fd, "rb", closefd=False) as f:
                f.seek(offset)
                data = f.read() if length is None else f.read(length)
        finally:
            os.close(fd)
    except OSError as e:
        raise OnnxImportError(f"{what}: {e}") from None
    t.raw_data = data
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
