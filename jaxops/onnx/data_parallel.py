"""Data-parallel training of ORT training artifacts: one step over every device of a mesh axis.

    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    module = Module("artifacts/training_model.onnx", state)
    optimizer = Optimizer("artifacts/optimizer_model.onnx", module)
    trainer = DataParallel(module, optimizer)            # all local devices, axis "data"
    for x, y in data:                                    # x, y: the global batch
        loss = trainer.step(x, y)

This is what ORT's data-parallel graphs do, on JAX's collectives: each device runs the
training graph (forward and backward) on its slice of the batch, the gradients of all
devices are summed in one fused all-reduce (`jaxops.ops.nccl_all_reduce`, ORT's
NcclAllReduce), divided by the number of devices when the loss is a mean over the batch (ORT's
artifacts' losses are), and every device applies the optimizer graph to the same averaged
gradients, so the parameters stay replicated. The whole step is one jit-compiled
`jax.shard_map` with the old parameters and optimizer moments donated.

Across hosts: call `jax.distributed.initialize(...)` in every process first and build the
mesh over `jax.devices()` (every process's devices); each process passes the global batch
(or see `step`'s docstring). examples/data_parallel.py shows both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops.onnx.training import Module, Optimizer


class DataParallel:
    """Training steps of a Module and its Optimizer, data-parallel over `axis_name` of `mesh`
    (default: a 1-D mesh of all devices). The Module's CheckpointState holds the results:
    parameters (replicated over the mesh), optimizer moments, step count, and the averaged
    gradients of the last step as the parameters' `.grad`.

    average: divide the summed gradients (and the loss) by the number of devices, right for a
      loss that is a mean over the batch (ORT's artifacts); False for a sum loss.
    """

    def __init__(self, module: Module, optimizer: Optimizer, mesh: jax.sharding.Mesh | None = None,
                 axis_name: str = "data", average: bool = True):
        if optimizer._module is not module:
            raise ValueError("the optimizer belongs to another Module")
        if mesh is None:
            mesh = jax.sharding.Mesh(np.array(jax.devices()), (axis_name,))
        if axis_name not in mesh.axis_names:
            raise ValueError(f"the mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")
        self.mesh, self.axis_name, self.average = mesh, axis_name, average
        self.shards = mesh.shape[axis_name]
        self._module, self._optimizer = module, optimizer
        module._train.free_axes = (0,)  # the batch: any size that splits over the devices
        state = module._state
        replicated = NamedSharding(mesh, P())
        state._params = _place(state._params, replicated)
        state._moments = _place(state._moments, replicated)
        body = jax.shard_map(self._body, mesh=mesh,
                             in_specs=(P(), P(), P(), P(), P(axis_name)),
                             out_specs=(P(), P(), P(), P()))
        self._step = jax.jit(body, donate_argnums=(0, 1))
        self._batch = NamedSharding(mesh, P(axis_name))

    def _body(self, params, moments, lr, step, inputs):
        module, axis = self._module, self.axis_name
        zeros = {p: jnp.zeros_like(params[p]) for p in module._buffers}
        # reset=True: the accumulation buffers start over, so they hold this shard's gradients
        losses, grads = module._train_fn(params, zeros, True, inputs)
        names = list(grads)
        from jaxops import ops  # late: the op families load jax kernels
        summed = ops.nccl_all_reduce(*[grads[n] for n in names], axis_name=axis)
        summed = summed if isinstance(summed, tuple) else (summed,)
        scale = 1 / self.shards if self.average else 1
        grads = {n: g * jnp.asarray(scale, g.dtype) for n, g in zip(names, summed)}
        loss = jax.lax.psum(losses[0], axis) * scale
        new_params, new_moments = self._optimizer._fn(params, moments, grads, lr, step)
        return loss, new_params, new_moments, grads

    def step(self, *inputs):
        """One data-parallel step on the global batch `inputs` (the training model's user
        inputs, batch first; the batch must divide evenly over the devices): forward,
        backward, all-reduce, optimizer. Returns the loss (averaged over devices when
        `average`). Across processes, every process passes the same global batch, or a
        jax.Array already sharded over the mesh's axis (e.g. from
        jax.make_array_from_process_local_data, each process loading only its part)."""
        module, state = self._module, self._module._state
        if len(inputs) != len(module._train_inputs):
            raise TypeError(f"expected {len(module._train_inputs)} inputs "
                            f"{module._train_inputs}, got {len(inputs)}")
        placed = []
        for name, x in zip(module._train_inputs, inputs):
            if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
                x = np.asarray(x)
                if x.ndim == 0 or x.shape[0] % self.shards:
                    raise ValueError(f"input {name!r} has shape {list(x.shape)}: its first "
                                     f"(batch) dimension must divide over {self.shards} devices")
                x = _place(x, self._batch)
            placed.append(x)
        state._step += 1  # ORT's AdamW step is 1-based; the op does not increment it
        trainable = {n: state._params[n] for n in self._optimizer._names}
        frozen = {n: v for n, v in state._params.items() if n not in trainable}
        params = {**frozen, **trainable}
        lr = np.float32(self._optimizer._lr)
        step = np.asarray([state._step], np.int64)
        loss, new_params, state._moments, state._grads = self._step(
            params, state._moments, lr, step, placed)
        state._params = {**frozen, **new_params}
        return loss


def _place(tree, sharding):
    """Host values (the same in every process) as global arrays laid out by `sharding`;
    jax.device_put cannot reach other processes' devices, a callback per shard can."""
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(one, tree)


__all__ = ["DataParallel"]
