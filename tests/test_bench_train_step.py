"""bench/train_step.py at its quick size on this platform: every implementation trains, and
jaxops (the imported ORT training graphs) and PyTorch eager compute the same steps."""
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/
from bench import train_step  # noqa: E402

TINY = dict(warmup=1, steps=2, burst=2, trials=1)


def test_quick_command_trains_and_reports(tmp_path):
    """`python -m bench.train_step --quick`: finite losses and times for every implementation,
    the same first losses (jaxops' two ways of running the graphs: the same computation, in
    one XLA program or two, which may round differently on a GPU; torch: the first step's
    forward to f32 rounding), a JSON and a table."""
    out = tmp_path / "r.json"
    assert train_step.main(["--quick", "--precision", "f32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    timings = report["results"]["f32"]["timings"]
    names = {"jaxops fused", "jaxops API"} | ({"torch eager"} if _torch() else set())
    if _torch() and jax.default_backend() == "gpu":  # the default adds torch.compile there
        names.add("torch compile")
    assert set(timings) == names
    for name, r in timings.items():
        assert np.all(np.isfinite(r["first_losses"] + [r["last_loss"]])), name
        assert r["step_ms"] > 0 and r["synced_ms"] > 0 and r["dispatch_ms"] > 0, name
    np.testing.assert_allclose(timings["jaxops API"]["first_losses"],
                               timings["jaxops fused"]["first_losses"], rtol=1e-6)
    if _torch():
        np.testing.assert_allclose(timings["jaxops fused"]["first_losses"][0],
                                   timings["torch eager"]["first_losses"][0], rtol=1e-5)
    assert all(a["ok"] for a in report["results"]["f32"]["agreement"].values())
    table = out.with_suffix(".md").read_text()
    assert "| f32 | jaxops fused |" in table and report["config"]["params"] == 118853


def test_torch_steps_match_the_ort_graphs(tmp_path):
    """With AdamW's epsilon negligible (1e-30) ORT's adam_mode 1 and torch's AdamW are the same
    update, so the first steps' losses agree to f32 rounding: the backward pass and the
    optimizer, not only the forward, are the same computation on both sides."""
    if not _torch():
        pytest.skip("no torch that runs beside jax here")
    src, _ = train_step.load_size(quick=True)
    for f in ("training_model.onnx", "config.json"):
        shutil.copy(src / f, tmp_path / f)
    opt = onnx.load(str(src / "optimizer_model.onnx"))
    (node,) = [n for n in opt.graph.node if n.op_type == "AdamWOptimizer"]
    (eps,) = [a for a in node.attribute if a.name == "epsilon"]
    eps.f = 1e-30
    onnx.save(opt, str(tmp_path / "optimizer_model.onnx"))

    report = train_step.run(True, ["f32"], directory=tmp_path, settings=TINY, log=lambda *a: None)
    timings = report["results"]["f32"]["timings"]
    assert report["adamw"]["eps"] == pytest.approx(1e-30)
    losses = {name: r["first_losses"] for name, r in timings.items()}
    assert len(losses["torch eager"]) == train_step.CHECK_STEPS >= 3
    assert len(set(np.round(losses["torch eager"], 4))) == 3  # the steps change the loss
    # 8e-8 apart on CPU; epsilon's placement alone (the real graph) puts them 4e-5 apart
    np.testing.assert_allclose(losses["jaxops fused"], losses["torch eager"], rtol=1e-5)


def test_a_failing_implementation_is_reported_not_fatal(monkeypatch):
    """An implementation that raises (a kernel failing on the GPU, say) gets an ERROR row and
    fails the agreement; the others still run."""
    def boom(self, ids, labels):
        raise RuntimeError("kernel failed")
    monkeypatch.setattr(train_step.JaxAPI, "__call__", boom)
    report = train_step.run(True, ["f32"], impls=["fused", "api"], settings=TINY,
                            log=lambda *a: None)
    block = report["results"]["f32"]
    assert block["timings"]["jaxops API"]["error"] == "RuntimeError: kernel failed"
    assert np.isfinite(block["timings"]["jaxops fused"]["step_ms"])
    assert block["agreement"]["jaxops API"]["ok"] is False
    assert "| jaxops API | ERROR: RuntimeError: kernel failed |" in report["table"]


def test_profile_writes_traces_and_op_tables(tmp_path):
    """--profile: a trace and a per-op table for each implementation (on CPU jax's holds the
    step's XLA ops and jaxops' FFI calls; on a GPU, kernels), torch's its aten ops."""
    report = train_step.run(True, ["f32"], impls=["fused", "torch"], settings=TINY,
                            profile_dir=tmp_path, log=lambda *a: None)
    jax_dir = tmp_path / "f32-jaxops-fused"
    assert report["results"]["f32"]["timings"]["jaxops fused"]["profile"] == str(jax_dir)
    assert list(jax_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
    table = (jax_dir / "ops.txt").read_text().splitlines()
    assert len(table) > 10 and float(table[2].split()[0]) > 0
    if jax.default_backend() == "cpu":
        assert any("jaxops_adamw_optimizer" in row for row in table)
    if _torch():
        torch_dir = tmp_path / "f32-torch-eager"
        assert (torch_dir / "trace.json").stat().st_size > 0
        assert "aten::" in (torch_dir / "ops.txt").read_text()


def _torch():
    """Whether the bench runs torch here (importable, and on CUDA when jax is on a GPU)."""
    return train_step.load_torch()[0] is not None


def test_bf16_rows_track_f32(tmp_path):
    """--precision f32,bf16: the bf16 rows (jaxops with precision="bf16"; torch, where it
    runs, under autocast) train, and their first losses track the f32 run's."""
    out = tmp_path / "r.json"
    assert train_step.main(["--quick", "--precision", "f32,bf16", "--impls", "fused,api",
                            "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    f32 = results["f32"]["timings"]["jaxops fused"]["first_losses"]
    for name in ("jaxops fused", "jaxops API"):
        bf16 = results["bf16"]["timings"][name]["first_losses"]
        np.testing.assert_allclose(bf16, f32, rtol=train_step.TOL["bf16"])
        assert bf16 != f32  # computed in another precision
    assert "| bf16 | jaxops fused |" in out.with_suffix(".md").read_text()


def test_precision_and_size_arguments():
    with pytest.raises(SystemExit):
        train_step.main(["--quick", "--precision", "f16"])
    d, config = train_step.load_size(False, size="124m")
    assert d.name == "transformer_l12_d768_s1024_b8"
