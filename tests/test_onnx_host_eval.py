"""Values that do not depend on the data are computed on the host, whatever the op's domain:
the shape arithmetic of ORT's training graphs (generate_artifacts rewrites every Concat into
com.microsoft.ConcatTraining) stays static under jit. Pooling gradients take X's shape from the
forward graph, and declared shapes bind their symbolic dims to the call's sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper

from jaxops.onnx import OnnxImportError, load
from onnx_build import model, vi

INT64 = TensorProto.INT64
MS = "com.microsoft"


def _reshape_by(concat_node, extra_nodes=(), initializers=None):
    """x[batch, 6] -> Shape -> Gather(0) -> Unsqueeze -> <concat_node> -> Reshape(x, shape)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["bu"]),
             *extra_nodes, concat_node,
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = {"zero": np.int64(0), "ax": np.array([0], np.int64), "c23": np.array([2, 3], np.int64)}
    inits.update(initializers or {})
    return model(nodes, [vi("x", shape=["batch", 6])], ["y", vi("shape", INT64)], inits,
                 domains=[MS])


CONCAT_TRAINING = _reshape_by(
    helper.make_node("ConcatTraining", ["bu", "c23"], ["shape", "lens"], axis=0, domain=MS))
SPLIT_TRAINING = _reshape_by(  # [batch, 2, 3, 99] split into [batch, 2, 3] and [99]
    helper.make_node("SplitTraining", ["all", "sizes"], ["shape", "rest"], axis=0, domain=MS),
    [helper.make_node("ConcatTraining", ["bu", "c23", "c99"], ["all"], axis=0, domain=MS)],
    {"c99": np.array([99], np.int64), "sizes": np.array([3, 1], np.int64)})


@pytest.mark.parametrize("m", [CONCAT_TRAINING, SPLIT_TRAINING], ids=["concat", "split"])
def test_com_microsoft_shape_path_folds_under_jit(m):
    program = load(m)
    x = jnp.arange(12.0).reshape(2, 6)
    f = jax.jit(lambda x: program(program.params, x))
    y, shape = f(x)
    assert y.shape == (2, 2, 3)
    np.testing.assert_array_equal(np.asarray(y).ravel(), np.arange(12.0))
    np.testing.assert_array_equal(shape, [2, 2, 3])
    assert f(jnp.zeros((4, 6)))[0].shape == (4, 2, 3)  # the batch binds per trace
    # computed on the host: the traced program holds no concatenate and no kernel call
    text = str(jax.make_jaxpr(lambda x: program(program.params, x))(x))
    assert "concatenate" not in text and "ffi" not in text and "custom_call" not in text
    g = jax.grad(lambda x: jnp.sum(program(program.params, x)[0] ** 2))(x)
    np.testing.assert_allclose(g, 2 * x)
    ys = jax.vmap(lambda x: program(program.params, x)[0])(jnp.stack([x, x + 1]))
    assert ys.shape == (2, 2, 2, 3)


def test_host_values_keep_64_bit_types_without_x64():
    program = load(CONCAT_TRAINING)
    with jax.enable_x64(False):
        seen = []
        jax.jit(lambda x: seen.append(program(program.params, x)[1]))(jnp.ones((2, 6)))
        _, shape = program(program.params, jnp.ones((2, 6)))
    for value in (seen[0], shape):  # traced and eager: a numpy int64 value, as ONNX says
        assert isinstance(value, np.ndarray) and value.dtype == np.int64


def test_any_op_on_host_values_folds():
    """A com.microsoft op that is no shape arithmetic (ReduceSumTraining) and an ai.onnx
    float op (Sqrt) on host values: folded too, the result feeding a Reshape."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ReduceSumTraining", ["s", "axes"], ["n"], keepdims=1, domain=MS),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Sqrt", ["nf"], ["r"]),
             helper.make_node("Cast", ["r"], ["ri"], to=INT64),
             helper.make_node("Concat", ["ri", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    m = model(nodes, [vi("x", shape=["rows", "cols"])], ["y"],
              {"axes": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}, domains=[MS])
    program = load(m)
    y = jax.jit(lambda x: program(program.params, x))(jnp.ones((4, 12)))
    assert y.shape == (4, 12)  # sqrt(4 + 12) = 4 rows
    y = jax.jit(lambda x: program(program.params, x))(jnp.ones((5, 20)))
    assert y.shape == (5, 20)


def test_data_dependent_shape_stays_an_error_naming_the_node():
    nodes = [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
             helper.make_node("Cast", ["m"], ["mi"], to=INT64),
             helper.make_node("Unsqueeze", ["mi", "ax"], ["mu"]),
             helper.make_node("ConcatTraining", ["mu", "minus1"], ["shape"], axis=0, domain=MS),
             helper.make_node("Reshape", ["x", "shape"], ["y"], name="the_reshape")]
    m = model(nodes, [vi("x", shape=[2, 6])], ["y"],
              {"ax": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}, domains=[MS])
    program = load(m)
    with pytest.raises(OnnxImportError, match="the_reshape.*depends on a traced"):
        jax.jit(lambda x: program(program.params, x))(jnp.full((2, 6), 2.0))


def test_model_inputs_are_data_even_when_concrete():
    """Eager calls with concrete inputs compute as before (nothing of the data is folded):
    the result is a jax array, not a host value."""
    nodes = [helper.make_node("ConcatTraining", ["x", "x"], ["y"], axis=0, domain=MS)]
    program = load(model(nodes, [vi("x", shape=[2])], ["y"], domains=[MS]))
    y = program(program.params, jnp.asarray([1.0, 2.0]))
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(y, [1, 2, 1, 2])


# -- pooling gradients: X's shape from the forward graph ---------------------------------------

def _pool_grad_model(op, declared):
    """x -> pool -> y; dy (a model input) -> <op>Grad -> dx, dx declared as `declared`."""
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2])
    if op == "MaxPool":
        nodes = [helper.make_node("MaxPool", ["x"], ["y", "idx"], **attrs),
                 helper.make_node("MaxPoolGrad", ["y_grad", "idx"], ["x_grad"], **attrs)]
    else:
        nodes = [helper.make_node("AveragePool", ["x"], ["y"], **attrs),
                 helper.make_node("AveragePoolGrad", ["y_grad"], ["x_grad"], **attrs)]
    m = model(nodes, [vi("x", shape=["batch", 2, 4, 4]), vi("y_grad", shape=["batch", 2, 2, 2])],
              ["y", "x_grad"], domains=[MS])
    if declared is not None:
        m.graph.value_info.append(vi("x_grad", shape=declared))
    return m


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("declared", [None, ["batch", 2, 4, 4], ["other", 2, 4, 4]],
                         ids=["undeclared", "symbolic", "unbound"])
def test_pool_grad_takes_x_shape_from_the_forward_graph(rng, op, declared):
    program = load(_pool_grad_model(op, declared))
    x = jnp.asarray(rng.standard_normal((3, 2, 4, 4)))
    dy = jnp.asarray(rng.standard_normal((3, 2, 2, 2)))
    y, dx = jax.jit(lambda x, dy: program(program.params, x, dy))(x, dy)
    # the gradient op's dx is the vjp of the same forward pooling
    _, vjp = jax.vjp(lambda x: program(program.params, x, dy)[0], x)
    np.testing.assert_allclose(dx, vjp(dy)[0], rtol=1e-12, atol=1e-12)


def test_pool_grad_declared_shape_binds_symbolic_dims(rng):
    """Without a forward pooling to pair with, the declared shape of dx is used, its symbolic
    dim bound to the size of the input that declares the same name."""
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2])
    nodes = [helper.make_node("AveragePoolGrad", ["dy"], ["dx"], **attrs)]
    m = model(nodes, [vi("dy", shape=["n", 1, 2, 2])], ["dx"], domains=[MS])
    m.graph.value_info.append(vi("dx", shape=["n", 1, 4, 4]))
    program = load(m)
    dx = jax.jit(lambda dy: program(program.params, dy))(jnp.ones((5, 1, 2, 2)))
    assert dx.shape == (5, 1, 4, 4)
    np.testing.assert_allclose(dx, 0.25)
    m.graph.value_info[0].type.tensor_type.shape.dim[0].dim_param = "unbound"
    program = load(m)
    with pytest.raises(OnnxImportError, match="AveragePoolGrad.*shape of the forward input"):
        program(program.params, jnp.ones((5, 1, 2, 2)))
