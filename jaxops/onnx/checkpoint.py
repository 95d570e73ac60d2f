"""ORT's on-device-training checkpoint format, read and written without ORT.

A checkpoint is one FlatBuffers file (file identifier "ODTC", format version 2 in ORT 1.19)
whose root table is a Checkpoint; `SCHEMA` below names every table's fields, as ORT's
ort_training_checkpoint.fbs (and ort.fbs for Tensor) declare them, and both the reader and the
writer take the fields' slots from it.

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

# Each table's fields in declaration order (a field's slot is its position), as "name:type",
# type a scalar (default 0, or "=value"), "string", a table or a vector "[type]". From
# ort_training_checkpoint.fbs; Tensor from ort.fbs. A table may gain fields at its end only.
SCHEMA = {
    "Checkpoint": "version:int32 module_state:ModuleState optimizer_groups:[OptimizerGroup] "
                  "property_bag:PropertyBag",
    "ModuleState": "requires_grad_params:[Tensor] frozen_params:[Tensor] is_nominal_state:bool "
                   "has_external_data:bool",
    "OptimizerGroup": "group_name:string step:int64 initial_learning_rate:float "
                      "optimizer_states:[ParameterOptimizerState]",
    "ParameterOptimizerState": "param_name:string momentums:[Tensor]",  # AdamW: momentum0/1
    "PropertyBag": "ints:[IntProperty] floats:[FloatProperty] strings:[StringProperty]",
    "IntProperty": "name:string value:int64",
    "FloatProperty": "name:string value:float",
    "StringProperty": "name:string value:string",
    "Tensor": "name:string doc_string:string dims:[int64] data_type:int32 raw_data:[uint8] "
              "string_data:[string] external_data_offset:int64=-1",  # data_type: ONNX's code
}

# scalar types -> flatbuffers number types
_SCALARS = {"bool": nt.BoolFlags, "uint8": nt.Uint8Flags, "int32": nt.Int32Flags,
            "int64": nt.Int64Flags, "float": nt.Float32Flags}


@dataclasses.dataclass(frozen=True)
class _Field:
    slot: int
    type: str
    default: int | float | bool | None  # a scalar's default; None for the others


def _fields(spec: str) -> dict[str, _Field]:
    out = {}
    for slot, field in enumerate(spec.split()):
        name, type_ = field.split(":")
        type_, _, default = type_.partition("=")
        cast = {"bool": bool, "float": float}.get(type_, int) if type_ in _SCALARS else None
        out[name] = _Field(slot, type_, cast(default or 0) if cast else None)
    return out


FIELDS = {table: _fields(spec) for table, spec in SCHEMA.items()}


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
    """One table of the schema over flatbuffers' generic Table: `r["field"]` is the field's
    value (a scalar, a str, a _Reader, a list of them or a numpy vector), or its default when
    absent (None for a table, empty for a string or vector)."""

    def __init__(self, table: Table, kind: str):
        self.t, self.kind = table, kind

    def __getitem__(self, name):
        field = FIELDS[self.kind][name]
        o = self.t.Offset(4 + 2 * field.slot)
        type_ = field.type
        if type_ in _SCALARS:
            return self.t.Get(_SCALARS[type_], o + self.t.Pos) if o else field.default
        if type_ == "string":
            return self.t.String(o + self.t.Pos).decode() if o else ""
        if type_ in FIELDS:
            return self._table_at(o + self.t.Pos, type_) if o else None
        item = type_.strip("[]")
        if item in _SCALARS:
            return self.t.GetVectorAsNumpy(_SCALARS[item], o) if o else np.zeros(0, np.uint8)
        if item in FIELDS:
            if not o:
                return []
            start = self.t.Vector(o)
            return [self._table_at(start + 4 * i, item) for i in range(self.t.VectorLen(o))]
        raise NotImplementedError(f"{self.kind}.{name}: {type_} is not read")

    def _table_at(self, pos, kind):  # the table an offset at pos points to
        return _Reader(Table(self.t.Bytes, self.t.Indirect(pos)), kind)


def _tensor(r: _Reader) -> tuple[str, np.ndarray]:
    name = r["name"]
    if r["external_data_offset"] != -1:
        raise CheckpointError(f"tensor {name!r} is stored in external data, "
                              "which jaxops does not read")
    dims = [int(d) for d in r["dims"]]
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(r["data_type"]))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"tensor {name!r} has an unknown data type") from e
    raw = r["raw_data"].tobytes()
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
        root = _Reader(Table(buf, flatbuffers.encode.Get(nt.UOffsetTFlags.packer_type, buf, 0)),
                       "Checkpoint")
        version = root["version"]
        if version > VERSION:
            raise CheckpointError(f"checkpoint format version {version} is newer than {VERSION}")
        ckpt = Checkpoint()
        module = root["module_state"]
        if module is not None:
            if module["has_external_data"]:
                raise CheckpointError("parameters are stored in an external data file, "
                                      "which jaxops does not read")
            ckpt.trainable = _first_of_each(_tensor(t) for t in module["requires_grad_params"])
            ckpt.frozen = _first_of_each((_tensor(t) for t in module["frozen_params"]),
                                         ckpt.trainable)
            ckpt.nominal = bool(module["is_nominal_state"])
        for g in root["optimizer_groups"]:
            states = {s["param_name"]: dict(_tensor(m) for m in s["momentums"])
                      for s in g["optimizer_states"]}
            ckpt.optimizer[g["group_name"]] = OptimizerGroup(
                int(g["step"]), float(g["initial_learning_rate"]), states)
        bag = root["property_bag"]
        if bag is not None:
            for kind in ("ints", "floats", "strings"):
                for p in bag[kind]:
                    ckpt.properties[p["name"]] = p["value"]
        return ckpt
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt buffer fails inside flatbuffers in many ways
        raise CheckpointError(f"corrupt checkpoint: {type(e).__name__}: {e}") from None


def load(path: str | os.PathLike) -> Checkpoint:
    return parse(Path(path).read_bytes())


# ---------------------------------------------------------------- writing

def _table(b: flatbuffers.Builder, slots: list[tuple]) -> int:
    """Ends a table from its fields in slot order, each (kind, value) or (kind, value, default),
    kind "offset" or a scalar type; a None value is not written, nor a scalar equal to its
    default (0 unless given)."""
    b.StartObject(len(slots))
    for slot, (kind, value, *default) in enumerate(slots):
        if value is None:
            continue
        if kind == "offset":
            b.PrependUOffsetTRelativeSlot(slot, value, 0)
        else:
            b.PrependSlot(_SCALARS[kind], slot, value, default[0] if default else 0)
    return b.EndObject()


def _write(b: flatbuffers.Builder, table: str, **values) -> int:
    """Ends one of the schema's tables from its fields by name: scalars, or the offsets of
    strings, vectors and tables made before it; fields not given are not written."""
    fields = FIELDS[table]
    if unknown := values.keys() - fields.keys():
        raise KeyError(f"{table} has no fields {sorted(unknown)}")
    return _table(b, [(f.type if f.type in _SCALARS else "offset", values.get(name), f.default)
                      for name, f in fields.items()])


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
    return _write(b, "Tensor", name=name_off, dims=dims, data_type=code, raw_data=raw)


def _write_tensors(b, tensors: dict[str, np.ndarray]) -> int:
    return _offsets(b, [_write_tensor(b, k, np.asarray(v)) for k, v in tensors.items()])


def serialize(ckpt: Checkpoint) -> bytes:
    b = flatbuffers.Builder(1024)
    trainable = _write_tensors(b, ckpt.trainable)
    frozen = _write_tensors(b, ckpt.frozen)
    module = _write(b, "ModuleState", requires_grad_params=trainable, frozen_params=frozen,
                    is_nominal_state=ckpt.nominal)
    groups = []
    for name, group in ckpt.optimizer.items():
        states = [_write(b, "ParameterOptimizerState", param_name=b.CreateString(p),
                         momentums=_write_tensors(b, m))
                  for p, m in group.states.items()]
        states_off = _offsets(b, states)
        groups.append(_write(b, "OptimizerGroup", group_name=b.CreateString(name),
                             step=int(group.step),
                             initial_learning_rate=float(group.initial_learning_rate),
                             optimizer_states=states_off))
    groups_off = _offsets(b, groups)
    bag = None
    if ckpt.properties:
        lists = {"ints": [], "floats": [], "strings": []}
        for k, v in ckpt.properties.items():
            kind = "strings" if isinstance(v, str) else "floats" if isinstance(v, float) else "ints"
            if kind == "ints" and not isinstance(v, (int, np.integer)):
                raise TypeError(f"property {k!r} must be an int, float or str, got {type(v)}")
            value = b.CreateString(v) if kind == "strings" else v
            table = FIELDS["PropertyBag"][kind].type.strip("[]")  # IntProperty, ...
            lists[kind].append(_write(b, table, name=b.CreateString(k), value=value))
        bag = _write(b, "PropertyBag", **{k: _offsets(b, v) for k, v in lists.items() if v})
    root = _write(b, "Checkpoint", version=VERSION, module_state=module,
                  optimizer_groups=groups_off, property_bag=bag)
    b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def save(ckpt: Checkpoint, path: str | os.PathLike) -> None:
    Path(path).write_bytes(serialize(ckpt))
