"""bench/cpu_corpus.py's report: its rows as a markdown table that `python -m bench.all`
gathers (bench/all.py keeps only markdown tables of a part's output)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's bench/
from bench import all as bench_all  # noqa: E402
from bench import cpu_corpus  # noqa: E402


def test_rows_become_a_table_that_bench_all_keeps():
    rows = [{"model": "gpt2_ts", "threads": 1, "train": [[0.002, 0.001], [1.0, 0.98]],
             "forward": [[0.0005, 0.001], [1.0, 1.0]]},
            {"model": "bad_ts", "threads": "all", "error": "ValueError: x"}]
    text = "gpt2_ts   1  train   2.00  1.00\n\n" + cpu_corpus.markdown(rows)
    kept = bench_all._tables(text)
    assert "| gpt2_ts | 1 | train | 2.00 | 1.00 | 2.00 | 1.00 0.98 |" in kept
    assert "| gpt2_ts | 1 | forward | 0.50 | 1.00 | 0.50 |" in kept
    assert "| bad_ts | all | error: ValueError: x |" in kept
    assert "gpt2_ts   1  train" not in kept  # the fixed-width lines are not tables
