"""ORT's on-device-training checkpoint format, read and written without ORT.

A checkpoint is one FlatBuffers file (file identifier "ODTC", format version 2 in ORT 1.19)
whose root table holds, in schema field order:

    Checkpoint   version:int32, module_state:ModuleState, optimizer_groups:[OptimizerGroup],
                 property_bag:PropertyBag
    ModuleState  requires_grad_params:[Tensor], frozen_params:[Tensor], is_nominal_state:bool,
                 has_external_data:bool
    OptimizerGroup  group_name:string, step:int64, initial_learning_rate:float,
                    optimizer_states:[ParameterOptimizerState]
    ParameterOptimizerState  param_name:string, momentums:[Tensor]   (AdamW: momentum0/1)
    PropertyBag  ints:[{name, value:int64}], floats:[{name, value:float}],
                 strings:[{name, value:string}]
    Tensor       name, doc_string, dims:[int64], data_type (ONNX TensorProto code),
                 raw_data:[uint8], string_data, external_data_offset:int64 = -1

Only the fields ORT writes for inline tensors are used; a checkpoint whose tensors live in an
external data file is refused with a clear error. Tensors are written in the order given
(ORT's own writer sorts them by name; readers do not depend on it).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import flatbuffers
import numpy as np
from flatbuffers import number_types as nt
from flatbuffers.table import Table
from onnx import helper

FILE_IDENTIFIER = b"ODTC"
VERSION = 2


class CheckpointError(ValueError):
    """A file that is not a readable ORT training checkpoint."""


@dataclasses.dataclass
class OptimizerGroup:
    step: int = 0
    initial_learning_rate: float = 0.0
    # param name -> {momentum name -> array}
    states: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Checkpoint:
    trainable: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    frozen: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    optimizer: dict[str, OptimizerGroup] = dataclasses.field(default_factory=dict)
    properties: dict[str, int | float | str] = dataclasses.field(default_factory=dict)
    nominal: bool = False


# ---------------------------------------------------------------- reading

class _Reader:
    """Field access by schema position over flatbuffers' generic Table."""

    def __init__(self, table: Table):
        self.t = table

    def _offset(self, field):
        return self.t.Offset(4 + 2 * field)

    def scalar(self, field, flags, default):
        o = self._offset(field)
        return self.t.Get(flags, o + self.t.Pos) if o else default

    def string(self, field):
        o = self._offset(field)
        return self.t.String(o + self.t.Pos).decode() if o else ""

    def table(self, field):
        o = self._offset(field)
        return _Reader(Table(self.t.Bytes, self.t.Indirect(o + self.t.Pos))) if o else None

    def tables(self, field):
        o = self._offset(field)
        if not o:
            return []
        start = self.t.Vector(o)
        return [_Reader(Table(self.t.Bytes, self.t.Indirect(start + 4 * i)))
                for i in range(self.t.VectorLen(o))]

    def array(self, field, flags):
        o = self._offset(field)
        return self.t.GetVectorAsNumpy(flags, o) if o else np.zeros(0, np.uint8)


def _tensor(r: _Reader) -> tuple[str, np.ndarray]:
    name = r.string(0)
    if r.scalar(6, nt.Int64Flags, -1) != -1:
        raise CheckpointError(f"tensor {name!r} is stored in external data, which jaxops does not read")
    dims = [int(d) for d in r.array(2, nt.Int64Flags)]
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(r.scalar(3, nt.Int32Flags, 0)))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"tensor {name!r} has an unknown data type") from e
    raw = r.array(4, nt.Uint8Flags).tobytes()
    size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != size:
        raise CheckpointError(f"tensor {name!r}: {len(raw)} bytes for shape {dims} of {dtype}")
    return name, np.frombuffer(raw, dtype).reshape(dims).copy()


def _first_of_each(tensors, taken=()) -> dict[str, np.ndarray]:
    """As ORT 1.19 loads parameters (into a map that keeps a name's first entry, trainable ones
    before frozen ones): a repeated name keeps its first tensor, and a frozen name that is also
    trainable stays trainable only."""
    out = {}
    for name, value in tensors:
        if name not in out and name not in taken:
            out[name] = value
    return out


def parse(data: bytes) -> Checkpoint:
    """A checkpoint from the bytes of an ORT checkpoint file."""
    buf = bytearray(data)
    if len(buf) < 8 or bytes(buf[4:8]) != FILE_IDENTIFIER:
        raise CheckpointError("not an ORT training checkpoint (file identifier is not 'ODTC')")
    try:
        root = _Reader(Table(buf, flatbuffers.encode.Get(nt.UOffsetTFlags.packer_type, buf, 0)))
        version = root.scalar(0, nt.Int32Flags, 0)
        if version > VERSION:
            raise CheckpointError(f"checkpoint format version {version} is newer than {VERSION}")
        ckpt = Checkpoint()
        module = root.table(1)
        if module is not None:
            if module.scalar(3, nt.BoolFlags, False):
                raise CheckpointError("parameters are stored in an external data file, "
                                      "which jaxops does not read")
            ckpt.trainable = _first_of_each(_tensor(t) for t in module.tables(0))
            ckpt.frozen = _first_of_each((_tensor(t) for t in module.tables(1)), ckpt.trainable)
            ckpt.nominal = bool(module.scalar(2, nt.BoolFlags, False))
        for g in root.tables(2):
            states = {s.string(0): dict(_tensor(m) for m in s.tables(1)) for s in g.tables(3)}
            ckpt.optimizer[g.string(0)] = OptimizerGroup(
                int(g.scalar(1, nt.Int64Flags, 0)), float(g.scalar(2, nt.Float32Flags, 0.0)), states)
        bag = root.table(3)
        if bag is not None:
            for field, flags in ((0, nt.Int64Flags), (1, nt.Float32Flags)):
                for p in bag.tables(field):
                    ckpt.properties[p.string(0)] = p.scalar(1, flags, 0)
            for p in bag.tables(2):
                ckpt.properties[p.string(0)] = p.string(1)
        return ckpt
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt buffer fails inside flatbuffers in many ways
        raise CheckpointError(f"corrupt checkpoint: {type(e).__name__}: {e}") from None


def load(path: str | os.PathLike) -> Checkpoint:
    return parse(Path(path).read_bytes())


# ---------------------------------------------------------------- writing

def _table(b: flatbuffers.Builder, fields: list[tuple[str, object]]) -> int:
    """Ends a table whose (kind, value) fields are in schema order; None skips a field."""
    b.StartObject(len(fields))
    for slot, (kind, value) in enumerate(fields):
        if value is None:
            continue
        if kind == "offset":
            b.PrependUOffsetTRelativeSlot(slot, value, 0)
        elif kind == "int32":
            b.PrependInt32Slot(slot, value, 0)
        elif kind == "int64":
            b.PrependInt64Slot(slot, value, 0)
        elif kind == "float":
            b.PrependFloat32Slot(slot, value, 0.0)
        elif kind == "bool":
            b.PrependBoolSlot(slot, value, False)
    return b.EndObject()


def _offsets(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for o in reversed(offsets):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _write_tensor(b, name, array) -> int:
    array = np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-D)
    code = helper.np_dtype_to_tensor_dtype(array.dtype)
    name_off = b.CreateString(name)
    dims = b.CreateNumpyVector(np.asarray(array.shape, np.int64))
    raw = b.CreateNumpyVector(np.frombuffer(array.tobytes(), np.uint8))
    return _table(b, [("offset", name_off), ("offset", None), ("offset", dims), ("int32", code),
                      ("offset", raw), ("offset", None), ("int64", None)])


def _write_tensors(b, tensors: dict[str, np.ndarray]) -> int:
    return _offsets(b, [_write_tensor(b, k, np.asarray(v)) for k, v in tensors.items()])


def serialize(ckpt: Checkpoint) -> bytes:
    b = flatbuffers.Builder(1024)
    trainable = _write_tensors(b, ckpt.trainable)
    frozen = _write_tensors(b, ckpt.frozen)
    module = _table(b, [("offset", trainable), ("offset", frozen),
                        ("bool", ckpt.nominal or None), ("bool", None)])
    groups = []
    for name, group in ckpt.optimizer.items():
        states = [_table(b, [("offset", b.CreateString(p)), ("offset", _write_tensors(b, m))])
                  for p, m in group.states.items()]
        states_off = _offsets(b, states)
        groups.append(_table(b, [("offset", b.CreateString(name)), ("int64", int(group.step)),
                                 ("float", float(group.initial_learning_rate)),
                                 ("offset", states_off)]))
    groups_off = _offsets(b, groups)
    bag = None
    if ckpt.properties:
        kinds = {int: [], float: [], str: []}
        for k, v in ckpt.properties.items():
            kind = str if isinstance(v, str) else float if isinstance(v, float) else int
            if kind is int and not isinstance(v, (int, np.integer)):
                raise TypeError(f"property {k!r} must be an int, float or str, got {type(v)}")
            value = b.CreateString(v) if kind is str else v
            field = {int: "int64", float: "float", str: "offset"}[kind]
            kinds[kind].append(_table(b, [("offset", b.CreateString(k)), (field, value)]))
        vectors = [_offsets(b, kinds[k]) if kinds[k] else None for k in (int, float, str)]
        bag = _table(b, [("offset", v) for v in vectors])
    root = _table(b, [("int32", VERSION), ("offset", module), ("offset", groups_off),
                      ("offset", bag)])
    b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def save(ckpt: Checkpoint, path: str | os.PathLike) -> None:
    Path(path).write_bytes(serialize(ckpt))
