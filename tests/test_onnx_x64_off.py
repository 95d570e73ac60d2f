"""The ONNX ops whose results depend on float64 arithmetic, run with JAX's default float32
(x64 off), in a subprocess: tests/conftest.py turns x64 on for everything else.

DFT/STFT (numpy's FFTs run in float64, and the node cases check zeros to 1e-7) and
Quantize/DynamicQuantizeLinear (numpy's float32 division is correctly rounded; XLA's on CPU is
not, and a quotient an ulp off .5 rounds the other way) compute those parts in 64 bits whether
x64 is on or not (jaxops/onnx/handlers/_precise.py). Their node cases must give what they give with
x64 on (tests/onnx_backend_xfail.txt lists the two that fail either way), and their
derivatives must hold with x64 off too.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # one subprocess runs 40 node cases: 17 s on 2 cores

onnx = pytest.importorskip("onnx")
if tuple(int(v) for v in onnx.__version__.split(".")[:2]) < (1, 23):
    pytest.skip("the in-memory node suite needs onnx >= 1.23", allow_module_level=True)

from test_onnx_backend import XFAILS  # noqa: E402

PATTERN = r"^test_(dft|stft|dynamicquantizelinear|quantizelinear|qlinearmatmul)"

SCRIPT = r"""
import json, re, sys, warnings
import jax, jax.numpy as jnp, numpy as np
assert not jax.config.jax_enable_x64
import onnx.backend.test
from onnx import TensorProto, helper
from jax.test_util import check_grads
import jaxops.onnx
from jaxops.onnx import backend

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    cases = onnx.backend.test.BackendTest(backend.JaxopsBackend, "x64_off").test_cases[
        "OnnxBackendNodeModelTest"]
results = {}
for name in sorted(n for n in dir(cases) if re.search(sys.argv[1], n) and n.endswith("_cpu")):
    try:
        getattr(cases(name), name)()
        results[name] = None
    except Exception as e:
        results[name] = f"{type(e).__name__}: {str(e).strip()[:300]}"

def grads(node, inputs, consts=()):
    "check_grads order 2, forward and reverse mode, of a one-node float32 model"
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in inputs.items()]
    model = helper.make_model(helper.make_graph(
        [node], "g", vis, [helper.make_empty_tensor_value_info("y")], list(consts)),
        opset_imports=[helper.make_opsetid("", 20)])
    program = jaxops.onnx.load(model)
    f = lambda *xs: program(program.params, *xs)[0]
    args = [jnp.asarray(v) for v in inputs.values()]
    check_grads(f, args, order=2, modes=("fwd", "rev"), eps=1e-2, atol=2e-2, rtol=2e-2)
    return f(*args).dtype

rng = np.random.default_rng(0)
x = rng.normal(size=(2, 8, 2)).astype(np.float32)
dtypes = [
    grads(helper.make_node("DFT", ["x"], ["y"]), {"x": x}),
    grads(helper.make_node("DFT", ["x"], ["y"], inverse=1, onesided=1), {"x": x[:, :5]}),
    grads(helper.make_node("STFT", ["x", "step", "w"], ["y"]),
          {"x": x[..., :1], "w": np.hanning(4).astype(np.float32)},
          [helper.make_tensor("step", TensorProto.INT64, [], [2])]),
]
f = lambda x: program(program.params, x)[0]
program = jaxops.onnx.load(helper.make_model(helper.make_graph(
    [helper.make_node("DFT", ["x"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape[1:])],
    [helper.make_empty_tensor_value_info("y")]), opset_imports=[helper.make_opsetid("", 20)]))
per_example = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2))))(x)
dtypes.append(per_example.dtype)
results["grads"] = [str(d) for d in dtypes]
print("RESULTS", json.dumps(results))
"""


@pytest.fixture(scope="module")
def x64_off():
    env = dict(os.environ, JAX_ENABLE_X64="0", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, PATTERN], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[0][len("RESULTS "):])


def test_node_cases_pass_with_x64_off(x64_off):
    cases = {n: e for n, e in x64_off.items() if n.startswith("test_")}
    assert len(cases) >= 30, sorted(cases)
    failed = {n: e for n, e in cases.items() if e is not None and n not in XFAILS}
    passing_xfails = sorted(n for n, e in cases.items() if e is None and n in XFAILS)
    assert not failed, failed
    assert not passing_xfails, f"listed as failing but pass with x64 off: {passing_xfails}"


def test_fft_gradients_with_x64_off(x64_off):
    """DFT, inverse one-sided DFT and STFT (signal and window): check_grads order 2 in both
    modes, and jit(vmap(grad)) of the DFT; the results stay float32."""
    assert x64_off["grads"] == ["float32"] * 4
