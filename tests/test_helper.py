"""The CPU kernels' helper threads (ffi/include/jaxops/helper.h), in C++: tests/cpp/helper_test.cc
built with the C++ compiler that builds jaxops and run (every unit once over many jobs, after the
helpers slept, up to seven helpers a job, several callers at once, a forked child, one CPU); a
hang fails by the timeout."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cpus", [None, 8], ids=["machine", "8cpus"])
def test_helpers_run_every_unit_once(tmp_path, cpus):
    # cpus: the helpers' count of CPUs made up (JAXOPS_HELPER_CPUS), seven helpers on any machine
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (jaxops' build needs one)")
    exe = tmp_path / "helper_test"
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-pthread",
                    f"-I{ROOT / 'ffi' / 'include'}", str(ROOT / "tests" / "cpp" / "helper_test.cc"),
                    "-o", str(exe)] + [f"-DJAXOPS_HELPER_CPUS={cpus}"] * (cpus is not None),
                   check=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), (run.returncode, run.stdout)
