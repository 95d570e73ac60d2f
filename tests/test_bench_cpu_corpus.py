"""bench/cpu_corpus.py's report: its rows as a markdown table that `python -m bench.all`
gathers (bench/all.py keeps only markdown tables of a part's output)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/
from bench import all as bench_all  # noqa: E402
from bench import cpu_corpus  # noqa: E402


def test_rows_become_a_table_that_bench_all_keeps():
    rows = [{"model": "gpt2_ts", "threads": 1,
             "train": [[0.002, 0.001], [1.0, 0.98], [0.003, 0.001]],
             "forward": [[0.0005, 0.001], [1.0, 1.0]]},  # (a row of before the first column)
            {"model": "bad_ts", "threads": "all", "error": "ValueError: x"}]
    text = "gpt2_ts   1  train   2.00  1.00\n\n" + cpu_corpus.markdown(rows)
    kept = bench_all._tables(text)
    assert "| gpt2_ts | 1 | train | 2.00 | 1.00 | 2.00 | 1.00 0.98 | 3.00 |" in kept
    assert "| gpt2_ts | 1 | forward | 0.50 | 1.00 | 0.50 | 1.00 1.00 | 0.50 |" in kept
    assert "| bad_ts | all | error: ValueError: x |" in kept
    assert "gpt2_ts   1  train" not in kept  # the fixed-width lines are not tables


def test_ort_module_goes_before_its_checkpoint_state(monkeypatch):
    """ORT's pybind Module/Optimizer hold a raw pointer to their CheckpointState and ~Module
    writes through it: _trained must release them before the state. Freed the other way round
    (Python clears a returning frame's locals before the closures' cells), that write landed in
    freed memory, and glibc aborted ("corrupted size vs. prev_size") in A/B scripts built the
    same way with jax in the process. Fakes for both libraries record the order."""
    import types

    import jaxops.onnx.training as training
    freed = []

    class Tracked:
        def __init__(self, kind, *args):
            self.kind = kind

        def __del__(self):
            freed.append(self.kind)

        def __getattr__(self, name):  # train_step, optimizer_step, set_learning_rate, ...
            return lambda *a, **k: None

    class Device:
        cpu = default_memory = staticmethod(lambda: 0)

        def __init__(self, *args):
            pass

    ort = types.SimpleNamespace(
        OrtDevice=Device, SessionOptions=lambda: None, OrtValueVector=list,
        load_checkpoint=lambda path: Tracked("state"),
        Module=lambda *a: Tracked("module"), Optimizer=lambda *a: Tracked("optimizer"))

    class Ours:  # jaxops' side: a no-op Module, Optimizer and state
        def __init__(self, *args):
            pass

        def __call__(self, *inputs):
            return None

        load_checkpoint = staticmethod(lambda path: Ours())
        block_until_ready = set_learning_rate = step = lazy_reset_grad = eval = __call__
        input_names = staticmethod(lambda: [])

    for name in ("CheckpointState", "Module", "Optimizer"):
        monkeypatch.setattr(training, name, Ours)
    row = cpu_corpus._trained("gpt2_ts", "all", 1, ort)
    assert set(row) == {"train", "forward"}
    assert sorted(freed) == ["module", "optimizer", "state"]
    assert freed.index("state") > max(freed.index("module"), freed.index("optimizer"))


def test_each_side_runs_loops_of_its_own_on_idle_threads(monkeypatch):
    """_timed: each side's timed calls come in loops of `block`, each loop after _settle (ORT's
    spinning threads took a core from a jaxops call timed right after ORT's) and an untimed call
    of the same side; the loop's first timed call is reported apart, the others' median as the
    call's time."""
    calls, now, in_loop = [], [0.0], [0]

    def settle():
        calls.append("settle")
        in_loop[0] = 0

    def side(name, first, rest):  # a fake call: its loop's first timed call takes `first` s
        def fn():
            calls.append(name)
            in_loop[0] += 1  # 1: the untimed call
            now[0] += first if in_loop[0] == 2 else rest
        return fn
    monkeypatch.setattr(cpu_corpus, "_settle", settle)
    monkeypatch.setattr(cpu_corpus.time, "perf_counter", lambda: now[0])
    times, cpu, first = cpu_corpus._timed([side("a", 5.0, 1.0), side("b", 2.0, 3.0)], 2, block=3)
    assert calls == ["settle", "a", "a", "a", "a", "settle", "b", "b", "b", "b"] * 2
    assert times == [1.0, 3.0] and first == [5.0, 2.0] and len(cpu) == 2


def _cpu_clock(monkeypatch, busy_windows):
    """Fakes the process's CPU clock seen by _settle: each 5 ms window shows 5 ms of CPU
    until busy_windows have passed, then none (a real spinning thread is not scheduled
    reliably on a loaded 2-core CI machine: it failed there once)."""
    reads, used = [], [0.0]

    def process_time():  # read twice a window: at its start and at its end
        reads.append(None)
        if len(reads) % 2 == 0 and len(reads) // 2 <= busy_windows:
            used[0] += 0.005
        return used[0]
    monkeypatch.setattr(cpu_corpus.time, "process_time", process_time)
    return reads


def test_settle_waits_while_threads_use_the_cpu(monkeypatch):
    reads = _cpu_clock(monkeypatch, busy_windows=4)
    cpu_corpus._settle()
    assert len(reads) == 2 * 5  # four busy windows, returned after the first quiet one


def test_settle_returns_at_once_when_idle_and_gives_up_at_its_limit(monkeypatch):
    import time
    reads = _cpu_clock(monkeypatch, busy_windows=0)
    cpu_corpus._settle()
    assert len(reads) == 2
    _cpu_clock(monkeypatch, busy_windows=10**6)
    t0 = time.perf_counter()
    cpu_corpus._settle(limit=0.05)
    assert 0.05 <= time.perf_counter() - t0 < 0.5  # always busy: waits its limit, no more
