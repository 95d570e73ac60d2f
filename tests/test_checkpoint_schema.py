"""The checkpoint schema that jaxops reads and writes by, against ORT's own generated bindings."""
import importlib.util
import re
from pathlib import Path

import flatbuffers
import pytest

from jaxops.onnx import checkpoint as C


def _bindings() -> Path:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None:
        pytest.skip("onnxruntime is not installed")
    path = Path(spec.origin).parent / "tools/ort_format_model/ort_flatbuffers_py/fbs"
    if not (path / "Checkpoint.py").exists():
        pytest.skip("this onnxruntime does not ship the checkpoint's FlatBuffers bindings")
    return path


def _camel(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


@pytest.mark.ort
@pytest.mark.parametrize("table", sorted(C.SCHEMA))
def test_schema_matches_ort_bindings(table):
    """Every field's slot, kind and default as flatc generated them from ORT's .fbs files; no
    field of ORT's tables is missing."""
    source = (_bindings() / f"{table}.py").read_text()
    assert f"def {table}Start(builder):\n    builder.StartObject({len(C.FIELDS[table])})" in source
    for name, field in C.FIELDS[table].items():
        m = re.search(rf"def {table}Add{_camel(name)}\(builder, \w+\):\n"
                      rf"    builder\.Prepend(\w+)Slot\((\d+), .*, (-?[\d.]+)\)", source)
        assert m, f"{table}.{name} is not in ORT's bindings"
        kind, slot, default = m.groups()
        assert int(slot) == field.slot, name
        if field.type in ("bool", "int32", "int64", "float"):
            assert kind == {"bool": "Bool", "int32": "Int32", "int64": "Int64",
                            "float": "Float32"}[field.type], name
            assert float(default) == field.default, name
        else:
            assert kind == "UOffsetTRelative", name


def test_named_writer_refuses_unknown_fields():
    with pytest.raises(KeyError, match="no fields"):
        C._write(flatbuffers.Builder(64), "Tensor", nme=0)


def test_absent_float_property_reads_as_float():
    """A float property equal to the schema default (0.0) is not stored; it reads back a float."""
    back = C.parse(C.serialize(C.Checkpoint(properties={"loss": 0.0, "epoch": 0})))
    assert back.properties == {"loss": 0.0, "epoch": 0}
    assert type(back.properties["loss"]) is float and type(back.properties["epoch"]) is int
