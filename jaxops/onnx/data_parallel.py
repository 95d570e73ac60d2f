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

from jaxops.onnx.train_core import TrainState, check_inputs
from jaxops.onnx.training import Module, Optimizer


class DataParallel:
    """Training steps of a Module and its Optimizer, data-parallel over `axis_name` of `mesh`
    (default: a 1-D mesh of all devices). The Module's CheckpointState holds the results:
    parameters (replicated over the mesh), optimizer moments, step count, and the averaged
    gradients of the last step as the parameters' `.grad`.

    average: divide the summed gradients (and the loss) by the number of devices, right for a
      loss that is a mean over the batch (ORT's artifacts); False for a sum loss.
    step_fn: the jitted pure step `step_fn(train_state, lr, inputs) -> (loss, train_state)`
      that `step` calls (the state donated, the inputs sharded over the axis).
    """

    def __init__(self, module: Module, optimizer: Optimizer, mesh: jax.sharding.Mesh | None = None,
                 axis_name: str = "data", average: bool = True):
        if optimizer.module is not module:
            raise ValueError("the optimizer belongs to another Module")
        if mesh is None:
            mesh = jax.sharding.Mesh(np.array(jax.devices()), (axis_name,))
        if axis_name not in mesh.axis_names:
            raise ValueError(f"the mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")
        self.mesh, self.axis_name, self.average = mesh, axis_name, average
        self.shards = mesh.shape[axis_name]
        self.module, self.optimizer = module, optimizer
        module.core.program.free_axes = (0,)  # the batch: any size that splits over the devices
        state = module.state
        ts = state.train_state
        state.train_state = _place(ts, NamedSharding(mesh, P())).replace(step=ts.step)
        body = jax.shard_map(self._body, mesh=mesh, in_specs=(P(), P(), P(axis_name)),
                             out_specs=(P(), P()))
        self.step_fn = jax.jit(body, donate_argnums=0)
        self.batch_sharding = NamedSharding(mesh, P(axis_name))

    def _body(self, state: TrainState, lr, inputs):
        axis = self.axis_name
        # reset: the gradients start over, so they are this shard's
        losses, state = self.module.core.train_step(state, inputs, reset=True)
        names = list(state.grads)
        from jaxops import ops  # late: the op families load jax kernels
        summed = ops.nccl_all_reduce(*state.grads.values(), axis_name=axis)
        summed = summed if isinstance(summed, tuple) else (summed,)
        scale = 1 / self.shards if self.average else 1
        grads = {n: g * jnp.asarray(scale, g.dtype) for n, g in zip(names, summed)}
        loss = jax.lax.psum(losses[0], axis) * scale
        return loss, self.optimizer.core.update(state.replace(grads=grads), lr)

    def step(self, *inputs):
        """One data-parallel step on the global batch `inputs` (the training model's user
        inputs, batch first; the batch must divide evenly over the devices): forward,
        backward, all-reduce, optimizer. Returns the loss (averaged over devices when
        `average`). Across processes, every process passes the same global batch, or a
        jax.Array already sharded over the mesh's axis (e.g. from
        jax.make_array_from_process_local_data, each process loading only its part)."""
        names = self.module.core.input_names
        check_inputs(names, inputs)
        placed = []
        for name, x in zip(names, inputs):
            if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
                x = np.asarray(x)
                if x.ndim == 0 or x.shape[0] % self.shards:
                    raise ValueError(f"input {name!r} has shape {list(x.shape)}: its first "
                                     f"(batch) dimension must divide over {self.shards} devices")
                x = _place(x, self.batch_sharding)
            placed.append(x)
        state = self.module.state
        ts = state.train_state
        loss, new = self.step_fn(ts, np.float32(self.optimizer.get_learning_rate()), placed)
        state.train_state = new.replace(step=np.int64(ts.step) + 1)  # on the host, as Optimizer
        return loss


def _place(tree, sharding):
    """Host values (the same in every process) as global arrays laid out by `sharding`;
    jax.device_put cannot reach other processes' devices, a callback per shard can."""
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(one, tree)


__all__ = ["DataParallel"]
