"""A small softmax classifier trained under jax.jit whose backward pass runs jaxops kernels.

Until the ONNX importer lands this is the package's main job: it checks that the kernels
train a model (loss falls) and that jaxops' gradients equal XLA's own at every step.
Run: python examples/train_classifier.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxops


def init(key, n_in, n_hidden, n_classes):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (n_in, n_hidden)) / np.sqrt(n_in),
            "w2": jax.random.normal(k2, (n_hidden, n_classes)) / np.sqrt(n_hidden)}


def loss(params, x, labels, log_softmax):
    h = jnp.tanh(x @ params["w1"])
    logp = log_softmax(h @ params["w2"], -1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def main(steps=200, lr=0.5):
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, 32)) * 2
    labels = rng.integers(0, 10, 2048)
    x = jnp.asarray(centers[labels] + rng.standard_normal((2048, 32)), jnp.float32)
    labels = jnp.asarray(labels)
    params = init(jax.random.key(0), 32, 64, 10)

    @jax.jit
    def step(params):
        value, grads = jax.value_and_grad(loss)(params, x, labels, jaxops.nn.log_softmax)
        xla_grads = jax.grad(loss)(params, x, labels, jax.nn.log_softmax)
        gap = jnp.max(jnp.stack([jnp.max(jnp.abs(a - b)) for a, b in
                                 zip(jax.tree.leaves(grads), jax.tree.leaves(xla_grads))]))
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value, gap

    first = None
    for i in range(steps):
        params, value, gap = step(params)
        first = float(value) if first is None else first
        if i % 50 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {float(value):.4f}  max |grad - XLA grad| {float(gap):.2e}")
        assert float(gap) < 1e-5, "jaxops gradient differs from XLA's"
    assert float(value) < 0.5 * first, "loss did not fall"
    print(f"trained on {jax.devices()[0].platform}: loss {first:.4f} -> {float(value):.4f}")


if __name__ == "__main__":
    main()
