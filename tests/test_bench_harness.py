"""bench/harness.py on this platform: a quick case is checked and timed both ways (one call per
jitted executable, and one call per input set inside one executable), and the input sets
respect the memory cap of the one-executable timing."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/
from bench import harness, softmax  # noqa: E402

MiB = harness.MiB


def test_input_sets_fill_the_cap_and_cover_l2():
    s = harness.Settings.make(False)
    assert harness.n_input_sets(256 * MiB, 64 * MiB, s) == 8  # 8 calls share one executable
    assert harness.n_input_sets(3 * harness.GiB, 64 * MiB, s) == 2  # at least 2
    assert harness.n_input_sets(1 * MiB, 64 * MiB, s) == 16  # 2 x L2, at most 16
    assert harness.n_input_sets(1 * MiB, 64 * MiB, harness.Settings.make(True)) == 2


def test_case_is_checked_and_timed_in_one_executable():
    s = harness.Settings.make(True)
    case = softmax.case("softmax_grad_13", "f32", (64, 256), -1)
    res = harness.run_case(case, s, None, copy_bw=1e10, l2=1 * MiB, log=lambda *a: None)
    rec = res["impls"]["jaxops"]
    assert rec["status"] == "ok" and rec["correct"], rec
    assert rec["in_one_calls"] == res["input_sets"] >= 2
    assert rec["us"] == rec["in_one_us"] > 0 and rec["pipelined_us"] > 0
    assert res["xla"] is not None and res["impls"][res["xla"]]["in_one_us"] > 0
