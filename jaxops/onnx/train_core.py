"""The functional core of the training API: a state pytree and pure step functions.

`jaxops.onnx.training` (ORT's CheckpointState / Module / Optimizer) and `DataParallel` are
thin stateful wrappers over this module; use it directly to put whole training steps, or a
loop of them, in one jitted function:

    state = TrainState.from_checkpoint(checkpoint.load("artifacts/checkpoint"))
    model = TrainingModel("artifacts/training_model.onnx", state)
    optimizer = OptimizerModel("artifacts/optimizer_model.onnx", model)
    state = optimizer.init(model.init(state))          # zero gradients and moments
    step = jax.jit(Trainer(model, optimizer).step, donate_argnums=0)
    for x, y in data:
        (loss,), state = step(state, [x, y], lr)       # forward, backward, optimizer

Every function here is pure: it takes a `TrainState` and returns a new one, so it runs under
`jax.jit` (donate the state: ORT's in-place updates become XLA's buffer aliasing), inside
`lax.scan` (`Trainer.steps`) and inside `shard_map` (`DataParallel`). The model objects hold
only the imported programs and the names they read: nothing of theirs changes after
construction.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from jaxops._src.compat import mark_varying, varying_axes
from jaxops.onnx import checkpoint as ckpt_format
from jaxops.onnx.packed import PackedState

BUFFER_SUFFIX = "_grad.accumulation.buffer"
RESET_INPUT = "lazy_reset_grad"
GROUP = "group0"  # ORT's artifacts have one optimizer group
MOMENTS = ("momentum0", "momentum1")  # the checkpoint's names for AdamW's two moments



@functools.cache
def _optimizers() -> dict:
    """The optimizer ops the training API runs: op_type -> the input index of each role (lr,
    step, params, grads, moments), from the specs' `roles` (the importer returns the new
    params and moments, which ORT writes in place, under these inputs' names)."""
    from jaxops import ops

    layouts = {}
    for (domain, op_type), fn in ops.ORT_OPS.items():
        spec = fn.spec
        if spec.roles:
            index = lambda n: None if n is None else spec.input_index(n)
            layouts[op_type] = {role: tuple(map(index, n)) if isinstance(n, tuple) else index(n)
                                for role, n in spec.roles.items()}
    return layouts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training step reads and writes, as a pytree of arrays.

    params: the trainable parameters (the checkpoint's requires_grad ones), by name.
    frozen: the other parameters. The split is the pytree's structure, so it is static
      under jit, as every name below is.
    grads: the accumulated gradient of each parameter the training model trains.
    moments: the optimizer's state per parameter: {"momentum0": m1, "momentum1": m2} for
      AdamW, nothing for SGD.
    step: the optimizer steps taken (ORT's optimizer-group step; AdamW runs step + 1).
    """
    params: dict[str, Any]
    frozen: dict[str, Any]
    grads: dict[str, Any]
    moments: dict[str, dict[str, Any]]
    step: Any

    @classmethod
    def from_checkpoint(cls, checkpoint: ckpt_format.Checkpoint) -> TrainState:
        group = checkpoint.optimizer.get(GROUP, ckpt_format.OptimizerGroup())
        arrays = lambda d: {k: jnp.asarray(v) for k, v in d.items()}
        return cls(params=arrays(checkpoint.trainable), frozen=arrays(checkpoint.frozen),
                   grads={}, moments={p: arrays(m) for p, m in group.states.items()},
                   step=np.int64(group.step))

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    def param(self, name: str):
        """A parameter, trainable or frozen."""
        return self.params[name] if name in self.params else self.frozen[name]

    def with_params(self, values: dict) -> TrainState:
        """New values for some parameters, each kept where it is (trainable or frozen)."""
        params, frozen = dict(self.params), dict(self.frozen)
        for name, value in values.items():
            (params if name in params else frozen)[name] = value
        return self.replace(params=params, frozen=frozen)


def _model(uri) -> onnx.ModelProto:
    return uri if isinstance(uri, onnx.ModelProto) else onnx.load(os.fspath(uri))


def _load_program(model: onnx.ModelProto, precision=None):
    from jaxops.onnx import load  # the importer; imported late to keep this module light
    return load(model, precision=precision)


def _run(program, feeds: dict) -> tuple[dict, dict]:
    """Runs an imported program on named inputs: (outputs by name, in-place updates by the
    name of the input they replace)."""
    outs, updates = program.run_with_updates(program.params,
                                             *[feeds[n] for n in program.input_names])
    return dict(zip(program.output_names, outs)), updates


def check_inputs(names: list[str], inputs) -> None:
    if len(inputs) != len(names):
        raise TypeError(f"expected {len(names)} inputs {names}, got {len(inputs)}")


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


class TrainingModel:
    """The pure train and eval steps of a training model (and optionally its eval model).

    Two kinds of training model train here. ORT's (from onnxruntime's `generate_artifacts`)
    holds its own backward graph: gradient ops, InPlaceAccumulatorV2 into
    `<param>_grad.accumulation.buffer` inputs, a `lazy_reset_grad` input. A forward-only
    training model (from `jaxops.onnx.artifacts.generate_artifacts`, or any graph whose
    parameters are inputs) has none of these: its first output is the loss, or `loss_fn`
    computes the loss from its outputs, and the train step takes `jax.grad` of it with respect
    to the state's trainable parameters, accumulated as InPlaceAccumulatorV2 does.

    `state` names the parameters (graph inputs that are in it are parameters); its values are
    not kept. loss_fn: `loss_fn(outputs, *labels) -> scalar` for a forward-only model (see
    `jaxops.onnx.training.Module`). precision: the training and eval programs' (None or
    "bf16", `jaxops.onnx.load`); the optimizer model stays float32.

    Attributes: `program` / `eval_program` (the imported graphs), `param_names` (the
    parameters the training model reads, in its input order), `trained` (those it trains:
    the gradients' names), `input_names` / `output_names` (a train step's), `eval_input_names`
    / `eval_output_names`, `forward_only`.
    """

    def __init__(self, training_model, state: TrainState, eval_model=None, *, loss_fn=None,
                 precision=None):
        model = _model(training_model)
        self.program = _load_program(model, precision)
        names = {**state.params, **state.frozen}
        graph_inputs = [i.name for i in model.graph.input]
        self.param_names = [n for n in graph_inputs if n in names]
        self.forward_only = not any(n.endswith(BUFFER_SUFFIX) or n == RESET_INPUT
                                    for n in graph_inputs)
        self.loss_fn, labels = loss_fn, []
        if self.forward_only:
            labels = self._check_forward_model(model, state, loss_fn)
            self._buffers = {}
            self.trained = [p for p in self.param_names if p in state.params]
            known = set(self.param_names)
            self.output_names = list(self.program.output_names)
        else:
            if loss_fn is not None:
                raise ValueError("loss_fn is for forward-only training models; this one is "
                                 "ORT's, with its loss and gradient graph built in")
            self._buffers = {b[:-len(BUFFER_SUFFIX)]: b for b in graph_inputs
                             if b.endswith(BUFFER_SUFFIX)}
            missing = [p for p in self._buffers if p not in names]
            if missing:
                raise ValueError(f"the training model accumulates gradients of {missing}, "
                                 "which the checkpoint does not hold")
            self.trained = list(self._buffers)
            known = set(self.param_names) | set(self._buffers.values()) | {RESET_INPUT}
            self.output_names = [o for o in self.program.output_names
                                 if not o.endswith("_grad.accumulation.out")]
        self._model_inputs = [n for n in graph_inputs if n not in known]
        self.input_names = self._model_inputs + labels
        if loss_fn is not None:
            self.output_names = ["loss"]
        self.eval_program = None
        if eval_model is not None:
            emodel = _model(eval_model)
            self.eval_program = _load_program(emodel, precision)
            self._eval_model_inputs = [i.name for i in emodel.graph.input if i.name not in names]
            self.eval_input_names = self._eval_model_inputs + labels
            self.eval_output_names = (["loss"] if loss_fn is not None
                                      else list(self.eval_program.output_names))

    @staticmethod
    def _check_forward_model(model, state, loss_fn) -> list[str]:
        """Checks a forward-only training model against the state; returns the label names."""
        from jaxops.onnx.artifacts import LOSS_FN_KEY, loss_labels
        meta = {p.key: p.value for p in model.metadata_props}
        if loss_fn is None and LOSS_FN_KEY in meta:
            raise ValueError(f"this training model was generated with the JAX loss "
                             f"{meta[LOSS_FN_KEY]!r}, which ONNX cannot hold: pass it as "
                             "Module(..., loss_fn=...)")
        inputs = {i.name for i in model.graph.input}
        absent = [p for p in state.params if p not in inputs]
        if absent:
            raise ValueError(f"the checkpoint trains {absent}, which are not inputs of the "
                             "training model")
        if not state.params:
            raise ValueError("the checkpoint has no trainable parameter that the training "
                             "model takes")
        bad = [f"{p} ({v.dtype})" for p, v in state.params.items()
               if not jnp.issubdtype(v.dtype, jnp.inexact)]
        if bad:
            raise TypeError(f"only floating-point parameters can be trained: {bad}")
        return [] if loss_fn is None else loss_labels(loss_fn)

    def init(self, state: TrainState) -> TrainState:
        """The state with zero gradients for the trained parameters that have none."""
        grads = {p: state.grads[p] if p in state.grads else jnp.zeros_like(state.param(p))
                 for p in self.trained}
        return state.replace(grads=grads)

    def train_step(self, state: TrainState, inputs, reset=False) -> tuple[list, TrainState]:
        """Forward and backward on `inputs` (`input_names`): (the outputs, loss first; the
        state with the new gradients added to the old, or replacing them where `reset`)."""
        check_inputs(self.input_names, inputs)
        if self.forward_only:
            outs, grads = self._grad_step(state, inputs)
            if reset is not True:  # InPlaceAccumulatorV2: g on a reset, buffer + g otherwise
                grads = {p: jnp.where(reset, g, state.grads[p] + g) for p, g in grads.items()}
            return outs, state.replace(grads=grads)
        feeds = dict(zip(self.input_names, inputs))
        feeds.update({n: state.param(n) for n in self.param_names})
        feeds.update({self._buffers[p]: state.grads[p] for p in self.trained})
        feeds[RESET_INPUT] = jnp.reshape(jnp.asarray(reset), (1,))
        out, updates = _run(self.program, feeds)
        grads = {p: updates[b] for p, b in self._buffers.items()}
        return [out[o] for o in self.output_names], state.replace(grads=grads)

    def _outputs(self, program, model_inputs, params, inputs) -> list:
        """[loss, other outputs...] of a forward-only program (with loss_fn: [loss])."""
        n = len(model_inputs)
        feeds = dict(zip(model_inputs, inputs[:n]))
        feeds.update({k: params[k] for k in program.input_names if k in params})
        out, _ = _run(program, feeds)
        outs = [out[o] for o in program.output_names]
        if self.loss_fn is None:
            return outs
        return [self.loss_fn(outs[0] if len(outs) == 1 else tuple(outs), *inputs[n:])]

    def _grad_step(self, state, inputs):
        params = {**state.frozen, **state.params}

        def loss_of(trainable):
            outs = self._outputs(self.program, self._model_inputs, {**params, **trainable},
                                 inputs)
            return _scalar_loss(outs[0], self.loss_fn is not None), outs

        # Inside shard_map (DataParallel), params are the same on every device and the inputs
        # vary: jax.grad would sum the gradient over the devices itself. Marked as varying,
        # each device gets its own gradient, and the caller decides how to reduce them.
        axes = frozenset().union(*(varying_axes(x) for x in inputs))
        trainable = {p: mark_varying(params[p], axes - varying_axes(params[p]))
                     for p in self.trained}
        grads, outs = jax.grad(loss_of, has_aux=True)(trainable)
        return outs, grads

    def eval_step(self, state: TrainState, inputs) -> list:
        """The eval model's outputs on `inputs` (`eval_input_names`)."""
        if self.eval_program is None:
            raise RuntimeError("this Module has no eval model")
        check_inputs(self.eval_input_names, inputs)
        params = {**state.frozen, **state.params}
        if self.forward_only:
            return self._outputs(self.eval_program, self._eval_model_inputs, params, inputs)
        feeds = dict(zip(self.eval_input_names, inputs))
        feeds.update({n: params[n] for n in self.eval_program.input_names if n in params})
        out, _ = _run(self.eval_program, feeds)
        return [out[o] for o in self.eval_output_names]


def _optimizer_node(model: onnx.ModelProto) -> onnx.NodeProto:
    known = _optimizers()
    nodes = [n for n in model.graph.node if n.op_type in known]
    if len(nodes) != 1:
        raise ValueError(f"expected one optimizer node ({', '.join(known)}) in the "
                         f"optimizer model, found {len(nodes)}")
    return nodes[0]


def _placeholder(t: onnx.TypeProto):
    """A value of type `t` for an input that nothing reads: [] for a sequence, else zeros."""
    if t.HasField("sequence_type"):
        return []
    tt = t.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type or onnx.TensorProto.FLOAT)
    return np.zeros([d.dim_value or 1 for d in tt.shape.dim], dtype)


class OptimizerModel:
    """The pure update of an optimizer model (AdamWOptimizer or SGDOptimizerV2) over the
    parameters a TrainingModel trains (`names`, its `trained`)."""

    def __init__(self, optimizer_model, training: TrainingModel):
        model = _model(optimizer_model)
        node = _optimizer_node(model)
        layout = _optimizers()[node.op_type]
        name = lambda i: None if i is None else node.input[i]
        self._io = {"lr": name(layout["lr"]), "step": name(layout["step"]),
                    "params": name(layout["params"]), "grads": name(layout["grads"]),
                    "moments": [name(i) for i in layout["moments"]]}
        self.program = _load_program(model)
        # ORT's optimizer models are the one node; anything around it could depend on how the
        # parameters are cut into tensors, so only the one node updates packed buffers as is
        self._elementwise = (len(model.graph.node) == 1
                             and node.op_type in ("AdamWOptimizer", "SGDOptimizerV2"))
        # inputs the node does not read (ORT's SGD model declares step and
        # first_order_moments): fed placeholders of their declared kind
        self._unused = {i.name: _placeholder(i.type) for i in model.graph.input
                        if i.name not in node.input}
        declared = {i.name: i.type.tensor_type for i in model.graph.input}
        lr_type = declared.get(self._io["lr"])  # ORT's models declare lr as [1]
        self._lr_shape = ((1,) * len(lr_type.shape.dim) if lr_type is not None
                          and lr_type.HasField("shape") else ())
        self.training = training
        self.names = list(training.trained)  # training-model order

    def init(self, state: TrainState) -> TrainState:
        """The state with zero moments where the optimizer keeps some and the state has none
        (a fresh checkpoint)."""
        if not self._io["moments"]:
            return state
        moments = {n: dict(m) for n, m in state.moments.items()}
        for p in self.names:
            for k in MOMENTS:
                moments.setdefault(p, {}).setdefault(k, jnp.zeros_like(state.param(p)))
        return state.replace(moments=moments)

    def update(self, state: TrainState, lr) -> TrainState:
        """One optimizer step at learning rate `lr` (a scalar) from the accumulated
        gradients: new parameters and moments, step + 1 (ORT's AdamW takes the 1-based step
        it is on)."""
        names, step = self.names, state.step + 1
        moments = [[state.moments[n][key] for n in names] for key in self._moment_keys()]
        params, new_moments = self._apply(
            lr, step, [state.param(n) for n in names],
            [state.grads[n] for n in names], moments)
        out = {n: dict(m) for n, m in state.moments.items()}
        for key, values in zip(MOMENTS, new_moments):
            for n, v in zip(names, values):
                out[n][key] = v
        new = state.with_params(dict(zip(names, params)))
        return new.replace(moments=out, step=step)

    def update_packed(self, state: PackedState, lr) -> PackedState:
        """`update` on a PackedState. The optimizer graph is one AdamW or SGD node (ORT's),
        elementwise, so each dtype's flat buffers are updated as one tensor: the same values,
        four buffers a dtype instead of four a parameter."""
        keys = self._moment_keys()
        if not self._elementwise or (keys and set(state.moments) != set(keys)):
            new = self.update(state.unpack(), lr)
            return PackedState.pack(new, list(state.trained_names))
        dtypes = [key for key, _ in state.layout.groups]
        params, moments = self._apply(
            lr, state.step + 1, [state.trained[d] for d in dtypes],
            [state.grads[d] for d in dtypes],
            [[state.moments[k][d] for d in dtypes] for k in keys])
        return state.replace(trained=dict(zip(dtypes, params)),
                             moments={k: dict(zip(dtypes, m)) for k, m in zip(keys, moments)},
                             step=state.step + 1)

    def _moment_keys(self) -> tuple[str, ...]:
        return MOMENTS[:len(self._io["moments"])]

    def _apply(self, lr, step, params: list, grads: list, moments: list[list]):
        """The optimizer graph on lists: (new params, new moments per moment key)."""
        io = self._io
        lr = jnp.reshape(jnp.asarray(lr, jnp.float32), self._lr_shape)  # the ops' lr: float
        feeds = {**self._unused, io["lr"]: lr, io["params"]: params, io["grads"]: grads}
        if io["step"] is not None:
            feeds[io["step"]] = jnp.reshape(step, (1,))
        feeds.update(zip(io["moments"], moments))
        _, updates = _run(self.program, feeds)
        return updates[io["params"]], [updates[name] for name in io["moments"]]


class Trainer:
    """Whole training steps: a TrainingModel's train step, then an OptimizerModel's update."""

    def __init__(self, training: TrainingModel, optimizer: OptimizerModel):
        if optimizer.training is not training:
            raise ValueError("the optimizer belongs to another training model")
        self.training, self.optimizer = training, optimizer

    def step(self, state: TrainState, inputs, lr) -> tuple[list, TrainState]:
        """Forward, backward (the gradients start over: no accumulation), optimizer update:
        ORT's `module(*inputs); optimizer.step(); module.lazy_reset_grad()`."""
        outs, state = self.training.train_step(state, inputs, reset=True)
        return outs, self.optimizer.update(state, lr)

    def steps(self, state: TrainState, inputs, lr) -> tuple[list, TrainState]:
        """len(lr) whole steps in one `lax.scan`: each of `inputs` stacked on a leading axis
        of steps, `lr` one per step. Returns (the outputs stacked the same way, the state)."""
        def body(state, xs):
            outs, state = self.step(state, *xs)
            return state, outs

        state, outs = jax.lax.scan(body, state, (list(inputs), jnp.asarray(lr)))
        return outs, state


__all__ = ["OptimizerModel", "TrainState", "Trainer", "TrainingModel", "check_inputs"]
