"""bench/allreduce_2gpu.py (written for 2 GPUs) runs its --quick size on forced CPU devices:
every variant's result is checked inside, and the table is printed."""
import math
import re

import jax
import pytest

from bench import allreduce_2gpu


def test_gpt2_small_is_124m_params():
    shapes = allreduce_2gpu.gpt2_shapes()
    assert len(shapes) == 148 and sum(math.prod(s) for s in shapes) == 124_439_808


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="checks the run on forced CPU devices (not under JAX_PLATFORMS=cuda)")
def test_quick_run_prints_every_variant(capsys):
    assert allreduce_2gpu.main(["--quick", "--reps", "2", "--devices", "2"]) == 0
    text = capsys.readouterr().out
    assert "over 2 cpu device(s)" in text
    for variant in ("nccl_all_reduce", "psum_per_tensor", "psum_concat"):
        row = re.search(rf"^{variant}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", text, re.MULTILINE)
        assert row, text
        ops, ms, algbw, busbw = row.groups()
        assert int(ops) >= 1 and float(ms) > 0
        assert abs(float(busbw) - float(algbw)) < 0.02  # 2 devices: 2(n-1)/n = 1


def test_not_a_harness_family():
    assert allreduce_2gpu.cases(True) == [] and allreduce_2gpu.cases(False) == []
