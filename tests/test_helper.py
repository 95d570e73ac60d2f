"""The CPU kernels' helper thread (ffi/include/jaxops/helper.h), in C++: tests/cpp/helper_test.cc
built with the C++ compiler that builds jaxops and run (every unit once over many jobs, after the
helper slept, several callers at once, a forked child, one CPU); a hang fails by the timeout."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_helper_runs_every_unit_once(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (jaxops' build needs one)")
    exe = tmp_path / "helper_test"
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-pthread",
                    f"-I{ROOT / 'ffi' / 'include'}", str(ROOT / "tests" / "cpp" / "helper_test.cc"),
                    "-o", str(exe)], check=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), (run.returncode, run.stdout)
