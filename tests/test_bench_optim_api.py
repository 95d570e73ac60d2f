"""bench/optim_api.py runs end to end (GPT-2 tiny on the CPU) and times every path."""
import pytest

pytest.importorskip("optax")


def test_optim_api_bench_quick(capsys):
    from bench import optim_api
    rows = optim_api.main(["--quick"])
    assert {"optax.adamw update + apply_updates", "jaxops.optim.adamw .step",
            "ORT-API Optimizer.step()"} <= set(rows)
    assert set(rows["ORT-API Optimizer.step()"]) == {
        "per call", "loop", "per call, by name (before packing)"}
    for modes in rows.values():
        assert all(0 < s < 10 for s in modes.values())
    assert "| ORT-API Optimizer.step() | per call |" in capsys.readouterr().out
