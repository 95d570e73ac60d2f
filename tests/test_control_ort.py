"""ZeroGradient, InPlaceAccumulator(V2) and Group against onnxruntime-training 1.19.2 (CPU).

InPlaceAccumulatorV2 and ZeroGradient-style accumulation run in every training graph that
generate_artifacts makes, so these compare values, dtypes and shapes exactly. ORT overwrites
the arrays fed to these ops: ort_oracle hands it copies, and the tests check ours are intact.
PassThrough has no standalone CPU kernel in 1.19.2 (it insists on aliased buffers).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import ops

pytestmark = pytest.mark.ort
ort_oracle = pytest.importorskip("ort_oracle")

SHAPES = [(7,), (3, 5), (2, 3, 4), (1,)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("signal", [np.array([1.0], np.float32), np.array([True]),
                                    np.array(3, np.int64)], ids=["f32", "bool", "i64"])
def test_zero_gradient(rng, shape, signal):
    g = rng.standard_normal(shape).astype(np.float32)
    (expected,) = ort_oracle.run_node("ZeroGradient", [g, signal])
    got = ops.zero_gradient(jnp.asarray(g), jnp.asarray(signal))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("signal", [None, True, False])
def test_in_place_accumulator(rng, shape, signal):
    old = rng.standard_normal(shape).astype(np.float32)  # 1.19.2 CPU: float only
    value = rng.standard_normal(shape).astype(np.float32)
    inputs = [old, value] + ([] if signal is None else [np.array([signal])])
    kept = [x.copy() for x in inputs]
    (expected,) = ort_oracle.run_node("InPlaceAccumulator", inputs)
    got = ops.in_place_accumulator(*map(jnp.asarray, inputs))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(got), expected)
    for a, b in zip(inputs, kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
@pytest.mark.parametrize("flag", [None, np.array([True]), np.array([False]), np.array(True),
                                  np.array(False)],
                         ids=["absent", "[T]", "[F]", "T", "F"])
def test_in_place_accumulator_v2(rng, dtype, shape, flag):
    # 1.19.2 CPU runs buffer and value of one dtype (a float16 value with a float32 buffer
    # is misread there); mixed dtypes are checked against the formula in test_control.py
    buf = rng.standard_normal(shape).astype(dtype)
    value = rng.standard_normal(shape).astype(dtype)
    inputs = [buf, value] + ([] if flag is None else [flag])
    kept = [x.copy() for x in inputs]
    updated, expected = ort_oracle.run_node("InPlaceAccumulatorV2", inputs, [np.bool_, dtype])
    got_updated, got = ops.in_place_accumulator_v2(*map(jnp.asarray, inputs))
    assert got_updated.dtype == updated.dtype and got_updated.shape == updated.shape == (1,)
    np.testing.assert_array_equal(np.asarray(got_updated), updated)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(got), expected)
    for a, b in zip(inputs, kept):
        np.testing.assert_array_equal(a, b)


def test_in_place_accumulator_v2_accumulates_over_steps(rng):
    # the generate_artifacts pattern: lazy_reset_grad true on the first step, then false
    buf = np.zeros((4, 3), np.float32)
    ours = jnp.asarray(buf)
    for step in range(4):
        value = rng.standard_normal((4, 3)).astype(np.float32)
        flag = np.array([step == 0])
        _, buf = ort_oracle.run_node("InPlaceAccumulatorV2", [buf, value, flag],
                                     [np.bool_, np.float32])
        _, ours = ops.in_place_accumulator_v2(ours, jnp.asarray(value), jnp.asarray(flag))
        np.testing.assert_array_equal(np.asarray(ours), buf)


def test_group(rng):
    inputs = [rng.standard_normal((2, 3)).astype(np.float32), np.arange(3, dtype=np.int64)]
    (expected,) = ort_oracle.run_node("Group", inputs, [np.bool_])
    got = ops.group(*map(jnp.asarray, inputs))
    assert got.dtype == expected.dtype and got.shape == expected.shape == (1,)
    np.testing.assert_array_equal(np.asarray(got), expected)
