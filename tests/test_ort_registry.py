"""jaxops.ops.ORT_OPS covers ORT's CUDA training-op registry (tests/data/ort_training_ops.json:
the (domain, op) list of the project's spec, ort-training-ops.json; domain '' is ONNX's)."""
import json
from pathlib import Path

from jaxops import ops

REGISTRY = [tuple(o) for o in json.loads(
    (Path(__file__).parent / "data" / "ort_training_ops.json").read_text())["ops"]]

def test_registry_list_is_the_spec():
    assert len(REGISTRY) == len(set(REGISTRY)) == 89
    assert sum(d == "com.microsoft" for d, _ in REGISTRY) == 86


def test_every_registry_op_is_in_ort_ops():
    missing = [k for k in REGISTRY if k not in ops.ORT_OPS]
    assert not missing, f"not in jaxops.ops.ORT_OPS: {missing}"
    assert all(callable(ops.ORT_OPS[k]) for k in REGISTRY)
