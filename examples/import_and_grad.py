"""Import an ONNX model and train its weights with JAX.

Builds a small MLP with onnx.helper (a Reshape whose target shape comes from Shape/Concat
arithmetic, so the importer must resolve it statically under jit), loads it with
jaxops.onnx.load, takes jax.jit(jax.grad(...)) over its params, checks the gradients
numerically with jax.test_util.check_grads, and runs a few steps of gradient descent.

    python examples/import_and_grad.py
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads
from onnx import TensorProto, helper, numpy_helper

import jaxops.onnx

jax.config.update("jax_enable_x64", True)  # float64 for check_grads' finite differences


def build_model(rng) -> "onnx.ModelProto":  # noqa: F821
    """y = tanh(flatten(x) @ w1 + b1) @ w2 + b2 for x of shape [batch, 2, 3]."""
    weights = {"w1": rng.normal(size=(6, 8)) / 3, "b1": np.zeros(8),
               "w2": rng.normal(size=(8, 2)) / 3, "b2": np.zeros(2)}
    inits = [numpy_helper.from_array(v.astype(np.float64), k) for k, v in weights.items()]
    inits += [numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["y0"]),
        helper.make_node("Add", ["y0", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main():
    rng = np.random.default_rng(0)
    program = jaxops.onnx.load(build_model(rng))
    print(program)
    print("params:", {k: v.shape for k, v in program.params.items()})

    x = rng.normal(size=(16, 2, 3))
    target = np.stack([x.sum((1, 2)), (x ** 2).mean((1, 2))], axis=1)

    def loss(params, x, target):
        return jnp.mean((program(params, x) - target) ** 2)

    grad_fn = jax.jit(jax.grad(loss))
    grads = grad_fn(program.params, x, target)
    print("gradient norms:", {k: float(jnp.linalg.norm(g)) for k, g in grads.items()})

    # numerical check of first and second derivatives w.r.t. every param
    check_grads(lambda p: loss(p, x, target), (program.params,), order=2, modes=("fwd", "rev"))
    print("check_grads: ok (order 2, forward and reverse)")

    params = program.params
    start = float(loss(params, x, target))
    for _ in range(200):
        params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params,
                                        grad_fn(params, x, target))
    print(f"loss {start:.4f} -> {float(loss(params, x, target)):.4f} after 200 steps")


if __name__ == "__main__":
    main()
