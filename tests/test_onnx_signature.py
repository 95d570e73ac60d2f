"""An imported program checks its inputs against the model's declarations (element type
family, static dims, symbolic dims bound consistently) and names the input in the error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper

from jaxops.onnx import OnnxImportError, load
from onnx_build import model, vi


def _program():
    """ids: INT64[8, 8]; x: FLOAT['batch', 4]; y: FLOAT['batch', 4] -> (x + y, ids)."""
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]),
             helper.make_node("Identity", ["ids"], ["ids_out"])]
    return load(model(nodes, [vi("ids", TensorProto.INT64, [8, 8]), vi("x", shape=["batch", 4]),
                              vi("y", shape=["batch", 4])], ["s", "ids_out"]))


IDS, X = np.zeros((8, 8), np.int64), np.ones((3, 4), np.float32)


@pytest.mark.parametrize("args,message", [
    ((np.zeros((8, 8), np.float32), X, X), "'ids' must be int64.*got float32"),
    ((IDS, X.astype(np.int32), X), "'x' must be float32.*got int32"),
    ((IDS, X, X.astype(bool)), "'y' must be float32.*got bool"),
    ((IDS[:5], X, X), r"'ids' must have shape \[8, 8\], got \(5, 8\) \(dim 0\)"),
    ((np.zeros((8, 9), np.int64), X, X), r"'ids' must have shape \[8, 8\], got \(8, 9\)"),
    ((IDS, X, np.ones((3, 4, 1), np.float32)), r"'y' must have rank 2 \(shape \['batch', 4\]\)"),
    ((IDS, X, np.ones((5, 4), np.float32)), "'y' has 5 for dim 'batch'.*input 'x' has 3"),
    ((IDS, [X], X), "'x' is a tensor, got list"),
], ids=["float-for-int64", "int-for-float", "bool-for-float", "batch", "width", "rank",
        "symbolic", "list"])
def test_bad_input_names_the_input(args, message):
    p = _program()
    for call in (lambda: p(p.params, *args), lambda: jax.jit(p)(p.params, *args)):
        with pytest.raises(OnnxImportError, match=message):
            call()


def test_accepted_widths():
    """Widths within a family pass, as jax treats them: int32 ids (jax without 64-bit types),
    float64 x and y (checking a float32 model's gradients in double precision)."""
    p = _program()
    s, ids = p(p.params, IDS.astype(np.int32), X.astype(np.float64), X.astype(np.float64))
    assert s.dtype == jnp.float64 and s.shape == (3, 4)
    s, _ = jax.jit(p)(p.params, IDS, jnp.ones((7, 4)), jnp.ones((7, 4)))  # any batch
    assert s.shape == (7, 4)


def test_params_come_first():
    p = _program()
    with pytest.raises(OnnxImportError, match=r"first argument is the params dict.*"
                                              r"program\(program.params, \*inputs\)"):
        p(IDS, X, X)
    with pytest.raises(OnnxImportError, match=r"missing model input.*\['y'\].*program.params"):
        p(p.params, IDS, X)
