"""x64 off (JAX's default): host int64 inputs that 32 bits would change are refused, never
narrowed (issue 21). jnp.asarray turns numpy label 2**32 + 1 into 1 without a word; every public
op checks its inputs first (jaxops/_src/spec.py, jaxops/_src/rules.py)."""
import re

import jax
import numpy as np
import pytest

from jaxops import nn, ops

FAR = 2**32 + 1  # int32 would make it 1


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield


def test_every_public_op_is_checked():
    """The class: every op of ORT_OPS is a spec'd function (its generated wrapper checks),
    as is every other spec'd op; jaxops.nn's functions are wrapped."""
    assert all(hasattr(f, "spec") for f in ops.ORT_OPS.values())
    assert all(hasattr(getattr(ops, name), "spec") for name in ops.SPECS)
    assert len(ops.SPECS) > 90
    fns = [getattr(nn, n) for n in nn.__all__]
    assert fns and all(getattr(f, "__wrapped__", None) for f in fns if callable(f))


@pytest.mark.parametrize("call, name", [
    (lambda: ops.softmax_cross_entropy_loss(np.zeros((2, 5), np.float32), np.array([FAR, 0]),
                                            reduction="none"), "labels"),
    (lambda: ops.softmax_cross_entropy_loss(np.zeros((2, 5), np.float32),
                                            labels=np.array([FAR, 0])), "labels"),
    (lambda: ops.sparse_softmax_cross_entropy(np.zeros((2, 5), np.float32),
                                              np.array([0, -FAR])), "label"),
    (lambda: ops.gather_grad((3, 2), np.array([FAR]), np.ones((1, 2), np.float32)), "indices"),
    (lambda: ops.ORT_OPS[("com.microsoft", "GatherElementsGrad")](
        np.ones((1, 2), np.float32), (3, 2), np.array([[FAR, 0]])), "indices"),
    (lambda: ops.gather_nd_grad((3, 2), np.array([[np.uint64(2**40)]], np.uint64),
                                np.ones((1, 2), np.float32)), "indices"),
    (lambda: ops.adamw_optimizer(np.float32(0.1), np.int64(2**40), [np.ones(2, np.float32)],
                                 [np.ones(2, np.float32)], [np.zeros(2, np.float32)],
                                 [np.zeros(2, np.float32)]), "step"),
    (lambda: ops.pass_through(np.ones(2, np.float32), np.array([FAR])), "inputs[1]"),
    (lambda: nn.embedding(np.ones((3, 2), np.float32), np.array([FAR])), "ids"),
    (lambda: nn.cross_entropy(np.zeros((2, 5), np.float32), np.array([FAR, 0])), "labels"),
])
def test_out_of_int32_refused(x64_off, call, name):
    pattern = rf"jaxops\.(ops|nn)\.\w+: {re.escape(name)} \((u?int64)\) holds"
    with pytest.raises(ValueError, match=pattern):
        call()


def test_fitting_and_static_values_pass(x64_off):
    # int64 values that fit run as before
    loss, _ = ops.softmax_cross_entropy_loss(np.zeros((2, 5), np.float32), np.array([2, 0]),
                                             reduction="none")
    np.testing.assert_allclose(loss, np.log(5), rtol=1e-6)
    # static inputs are read as Python ints: ONNX's "to the end" INT64_MAX slice bound is fine
    dx = ops.slice_grad(np.ones((1, 2), np.float32), np.array([3, 2]), np.array([0, 0]),
                        np.array([1, 2**63 - 1]))
    assert dx.shape == (3, 2) and float(dx.sum()) == 2
    # attributes (keyword-only) are not inputs
    out = ops.gather_grad(np.array([3, 2]), np.array([1]), np.ones((1, 2), np.float32),
                          axis=np.int64(0))
    assert float(out[1].sum()) == 2


def test_x64_on_keeps_int64():
    """With x64 on nothing is narrowed, so nothing is refused: the label is out of range."""
    loss, _ = ops.softmax_cross_entropy_loss(np.zeros((2, 5), np.float32), np.array([FAR, 0]),
                                             reduction="none")
    assert np.isnan(loss[0]) and np.isfinite(loss[1])
