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


def test_bench_all_gathers_the_tables(tmp_path):
    from bench import all as bench_all
    out = tmp_path / "all.md"
    assert bench_all.main(["--parts", "optim_api", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "### optim_api, " in text and "| ORT-API Optimizer.step() | loop |" in text
    assert "commit " in text


def test_bench_all_refuses_unknown_parts():
    from bench import all as bench_all
    with pytest.raises(SystemExit):
        bench_all.main(["--parts", "kernels,nope"])
