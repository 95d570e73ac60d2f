"""ORT's on-device training API (`onnxruntime.training.api`) on jax.jit.

Migrating a training script is one import:

    from jaxops.onnx.training import CheckpointState, Module, Optimizer, LinearLRScheduler

    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    module = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    optimizer = Optimizer("artifacts/optimizer_model.onnx", module)
    for x, y in data:
        loss = module(x, y)          # forward + backward, gradients accumulated
        optimizer.step()
        module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, "artifacts/checkpoint_out")

The artifacts are those `onnxruntime.training.artifacts.generate_artifacts` writes. ORT runs
them with in-place updates: InPlaceAccumulatorV2 adds each gradient into a buffer that is not
a graph output, AdamWOptimizer/SGDOptimizerV2 overwrite the weights and moments they are fed.
Here those updates are returned values instead (`Program.run_with_updates`), and each train
step and each optimizer step is one jit-compiled function whose old buffers are donated, so
the update happens in place on the device.

Models ORT cannot differentiate (HardSwish, Softplus, a trainable Pow exponent, ...) train
from their forward graph: `jaxops.onnx.artifacts.generate_artifacts` writes the same four
artifacts with a training model that is the forward graph plus the loss, and `Module` takes
`jax.grad` of it (see `Module` and docs/training.md).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from jaxops._src.compat import mark_varying, varying_axes
from jaxops.onnx import checkpoint as ckpt_format

_BUFFER_SUFFIX = "_grad.accumulation.buffer"
_RESET_INPUT = "lazy_reset_grad"
_GROUP = "group0"  # ORT's artifacts have one optimizer group
_MOMENTS = ("momentum0", "momentum1")  # the checkpoint's names for AdamW's two moments

# Optimizer ops: where their inputs sit (the importer returns the new params and moments,
# which ORT writes in place, under these inputs' names).
_OPTIMIZERS = {
    "AdamWOptimizer": {"lr": 0, "step": 1, "params": 2, "grads": 3, "moments": (4, 5)},
    "SGDOptimizerV2": {"lr": 0, "step": None, "params": 1, "grads": 2, "moments": ()},
}


def _model(uri) -> onnx.ModelProto:
    return uri if isinstance(uri, onnx.ModelProto) else onnx.load(os.fspath(uri))


def _load_program(model: onnx.ModelProto):
    from jaxops.onnx import load  # the importer; imported late to keep this module light
    return load(model)


def _run(program, feeds: dict) -> tuple[dict, dict]:
    """Runs an imported program on named inputs: (outputs by name, in-place updates by the
    name of the input they replace)."""
    outs, updates = program.run_with_updates(program.params,
                                             *[feeds[n] for n in program.input_names])
    return dict(zip(program.output_names, outs)), updates


def _optimizer_node(model: onnx.ModelProto) -> onnx.NodeProto:
    nodes = [n for n in model.graph.node if n.op_type in _OPTIMIZERS]
    if len(nodes) != 1:
        raise ValueError(f"expected one optimizer node ({', '.join(_OPTIMIZERS)}) in the "
                         f"optimizer model, found {len(nodes)}")
    return nodes[0]


def _placeholder(t: onnx.TypeProto):
    """A value of type `t` for an input that nothing reads: [] for a sequence, else zeros."""
    if t.HasField("sequence_type"):
        return []
    tt = t.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type or onnx.TensorProto.FLOAT)
    return np.zeros([d.dim_value or 1 for d in tt.shape.dim], dtype)


class Parameter:
    """One parameter of a CheckpointState (ORT's `Parameter`)."""

    def __init__(self, state: CheckpointState, name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return np.asarray(self._state._params[self.name])

    @property
    def requires_grad(self) -> bool:
        return self.name in self._state._trainable

    @property
    def grad(self) -> np.ndarray | None:
        g = self._state._grads.get(self.name)
        return None if g is None else np.asarray(g)

    def copy_from(self, data) -> None:
        old = self._state._params[self.name]
        data = np.asarray(data)
        if data.shape != old.shape or data.dtype != old.dtype:
            raise ValueError(f"parameter {self.name!r} is {old.dtype}{list(old.shape)}, "
                             f"got {data.dtype}{list(data.shape)}")
        self._state._params[self.name] = jnp.asarray(data)

    def __repr__(self):
        return f"Parameter({self.name!r}, requires_grad={self.requires_grad})"


class _Parameters(MutableMapping):
    def __init__(self, state):
        self._state = state

    def __getitem__(self, name):
        if name not in self._state._params:
            raise KeyError(name)
        return Parameter(self._state, name)

    def __setitem__(self, name, value):
        self[name].copy_from(value)

    def __delitem__(self, name):
        raise TypeError("parameters cannot be removed from a checkpoint state")

    def __iter__(self):
        return iter(self._state._params)

    def __len__(self):
        return len(self._state._params)


class _Properties(MutableMapping):
    def __init__(self, state):
        self._props = state._properties

    def __getitem__(self, name):
        return self._props[name]

    def __setitem__(self, name, value):
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            raise TypeError(f"property {name!r} must be an int, float or str, got {type(value).__name__}")
        self._props[name] = value

    def __delitem__(self, name):
        del self._props[name]

    def __iter__(self):
        return iter(self._props)

    def __len__(self):
        return len(self._props)


class CheckpointState:
    """Parameters, gradients, optimizer state and properties, shared by Module and Optimizer."""

    def __init__(self, checkpoint: ckpt_format.Checkpoint):
        self._trainable = list(checkpoint.trainable)
        self._params = {k: jnp.asarray(v) for k, v in {**checkpoint.trainable,
                                                       **checkpoint.frozen}.items()}
        self._grads: dict[str, jax.Array] = {}
        group = checkpoint.optimizer.get(_GROUP, ckpt_format.OptimizerGroup())
        self._step = int(group.step)
        self._initial_lr = float(group.initial_learning_rate)
        self._moments = {p: {k: jnp.asarray(v) for k, v in m.items()}
                         for p, m in group.states.items()}
        self._properties = dict(checkpoint.properties)

    @staticmethod
    def load_checkpoint(path: str | os.PathLike) -> CheckpointState:
        return CheckpointState(ckpt_format.load(path))

    @staticmethod
    def save_checkpoint(state: CheckpointState, path: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        ckpt_format.save(state._to_checkpoint(include_optimizer_state), path)

    @property
    def parameters(self) -> _Parameters:
        return _Parameters(self)

    @property
    def properties(self) -> _Properties:
        return _Properties(self)

    def _to_checkpoint(self, include_optimizer_state):
        host = {k: np.asarray(v) for k, v in self._params.items()}
        out = ckpt_format.Checkpoint(
            trainable={k: host[k] for k in self._trainable},
            frozen={k: v for k, v in host.items() if k not in self._trainable},
            properties=dict(self._properties))
        if include_optimizer_state and self._moments:
            out.optimizer[_GROUP] = ckpt_format.OptimizerGroup(
                self._step, self._initial_lr,
                {p: {k: np.asarray(v) for k, v in m.items()} for p, m in self._moments.items()})
        return out


def _scalar_loss(loss, from_loss_fn: bool):
    """The loss as the 0-d array jax.grad needs; a clear error for anything else."""
    where = ("loss_fn returned" if from_loss_fn
             else "the training model's first output (its loss) is")
    shape = getattr(loss, "shape", None)
    if shape is None or int(np.prod(shape)) != 1:
        got = type(loss).__name__ if shape is None else f"shape {tuple(shape)}"
        hint = "" if from_loss_fn else ": pass loss_fn=, or a loss when generating the artifacts"
        raise ValueError(f"{where} {got}, not a scalar loss{hint}")
    if not jnp.issubdtype(loss.dtype, jnp.inexact):
        raise ValueError(f"{where} of dtype {loss.dtype}: a loss must be floating-point")
    return jnp.reshape(loss, ())


def _device(device):
    """None (jax's default device), a jax.Device, or ORT's name: 'cpu', 'cuda', 'cuda:1'."""
    if device is None or isinstance(device, jax.Device):
        return device
    kind = str(device).split(":")[0].lower()
    platform = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu"}.get(kind)
    if platform is None:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or a jax.Device")
    index = int(str(device).split(":")[1]) if ":" in str(device) else 0
    try:
        return jax.devices(platform)[index]
    except (RuntimeError, IndexError):
        raise ValueError(f"device {device!r}: jax has no such device here (its devices: "
                         f"{jax.devices()}); device=None uses jax's default") from None


class Module:
    """A training model (and optionally its eval model) bound to a CheckpointState.

    Two kinds of training model train here. ORT's (from onnxruntime's `generate_artifacts`)
    holds its own backward graph: gradient ops, InPlaceAccumulatorV2 into
    `<param>_grad.accumulation.buffer` inputs, a `lazy_reset_grad` input. A forward-only
    training model (from `jaxops.onnx.artifacts.generate_artifacts`, or any graph whose
    parameters are inputs) has none of these: its first output is the loss, or `loss_fn`
    computes the loss from its outputs, and the train step takes `jax.grad` of it with respect
    to the checkpoint's trainable parameters, accumulated into the gradients as ORT's
    InPlaceAccumulatorV2 does (`lazy_reset_grad` overwrites them on the next call). Either way
    one train call is one jit-compiled function with the old gradients donated.

    loss_fn: a JAX loss for a forward-only model, `loss_fn(outputs, *labels) -> scalar`:
      `outputs` is the model's output (a tuple when it has several), `labels` the arguments
      given to the call after the model's inputs; their names (`input_names()`) are loss_fn's
      parameters after the first. A JAX callable cannot be written to ONNX, so it is passed
      here each time the artifacts are loaded. It also gives the eval model's result.
    device: where the parameters and the steps live: None (jax's default device, a GPU where
      jax has one), a jax.Device, or ORT's names 'cpu', 'cuda', 'cuda:N'.
    """

    def __init__(self, train_model_uri, state: CheckpointState, eval_model_uri=None,
                 device: str | jax.Device | None = None, *, loss_fn=None):
        self._state = state
        self._device = _device(device)
        if self._device is not None:
            state._params = jax.device_put(state._params, self._device)
        model = _model(train_model_uri)
        self._train = _load_program(model)
        graph_inputs = [i.name for i in model.graph.input]
        self._param_names = [n for n in graph_inputs if n in state._params]
        self._forward_only = not any(n.endswith(_BUFFER_SUFFIX) or n == _RESET_INPUT
                                     for n in graph_inputs)
        self._loss_fn, labels = loss_fn, []
        if self._forward_only:
            labels = self._check_forward_model(model, loss_fn)
            # trainable param -> None: the jitted step accumulates its gradient itself
            self._buffers = {p: None for p in self._param_names if p in state._trainable}
            known = set(self._param_names)
            self._loss_outputs = list(self._train.output_names)
        else:
            if loss_fn is not None:
                raise ValueError("loss_fn is for forward-only training models; this one is "
                                 "ORT's, with its loss and gradient graph built in")
            self._buffers = {b[:-len(_BUFFER_SUFFIX)]: b for b in graph_inputs
                             if b.endswith(_BUFFER_SUFFIX)}
            missing = [p for p in self._buffers if p not in state._params]
            if missing:
                raise ValueError(f"the training model accumulates gradients of {missing}, "
                                 "which the checkpoint does not hold")
            known = set(self._param_names) | set(self._buffers.values()) | {_RESET_INPUT}
            self._loss_outputs = [o for o in self._train.output_names
                                  if not o.endswith("_grad.accumulation.out")]
        self._model_inputs = [n for n in graph_inputs if n not in known]
        self._train_inputs = self._model_inputs + labels
        for p in self._buffers:
            if p not in state._grads:
                state._grads[p] = jnp.zeros_like(state._params[p])
        self._eval = None
        if eval_model_uri is not None:
            emodel = _model(eval_model_uri)
            self._eval = _load_program(emodel)
            self._eval_model_inputs = [i.name for i in emodel.graph.input
                                       if i.name not in state._params]
            self._eval_inputs = self._eval_model_inputs + labels
        self._reset = False  # gradients are zero already: accumulating into them is the same
        self._training = True
        self._train_step = jax.jit(self._train_fn, donate_argnums=(1,))
        self._eval_step = jax.jit(self._eval_fn)

    def _check_forward_model(self, model, loss_fn) -> list[str]:
        """Checks a forward-only training model against the state; returns the label names."""
        from jaxops.onnx.artifacts import LOSS_FN_KEY, loss_labels
        state = self._state
        meta = {p.key: p.value for p in model.metadata_props}
        if loss_fn is None and LOSS_FN_KEY in meta:
            raise ValueError(f"this training model was generated with the JAX loss "
                             f"{meta[LOSS_FN_KEY]!r}, which ONNX cannot hold: pass it as "
                             "Module(..., loss_fn=...)")
        absent = [p for p in state._trainable if p not in self._param_names]
        if absent:
            raise ValueError(f"the checkpoint trains {absent}, which are not inputs of the "
                             "training model")
        trainable = [p for p in self._param_names if p in state._trainable]
        if not trainable:
            raise ValueError("the checkpoint has no trainable parameter that the training "
                             "model takes")
        bad = [f"{p} ({state._params[p].dtype})" for p in trainable
               if not jnp.issubdtype(state._params[p].dtype, jnp.inexact)]
        if bad:
            raise TypeError(f"only floating-point parameters can be trained: {bad}")
        return [] if loss_fn is None else loss_labels(loss_fn)

    # --- the jitted steps
    def _train_fn(self, params, grads, reset, inputs):
        """(outputs, new gradients) of one train call (DataParallel calls it too)."""
        if self._forward_only:
            return self._grad_train_fn(params, grads, reset, inputs)
        feeds = dict(zip(self._train_inputs, inputs))
        feeds.update({n: params[n] for n in self._param_names})
        feeds.update({self._buffers[p]: g for p, g in grads.items()})
        feeds[_RESET_INPUT] = jnp.reshape(reset, (1,))
        out, updates = _run(self._train, feeds)
        new_grads = {p: updates[b] for p, b in self._buffers.items()}
        return [out[o] for o in self._loss_outputs], new_grads

    def _outputs(self, program, model_inputs, params, inputs) -> list:
        """[loss, other outputs...] of a forward-only program (with loss_fn: [loss])."""
        n = len(model_inputs)
        feeds = dict(zip(model_inputs, inputs[:n]))
        feeds.update({k: params[k] for k in program.input_names if k in params})
        out, _ = _run(program, feeds)
        outs = [out[o] for o in program.output_names]
        if self._loss_fn is None:
            return outs
        loss = self._loss_fn(outs[0] if len(outs) == 1 else tuple(outs), *inputs[n:])
        return [loss]

    def _grad_train_fn(self, params, grads, reset, inputs):
        def loss_of(trainable):
            outs = self._outputs(self._train, self._model_inputs, {**params, **trainable},
                                 inputs)
            return _scalar_loss(outs[0], self._loss_fn is not None), outs

        # Inside shard_map (DataParallel), params are the same on every device and the inputs
        # vary: jax.grad would sum the gradient over the devices itself. Marked as varying,
        # each device gets its own gradient, and the caller decides how to reduce them.
        axes = frozenset().union(*(varying_axes(x) for x in inputs))
        trainable = {p: mark_varying(params[p], axes - varying_axes(params[p]))
                     for p in self._buffers}
        g, outs = jax.grad(loss_of, has_aux=True)(trainable)
        # InPlaceAccumulatorV2: the buffer becomes g on a reset, buffer + g otherwise
        new_grads = {p: jnp.where(reset, g[p], grads[p] + g[p]) for p in g}
        return outs, new_grads

    def _eval_fn(self, params, inputs):
        if self._forward_only:
            return self._outputs(self._eval, self._eval_model_inputs, params, inputs)
        feeds = dict(zip(self._eval_inputs, inputs))
        feeds.update({n: params[n] for n in self._eval.input_names if n in params})
        out, _ = _run(self._eval, feeds)
        return [out[o] for o in self._eval.output_names]

    def __call__(self, *user_inputs):
        """One step: in train mode forward + backward (gradients accumulate); in eval mode the
        eval model. Returns the model's user outputs (the loss for ORT's artifacts)."""
        if not self._training and self._eval is None:
            raise RuntimeError("this Module has no eval model")
        expected = self._train_inputs if self._training else self._eval_inputs
        if len(user_inputs) != len(expected):
            raise TypeError(f"expected {len(expected)} inputs {expected}, got {len(user_inputs)}")
        inputs = [jnp.asarray(x) for x in user_inputs]
        if self._device is not None:
            inputs = jax.device_put(inputs, self._device)
        if self._training:
            outs, self._state._grads = self._train_step(self._state._params, self._state._grads,
                                                        np.bool_(self._reset), inputs)
            self._reset = False
        else:
            outs = self._eval_step(self._state._params, inputs)
        return outs[0] if len(outs) == 1 else outs

    def train(self, mode: bool = True) -> Module:
        self._training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self._training

    def lazy_reset_grad(self) -> None:
        """The next train step overwrites the gradients instead of adding to them."""
        self._reset = True

    def input_names(self) -> list[str]:
        """The call's inputs (with a loss_fn: the model's, then loss_fn's labels)."""
        if not self._training and self._eval is None:
            raise RuntimeError("this Module has no eval model")
        return list(self._train_inputs if self._training else self._eval_inputs)

    def output_names(self) -> list[str]:
        """The call's outputs (with a loss_fn: ["loss"])."""
        if self._loss_fn is not None:
            return ["loss"]
        if not self._training and self._eval is None:
            raise RuntimeError("this Module has no eval model")
        return list(self._loss_outputs if self._training else self._eval.output_names)

    def _names(self, trainable_only):
        return [n for n in self._param_names if not trainable_only or n in self._buffers]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return sum(int(self._state._params[n].size) for n in self._names(trainable_only))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> jax.Array:
        """All parameters (training-model input order) as one flat array."""
        return jnp.concatenate([self._state._params[n].ravel() for n in self._names(trainable_only)])

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        buffer = jnp.asarray(buffer)
        names = self._names(trainable_only)
        if buffer.ndim != 1 or buffer.size != self.get_parameters_size(trainable_only):
            raise ValueError(f"buffer must be 1-D with {self.get_parameters_size(trainable_only)} "
                             f"elements, got shape {buffer.shape}")
        offset = 0
        for n in names:
            p = self._state._params[n]
            self._state._params[n] = buffer[offset:offset + p.size].reshape(p.shape).astype(p.dtype)
            offset += p.size


class Optimizer:
    """The optimizer model (AdamWOptimizer or SGDOptimizerV2) over a Module's parameters."""

    def __init__(self, optimizer_uri, module: Module):
        self._module, self._state = module, module._state
        model = _model(optimizer_uri)
        node = _optimizer_node(model)
        layout = _OPTIMIZERS[node.op_type]
        name = lambda i: None if i is None else node.input[i]
        self._io = {"lr": name(layout["lr"]), "step": name(layout["step"]),
                    "params": name(layout["params"]), "grads": name(layout["grads"]),
                    "moments": [name(i) for i in layout["moments"]]}
        self._program = _load_program(model)
        # inputs the node does not read (ORT's SGD model declares step and
        # first_order_moments): fed placeholders of their declared kind
        self._unused = {i.name: _placeholder(i.type) for i in model.graph.input
                        if i.name not in node.input}
        declared = {i.name: i.type.tensor_type for i in model.graph.input}
        lr_type = declared.get(self._io["lr"])  # ORT's models declare lr as [1]
        self._lr_shape = ((1,) * len(lr_type.shape.dim) if lr_type is not None
                          and lr_type.HasField("shape") else ())
        self._names = list(module._buffers)  # trainable params, training-model order
        state = self._state
        if state._initial_lr == 0.0:
            state._initial_lr = 1e-3  # ORT's default when the checkpoint has none
        self._lr = state._initial_lr
        if layout["moments"]:  # a fresh checkpoint has none: start at zero
            for p in self._names:
                moments = state._moments.setdefault(p, {})
                for k in _MOMENTS:
                    moments.setdefault(k, jnp.zeros_like(state._params[p]))
        self._step_fn = jax.jit(self._fn, donate_argnums=(0, 1))

    def _fn(self, params, moments, grads, lr, step):
        names, io = self._names, self._io
        feeds = {**self._unused, io["lr"]: jnp.reshape(lr, self._lr_shape),
                 io["params"]: [params[n] for n in names],
                 io["grads"]: [grads[n] for n in names]}
        if io["step"] is not None:
            feeds[io["step"]] = step
        for key, name in zip(_MOMENTS, io["moments"]):
            feeds[name] = [moments[n][key] for n in names]
        _, updates = _run(self._program, feeds)
        new_params = dict(params)
        new_params.update(zip(names, updates[io["params"]]))
        new_moments = {n: dict(m) for n, m in moments.items()}
        for key, name in zip(_MOMENTS, io["moments"]):
            for n, v in zip(names, updates[name]):
                new_moments[n][key] = v
        return new_params, new_moments

    def step(self) -> None:
        """One update of every trainable parameter from its accumulated gradient."""
        state = self._state
        state._step += 1  # ORT's AdamW step input is 1-based; the op does not increment it
        lr = np.float32(self._lr)
        step = np.asarray([state._step], np.int64)
        params = {n: state._params[n] for n in self._names}
        frozen = {n: v for n, v in state._params.items() if n not in params}
        new_params, state._moments = self._step_fn(params, state._moments, state._grads, lr, step)
        state._params = {**frozen, **new_params}

    def set_learning_rate(self, learning_rate: float) -> None:
        self._lr = float(learning_rate)

    def get_learning_rate(self) -> float:
        return self._lr


class LinearLRScheduler:
    """Linear warm-up from 0 to `initial_lr`, then linear decay to 0, driven by the
    optimizer's step count: factor = step / warmup while step < warmup, else
    max(0, (total - step) / (total - warmup)).

    ORT 1.19.2's Python LinearLRScheduler swaps its two counts on the way to C++: measured with
    (warmup_step_count=4, total_step_count=6, initial_lr=1) it gives 0, 1/6, 2/6, ... 5/6, 0
    (a 6-step warm-up, then 0). `ort_order=True` (the default, so migrated scripts train
    exactly as they did) reproduces that; `ort_order=False` gives the documented schedule.
    """

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int,
                 initial_lr: float, *, ort_order: bool = True):
        if ort_order:
            warmup_step_count, total_step_count = total_step_count, warmup_step_count
        if warmup_step_count < 0 or total_step_count < 0:
            raise ValueError("step counts must be >= 0")
        self._optimizer = optimizer
        self._warmup, self._total, self._initial = warmup_step_count, total_step_count, initial_lr
        self.step()

    def _factor(self, step):
        if step < self._warmup:
            return step / max(1, self._warmup)
        return max(0.0, (self._total - step) / max(1, self._total - self._warmup))

    def step(self) -> None:
        """Sets the learning rate for the optimizer's next step."""
        self._optimizer.set_learning_rate(self._initial * self._factor(self._optimizer._state._step))


__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter"]
