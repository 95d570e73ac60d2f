"""ORT's checkpoint format: read ORT's files, write files ORT reads, reject bad bytes."""
from pathlib import Path

import flatbuffers
import ml_dtypes
import numpy as np
import pytest

from jaxops.onnx import checkpoint as C

DATA = Path(__file__).parent / "data"
FILES = sorted(DATA.glob("*/checkpoint*"))


def _same(a: C.Checkpoint, b: C.Checkpoint):
    for x, y in ((a.trainable, b.trainable), (a.frozen, b.frozen)):
        assert list(x) == list(y)
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), k
    assert a.optimizer.keys() == b.optimizer.keys()
    for g in a.optimizer:
        ga, gb = a.optimizer[g], b.optimizer[g]
        assert (ga.step, ga.initial_learning_rate) == (gb.step, gb.initial_learning_rate)
        assert ga.states.keys() == gb.states.keys()
        for p in ga.states:
            assert ga.states[p].keys() == gb.states[p].keys()
            for k in ga.states[p]:
                assert np.array_equal(ga.states[p][k], gb.states[p][k])
    assert a.properties == b.properties
    assert a.nominal == b.nominal


def test_fixtures_exist():
    assert {p.parent.name for p in FILES} == {"mlp", "cnn", "transformer"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reads_ort_files_and_round_trips(path):
    ckpt = C.load(path)
    assert ckpt.trainable and all(v.dtype == np.float32 for v in ckpt.trainable.values())
    if path.name == "checkpoint_after":  # saved by ORT after 20 AdamW steps
        group = ckpt.optimizer["group0"]
        assert group.step == 20
        assert group.states.keys() == ckpt.trainable.keys()
        for name, moments in group.states.items():
            assert set(moments) == {"momentum0", "momentum1"}
            assert moments["momentum0"].shape == ckpt.trainable[name].shape
            assert np.all(moments["momentum1"] >= 0)  # second moments
    _same(ckpt, C.parse(C.serialize(ckpt)))


def test_properties_and_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    ckpt = C.Checkpoint(
        trainable={"w": rng.standard_normal((3, 4)).astype(np.float32),
                   "h": rng.standard_normal(5).astype(np.float16),
                   "b": rng.standard_normal(2).astype(ml_dtypes.bfloat16)},
        frozen={"steps": np.arange(6, dtype=np.int64).reshape(2, 3),
                "scalar": np.array(2.5, np.float64)},
        optimizer={"group0": C.OptimizerGroup(7, 0.25, {"w": {"momentum0": np.ones((3, 4), np.float32)}})},
        properties={"epoch": 3, "zero": 0, "best": -1.5, "tag": "run α"})
    C.save(ckpt, tmp_path / "c")
    back = C.load(tmp_path / "c")
    _same(ckpt, back)
    assert isinstance(back.properties["epoch"], int) and isinstance(back.properties["tag"], str)


@pytest.mark.parametrize("data, message", [
    (b"", "ODTC"), (b"\x00" * 64, "ODTC"), (b"12345678", "ODTC"),
])
def test_rejects_non_checkpoints(data, message):
    with pytest.raises(C.CheckpointError, match=message):
        C.parse(data)


def test_corrupt_bytes_never_crash():
    """Truncations and byte flips of a real file raise CheckpointError or parse; nothing else."""
    good = (DATA / "mlp" / "checkpoint_after").read_bytes()
    rng = np.random.default_rng(1)
    mutants = [good[:n] for n in (8, 12, 100, len(good) // 2, len(good) - 1)]
    for _ in range(200):
        b = bytearray(good)
        for i in rng.integers(8, len(b), rng.integers(1, 8)):
            b[i] = rng.integers(0, 256)
        mutants.append(bytes(b))
    outcomes = set()
    for m in mutants:
        try:
            C.parse(m)
            outcomes.add("parsed")
        except C.CheckpointError:
            outcomes.add("error")
    assert "error" in outcomes


def test_external_data_refused():
    """A checkpoint whose ModuleState says its tensors live in an external file."""
    b = flatbuffers.Builder(64)
    empty = C._offsets(b, [])
    module = C._table(b, [("offset", empty), ("offset", empty), ("bool", None), ("bool", True)])
    root = C._table(b, [("int32", C.VERSION), ("offset", module), ("offset", None), ("offset", None)])
    b.Finish(root, file_identifier=C.FILE_IDENTIFIER)
    with pytest.raises(C.CheckpointError, match="external data"):
        C.parse(bytes(b.Output()))


@pytest.fixture(scope="module")
def ort():
    """ORT's training bindings (the pybind layer: onnxruntime.training.api imports torch)."""
    capi = pytest.importorskip("onnxruntime.capi._pybind_state")
    if not hasattr(capi, "load_checkpoint"):
        pytest.skip("onnxruntime without training support")
    return capi


@pytest.mark.ort
def test_ort_reads_jaxops_checkpoint(ort, tmp_path):
    ckpt = C.load(DATA / "cnn" / "checkpoint_after")
    rng = np.random.default_rng(2)
    ckpt.trainable = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in ckpt.trainable.items()}
    ckpt.properties = {"epoch": 4, "best": 0.5, "tag": "jaxops"}
    C.save(ckpt, tmp_path / "ours")
    state = ort.load_checkpoint(str(tmp_path / "ours"))
    for k, v in ckpt.trainable.items():
        assert np.array_equal(state.get_parameter(k).data.numpy(), v), k
    assert state.get_property("epoch") == 4 and state.get_property("tag") == "jaxops"
    assert state.get_property("best") == pytest.approx(0.5)
    # and what ORT writes back (optimizer state included) reads here unchanged
    ort.save_checkpoint(state, str(tmp_path / "theirs"), True)
    back = C.load(tmp_path / "theirs")
    _same(ckpt, back)


def _module_bytes(trainable, frozen):
    """A checkpoint whose parameter lists are given as (name, array) pairs, repeats allowed."""
    b = flatbuffers.Builder(1024)
    lists = [C._offsets(b, [C._write_tensor(b, k, v) for k, v in pairs])
             for pairs in (trainable, frozen)]
    module = C._table(b, [("offset", lists[0]), ("offset", lists[1]), ("bool", None),
                          ("bool", None)])
    root = C._table(b, [("int32", C.VERSION), ("offset", module), ("offset", None),
                        ("offset", None)])
    b.Finish(root, file_identifier=C.FILE_IDENTIFIER)
    return bytes(b.Output())


def _full(v):
    return np.full(2, v, np.float32)


# (trainable, frozen) -> what ORT 1.19.2 loads: a name's first entry, trainable before frozen
REPEATS = [
    (([("w", _full(1))], [("w", _full(2))]), ({"w": 1}, {})),
    (([("w", _full(1)), ("w", _full(2))], []), ({"w": 1}, {})),
    (([], [("z", _full(3)), ("z", _full(4))]), ({}, {"z": 3})),
    (([("a", _full(5)), ("w", _full(1))], [("w", _full(2)), ("z", _full(3))]),
     ({"a": 5, "w": 1}, {"z": 3})),
]


@pytest.mark.parametrize("lists, want", REPEATS)
def test_repeated_parameter_names_follow_ort(lists, want):
    """A name both trainable and frozen stays trainable (ORT keeps a name's first entry); a
    name repeated within a list keeps its first tensor."""
    ckpt = C.parse(_module_bytes(*lists))
    got = tuple({k: float(v[0]) for k, v in d.items()} for d in (ckpt.trainable, ckpt.frozen))
    assert got == want


@pytest.mark.ort
@pytest.mark.parametrize("lists, want", REPEATS)
def test_repeated_parameter_names_as_ort_loads_them(ort, tmp_path, lists, want):
    (tmp_path / "ckpt").write_bytes(_module_bytes(*lists))
    state = ort.load_checkpoint(str(tmp_path / "ckpt"))
    got = ({}, {})
    for name in state.parameter_names():
        p = state.get_parameter(name)
        got[0 if p.requires_grad else 1][name] = float(p.data.numpy()[0])
    assert got == want
