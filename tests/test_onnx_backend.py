"""The ONNX node test suite (onnx.backend.test, generated in memory) through jaxops.onnx.backend.

Every node case on CPU runs eagerly; the cases listed in onnx_backend_xfail.txt must fail and
every other case must pass (a listed case that passes fails too: take it off the list). The
pass count is printed at the end. JAXOPS_ONNX_XFAIL_WRITE=PATH writes the list of the cases
that failed in this run, with the first line of each error, to PATH: the way to regenerate the
committed list (then edit reasons where the error alone does not explain the failure).
"""
import os
import unittest
import warnings
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")
if tuple(int(v) for v in onnx.__version__.split(".")[:2]) < (1, 23):
    pytest.skip("the in-memory node suite needs onnx >= 1.23", allow_module_level=True)

import onnx.backend.test  # noqa: E402

from jaxops.onnx import backend  # noqa: E402

XFAIL_FILE = Path(__file__).with_name("onnx_backend_xfail.txt")


def read_xfails(path=XFAIL_FILE) -> tuple[str, dict[str, str]]:
    """(the onnx version the list was made with, {name: reason}) from a first line
    `# onnx VERSION` and lines `test_name  # reason`."""
    version, out = "", {}
    for line in path.read_text().splitlines():
        if line.startswith("# onnx "):
            version = line.split()[2].rstrip(":")
        name, _, reason = line.partition("#")
        if name.strip():
            out[name.strip()] = reason.strip()
    return version, out


# kept out of module globals, where pytest would collect the unittest class itself
with warnings.catch_warnings():  # the case generators divide by zero on purpose
    warnings.simplefilter("ignore")
    _SUITE = {"cases": onnx.backend.test.BackendTest(backend.JaxopsBackend, __name__)
              .test_cases["OnnxBackendNodeModelTest"]}
NAMES = sorted(n for n in dir(_SUITE["cases"]) if n.startswith("test_") and n.endswith("_cpu"))
LIST_VERSION, XFAILS = read_xfails()
# The list is exact for the onnx it was made with; under another onnx (other cases, other
# expectations) a failure outside the list is reported as an expected failure, not an error.
EXACT = LIST_VERSION == onnx.__version__
RESULTS = {"pass": [], "fail": {}, "skip": []}


class _Summary:
    """A plugin registered while this module runs: prints the pass count in pytest's summary
    and writes the failures where JAXOPS_ONNX_XFAIL_WRITE asks."""

    def pytest_terminal_summary(self, terminalreporter):
        passed, failed = len(RESULTS["pass"]), len(RESULTS["fail"])
        ran = passed + failed
        if not ran:
            return
        terminalreporter.write_line(
            f"ONNX node suite (onnx {onnx.__version__}): {passed} of {ran} cases pass "
            f"({100 * passed / ran:.1f}%), {failed} fail, {len(RESULTS['skip'])} skipped; "
            f"{len(NAMES)} node cases on CPU")
        path = os.environ.get("JAXOPS_ONNX_XFAIL_WRITE")
        if path:
            Path(path).write_text(f"# onnx {onnx.__version__}: node cases expected to fail, "
                                  "with the first line of their error\n" + "".join(
                                      f"{n}  # {r}\n" for n, r in sorted(RESULTS["fail"].items())))


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    name = "jaxops-onnx-node-summary"
    if request.config.pluginmanager.get_plugin(name) is None:
        request.config.pluginmanager.register(_Summary(), name)
    yield


def test_xfail_list_names_real_cases():
    assert all(XFAILS.values()), "every expected failure needs a reason"
    if not EXACT:
        pytest.skip(f"the list is for onnx {LIST_VERSION}, this is {onnx.__version__}")
    unknown = sorted(set(XFAILS) - set(NAMES))
    assert not unknown, f"onnx_backend_xfail.txt names cases that do not exist: {unknown[:10]}"


@pytest.mark.parametrize("name", NAMES)
def test_node(name):
    case = _SUITE["cases"](name)
    try:
        getattr(case, name)()
    except unittest.SkipTest as e:
        RESULTS["skip"].append(name)
        pytest.skip(str(e))
    except Exception as e:  # noqa: BLE001 - a failing case, recorded with its reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        RESULTS["fail"][name] = f"{type(e).__name__}: {reason}"
        if name in XFAILS:
            pytest.xfail(XFAILS[name])
        if not EXACT:
            pytest.xfail(f"not on the list made for onnx {LIST_VERSION}: {RESULTS['fail'][name]}")
        raise
    RESULTS["pass"].append(name)
    if name in XFAILS and EXACT:
        pytest.fail(f"{name} passes now: take it off onnx_backend_xfail.txt", pytrace=False)
