"""Training artifacts from a forward ONNX model, for any model jaxops can import.

`onnxruntime.training.artifacts.generate_artifacts` builds its training graph with ORT's
gradient builder, which has no gradient for many ops (HardSwish in MobileNetV3, Softplus in
Mamba, Pow with a trainable exponent, ...). This module's `generate_artifacts` takes the same
arguments and writes the same files, but leaves the gradients to `jax.grad`: its training
model is the forward graph plus the loss, with no gradient ops, and `jaxops.onnx.training.Module`
differentiates it when it trains. Migrating is one import:

    from jaxops.onnx import artifacts          # was: from onnxruntime.training import artifacts

    artifacts.generate_artifacts("forward.onnx", requires_grad=["fc.weight", "fc.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory="out")

    from jaxops.onnx.training import CheckpointState, Module, Optimizer
    state = CheckpointState.load_checkpoint("out/checkpoint")
    module = Module("out/training_model.onnx", state, "out/eval_model.onnx")
    optimizer = Optimizer("out/optimizer_model.onnx", module)

or, without files, `state, module, optimizer = generate_artifacts(...).session()`.

What is written, as ORT writes it:
- `checkpoint`: ORT's checkpoint format; the `requires_grad` initializers are its trainable
  parameters, the `frozen_params` its frozen ones (ORT's Python API and jaxops read it).
- `eval_model.onnx`: the forward graph plus the loss; the parameters are graph inputs after the
  model's inputs and the loss's label input (`labels` for cross-entropy, `target` otherwise);
  Dropout and BatchNormalization set to inference. Other initializers stay in the graph.
- `training_model.onnx`: the same graph with the forward's training modes kept, except that
  BatchNormalization normalizes with the batch's statistics, as in ORT's training graph
  (`batch_norm="running"` keeps the running statistics instead); where ORT adds
  gradient, InPlaceAccumulatorV2 and `lazy_reset_grad` nodes and inputs, jaxops adds none (ORT's
  own Module cannot train it; jaxops' Module can).
- `optimizer_model.onnx`: ORT's optimizer graph: one com.microsoft AdamWOptimizer (inputs
  learning_rate, step, params, gradients, first_order_moments, second_order_moments; ORT's
  defaults betas (0.9, 0.999), eps 1e-6, weight_decay 0, bias correction, adam_mode 1) or
  SGDOptimizerV2 node, its inputs and attributes as ORT writes them.

Differences from ORT's: the loss may be a JAX callable (kept in memory, never written: pass it
to Module as `loss_fn=`); `requires_grad=None` trains every floating-point initializer but
those in `frozen_params` and BatchNormalization's running statistics (ORT trains none);
`artifact_directory=None` writes nothing (ORT writes to the working directory);
`batch_norm="running"` trains with BatchNorm's running statistics; the arguments are checked up
front with errors that name the culprit.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from jaxops.onnx import checkpoint as ckpt_format
from jaxops.onnx.registry import canonical_domain

# Written into a training/eval model whose loss is a JAX callable (the model holds only the
# forward graph): Module refuses to train such a model without a `loss_fn`.
LOSS_FN_KEY = "jaxops.loss_fn"

_REDUCTIONS = {"mean": "ReduceMean", "sum": "ReduceSum"}


class LossType(enum.Enum):
    """ORT's loss enum; each member builds the loss class of the same name with its defaults."""
    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(enum.Enum):
    """ORT's optimizer enum: `AdamW` is `AdamW()`, `SGD` is `SGD()`."""
    AdamW = 1
    SGD = 2


@dataclasses.dataclass(frozen=True)
class CrossEntropyLoss:
    """SoftmaxCrossEntropyLoss(scores, labels): scores [N, C, ...], int64 labels [N, ...]."""
    reduction: str = "mean"
    ignore_index: int | None = None
    labels_name: str = "labels"


@dataclasses.dataclass(frozen=True)
class MSELoss:
    """reduce((output - target)^2)."""
    reduction: str = "mean"
    target_name: str = "target"


@dataclasses.dataclass(frozen=True)
class L1Loss:
    """reduce(|output - target|)."""
    reduction: str = "mean"
    target_name: str = "target"


@dataclasses.dataclass(frozen=True)
class BCEWithLogitsLoss:
    """reduce(softplus(x) - x * target): binary cross-entropy of sigmoid(x), the same value
    as ORT's log-sigmoid graph without its overflow for large |x|."""
    reduction: str = "mean"
    target_name: str = "target"


@dataclasses.dataclass(frozen=True)
class AdamW:
    """ORT's AdamW block (hf/transformers AdamW, adam_mode 1) and its defaults."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    bias_correction: bool = True


@dataclasses.dataclass(frozen=True)
class SGD:
    """Plain SGD (SGDOptimizerV2): w -= lr * g."""


_LOSSES = {LossType.MSELoss: MSELoss, LossType.CrossEntropyLoss: CrossEntropyLoss,
           LossType.BCEWithLogitsLoss: BCEWithLogitsLoss, LossType.L1Loss: L1Loss}
_OPTIMS = {OptimType.AdamW: AdamW, OptimType.SGD: SGD}


@dataclasses.dataclass
class Artifacts:
    """What `generate_artifacts` made; `directory` is where it wrote them (None: nowhere).
    `loss_fn` is the JAX loss when one was given (it is not part of any file)."""
    training_model: onnx.ModelProto
    eval_model: onnx.ModelProto
    optimizer_model: onnx.ModelProto | None
    checkpoint: ckpt_format.Checkpoint
    loss_fn: Callable | None = None
    directory: Path | None = None

    def session(self, device=None):
        """(CheckpointState, Module, Optimizer or None) over these artifacts, in memory, on
        `device` (None: jax's default; see Module)."""
        from jaxops.onnx.training import CheckpointState, Module, Optimizer

        state = CheckpointState(copy.deepcopy(self.checkpoint))
        module = Module(self.training_model, state, self.eval_model, device=device,
                        loss_fn=self.loss_fn)
        optimizer = None if self.optimizer_model is None else Optimizer(self.optimizer_model,
                                                                         module)
        return state, module, optimizer


class _Names:
    """Fresh value names in ORT's style (onnx::loss::3) that the graph does not use yet."""

    def __init__(self, graph: onnx.GraphProto):
        self.used = {v for n in graph.node for v in (*n.input, *n.output)}
        self.used |= {v.name for v in (*graph.input, *graph.output, *graph.initializer)}
        self.count = 0

    def __call__(self, token: str) -> str:
        while True:
            self.count += 1
            name = f"onnx::{token}::{self.count}"
            if name not in self.used:
                self.used.add(name)
                return name


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _is_float(elem_type: int) -> bool:
    try:
        return bool(np.issubdtype(_np_dtype(elem_type), np.inexact)) or elem_type in (
            TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2)
    except (KeyError, ValueError, TypeError):
        return False


def _value_info(graph: onnx.GraphProto, name: str) -> onnx.ValueInfoProto:
    for v in (*graph.output, *graph.value_info, *graph.input):
        if v.name == name:
            return copy.deepcopy(v)
    return onnx.ValueInfoProto(name=name)


def _elem_type(graph, name) -> int:
    vi = _value_info(graph, name)
    return vi.type.tensor_type.elem_type or TensorProto.FLOAT


def _names_list(arg, what) -> list[str] | None:
    if arg is None:
        return None
    if isinstance(arg, str):
        raise TypeError(f"{what} must be a list of names, got the string {arg!r}")
    return list(arg)


def _add_input_like(graph, like: str, name: str, elem_type=None, drop_axis=None) -> str:
    """A graph input `name` typed like the value `like` (ORT's InputLike), unless the graph
    has a value of that name already (then the loss uses it, as ORT's blocks do)."""
    if any(v.name == name for v in (*graph.input, *graph.initializer)) or any(
            name in n.output for n in graph.node):
        return name
    vi = _value_info(graph, like)
    vi.name = name
    if elem_type is not None:
        vi.type.tensor_type.elem_type = elem_type
    if drop_axis is not None and vi.type.tensor_type.HasField("shape"):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) > drop_axis:
            del dims[drop_axis]
    graph.input.append(vi)
    return name


def _build_loss(graph, names, spec, inputs: list[str], opset: int) -> str:
    """Appends the loss nodes over the values `inputs`; returns the loss's name."""
    what = type(spec).__name__
    if spec.reduction not in _REDUCTIONS:
        raise ValueError(f"{what}: reduction must be 'mean' or 'sum' (a training loss is a "
                         f"scalar), got {spec.reduction!r}")
    x = inputs[0]

    def node(op, ins, token, **attrs):
        out = names(token)
        graph.node.append(helper.make_node(op, ins, [out], name=names(op), **attrs))
        return out

    if isinstance(spec, CrossEntropyLoss):
        if opset < 12:
            raise ValueError(f"CrossEntropyLoss is SoftmaxCrossEntropyLoss, an opset-12 op; "
                             f"the model imports ai.onnx opset {opset}")
        # int64 labels shaped like the scores without their class axis (1)
        labels = _add_input_like(graph, x, spec.labels_name, TensorProto.INT64, drop_axis=1)
        attrs = {"reduction": spec.reduction}
        if spec.ignore_index is not None:
            attrs["ignore_index"] = int(spec.ignore_index)
        loss, log_prob = names("loss"), names("log_prob")
        graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [x, labels],
                                           [loss, log_prob],
                                           name=names("SoftmaxCrossEntropyLoss"), **attrs))
        return loss
    target = _add_input_like(graph, x, spec.target_name)
    if isinstance(spec, MSELoss):
        diff = node("Sub", [x, target], "sub_output")
        per = node("Mul", [diff, diff], "square_output")
    elif isinstance(spec, L1Loss):
        per = node("Abs", [node("Sub", [x, target], "sub_output")], "abs_output")
    else:  # BCEWithLogitsLoss
        per = node("Sub", [node("Softplus", [x], "softplus_output"),
                           node("Mul", [x, target], "mul_output")], "sub_output")
    op = _REDUCTIONS[spec.reduction]
    return node(op, [per], op.lower() + "_output", keepdims=0)


def _disable_training_mode(graph: onnx.GraphProto) -> None:
    """Dropout and BatchNormalization in inference mode (what ORT's eval model runs)."""
    for n in graph.node:
        if n.op_type == "Dropout" and len(n.input) > 2:
            n.input[2] = ""
        elif n.op_type == "BatchNormalization":
            for a in n.attribute:
                if a.name == "training_mode":
                    a.i = 0


def _batch_norm_mode(graph: onnx.GraphProto, training_mode: int) -> None:
    """Sets every BatchNormalization's training_mode: 1 normalizes with the batch's statistics
    (ORT's training graph makes every one a BatchNormInternal with training_mode=1, whatever
    the export mode), 0 with the running ones. The running statistics are never updated (ORT
    does not update them either). Before opset 14 the attribute is outside the ONNX spec, but
    the importer reads it the same way."""
    for n in graph.node:
        if n.op_type == "BatchNormalization" and not canonical_domain(n.domain):
            for a in n.attribute:
                if a.name == "training_mode":
                    a.i = training_mode
                    break
            else:
                n.attribute.append(helper.make_attribute("training_mode", training_mode))


def _optimizer_model(spec, trainable: list[onnx.TensorProto], opset: int) -> onnx.ModelProto:
    elem = trainable[0].data_type
    seq = lambda name: helper.make_tensor_sequence_value_info(name, elem, None)
    inputs = [helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info("step", TensorProto.INT64, [1]),
              seq("params"), seq("gradients"), seq("first_order_moments")]
    if isinstance(spec, AdamW):
        inputs.append(seq("second_order_moments"))
        flag = "onnx::adamw.updated_flag::1"
        node = helper.make_node(
            "AdamWOptimizer", [i.name for i in inputs], [flag], name="onnx::AdamWOptimizer::2",
            domain="com.microsoft", alpha=float(spec.betas[0]), beta=float(spec.betas[1]),
            epsilon=float(spec.eps), weight_decay=float(spec.weight_decay),
            correct_bias=int(bool(spec.bias_correction)), adam_mode=1)
    elif isinstance(spec, SGD):
        flag = "onnx::update_completed::1"
        node = helper.make_node("SGDOptimizerV2", ["learning_rate", "params", "gradients"],
                                [flag], name="onnx::SGDOptimizerV2::2", domain="com.microsoft")
    else:
        raise TypeError(f"optimizer must be an OptimType, AdamW(...) or SGD(), got {spec!r}")
    graph = helper.make_graph([node], "graph", inputs,
                              [helper.make_tensor_value_info(flag, TensorProto.BOOL, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("", opset)])
    model.ir_version = 10  # as ORT 1.19.2 writes it; ORT refuses newer IR versions
    return model


def _loss_spec(loss):
    if loss is None or callable(loss) and not isinstance(loss, type):
        return loss
    if isinstance(loss, LossType):
        return _LOSSES[loss]()
    if isinstance(loss, tuple(_LOSSES.values())):
        return loss
    raise TypeError(f"loss must be a LossType, a loss such as CrossEntropyLoss(...), a JAX "
                    f"callable or None, got {loss!r}")


def generate_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | CrossEntropyLoss | MSELoss | L1Loss | BCEWithLogitsLoss | Callable
    | None = None,
    optimizer: OptimType | AdamW | SGD | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    additional_output_names: Sequence[str] | None = None,
    loss_input_names: Sequence[str] | None = None,
    *,
    batch_norm: str = "batch",
) -> Artifacts:
    """Training artifacts for a forward model, as ORT's `generate_artifacts` makes them (see the
    module docstring for what each holds and how they differ); returns them as an `Artifacts`
    and writes them to `artifact_directory` (`{prefix}training_model.onnx`,
    `{prefix}eval_model.onnx`, `{prefix}optimizer_model.onnx`, `{prefix}checkpoint`) if given.

    model: a ModelProto or a path (external data is read from the model's folder only).
    requires_grad: initializers to train (default: every floating-point initializer except
      those in `frozen_params` and BatchNormalization's running statistics; pass the list
      when other float initializers are constants, such as a Resize's scales).
    frozen_params: floating-point initializers to keep out of training but in the checkpoint
      (graph inputs, like the trainable ones). Initializers in neither list, integer ones
      (shapes, indices) among them, stay constants of the graph.
    loss: the loss over the model's first output (or `loss_input_names[0]`):
      LossType.CrossEntropyLoss / CrossEntropyLoss(reduction, ignore_index) adds an int64
      `labels` input; MSELoss, L1Loss and BCEWithLogitsLoss add a `target` input typed like
      the output. A JAX callable `loss(outputs, *labels) -> scalar` is kept in memory only:
      it receives the model's output (a tuple when several) and the extra arrays passed to
      `Module(...)(inputs..., labels...)`, whose number and names are its parameters after
      the first; the written models are the forward graph, and `Module` needs
      `loss_fn=<the same callable>`. None: the model's first output is the loss already.
    optimizer: OptimType.AdamW / AdamW(betas, eps, weight_decay, bias_correction), or
      OptimType.SGD / SGD(); None writes no optimizer model.
    additional_output_names: values the training and eval models return after the loss
      (ONNX losses only).
    loss_input_names: the values the loss takes (default: the model's outputs).
    batch_norm: how the training model's BatchNormalization layers normalize: "batch" (ORT's
      choice: the batch's statistics) or "running" (the running statistics, as an
      eval-mode export computes: fine-tuning with frozen statistics). The eval model uses
      the running statistics either way.
    """
    from jaxops.onnx.loader import read_model  # external data stays in the model's folder

    proto = onnx.ModelProto()
    proto.CopyFrom(read_model(model))
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if not canonical_domain(o.domain)), 0)
    requires_grad = _names_list(requires_grad, "requires_grad")
    frozen = _names_list(frozen_params, "frozen_params") or []
    if batch_norm not in ("batch", "running"):
        raise ValueError(f"batch_norm must be 'batch' or 'running', got {batch_norm!r}")
    spec = _loss_spec(loss)
    optim = _OPTIMS[optimizer]() if isinstance(optimizer, OptimType) else optimizer
    if optim is not None and not isinstance(optim, (AdamW, SGD)):
        raise TypeError(f"optimizer must be an OptimType, AdamW(...), SGD() or None, "
                        f"got {optim!r}")

    # ---- parameters
    inits = {t.name: t for t in graph.initializer}
    if requires_grad is None:
        stats = {i for n in graph.node if n.op_type == "BatchNormalization"
                 for i in n.input[3:5]}  # running mean and variance: statistics, not weights
        requires_grad = [n for n, t in inits.items()
                         if _is_float(t.data_type) and n not in frozen and n not in stats]
    for what, names in (("requires_grad", requires_grad), ("frozen_params", frozen)):
        unknown = [n for n in names if n not in inits]
        if unknown:
            known = ", ".join(list(inits)[:12]) + (", ..." if len(inits) > 12 else "")
            raise ValueError(f"{what} names {unknown}, which are not initializers of the model "
                             f"(its initializers: {known or 'none'})")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{what} names {dup} more than once")
    both = sorted(set(requires_grad) & set(frozen))
    if both:
        raise ValueError(f"{both} cannot be both trained (requires_grad) and frozen")
    for what, names in (("trained", requires_grad), ("frozen parameters", frozen)):
        not_float = [f"{n} ({TensorProto.DataType.Name(inits[n].data_type).lower()})"
                     for n in names if not _is_float(inits[n].data_type)]
        if not_float:  # (an integer one is shape data, read while tracing: keep it a constant)
            raise TypeError(f"only floating-point initializers can be {what}: {not_float}")
    if not requires_grad:
        raise ValueError("nothing to train: requires_grad is empty")
    if optim is not None and len({inits[n].data_type for n in requires_grad}) > 1:
        raise TypeError("the optimizer model takes one sequence of parameters of one dtype; "
                        "requires_grad mixes dtypes")

    # ---- the loss
    outputs = [o.name for o in graph.output]
    loss_inputs = _names_list(loss_input_names, "loss_input_names") or outputs
    produced = {v for n in graph.node for v in n.output}
    produced |= {i.name for i in graph.input} | set(inits)
    extra = _names_list(additional_output_names, "additional_output_names") or []
    if not loss_inputs:
        raise ValueError("the model has no outputs for the loss to take")
    missing = [n for n in (*loss_inputs, *extra) if n not in produced]
    if missing:
        raise ValueError(f"{missing} are not values of the model")
    names = _Names(graph)
    if callable(spec):
        if extra:
            raise ValueError("additional_output_names needs an ONNX loss; a JAX loss_fn "
                             "returns only the loss")
        if loss_input_names is not None:
            del graph.output[:]
            graph.output.extend(_value_info(graph, n) for n in loss_inputs)
        label = getattr(spec, "__qualname__", None) or type(spec).__name__
        helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props},
                                       LOSS_FN_KEY: label})
    else:
        if spec is None:
            loss_name = loss_inputs[0]
            loss_vi = _value_info(graph, loss_name)
        else:
            loss_name = _build_loss(graph, names, spec, loss_inputs, opset)
            elem = _elem_type(graph, loss_inputs[0])
            loss_vi = helper.make_tensor_value_info(loss_name, elem, [])
        del graph.output[:]
        graph.output.extend([loss_vi, *(_value_info(graph, n) for n in extra)])

    # ---- parameters become graph inputs (after the model's inputs and the labels)
    params = [t for t in graph.initializer if t.name in set(requires_grad) | set(frozen)]
    keep = [t for t in graph.initializer if t.name not in set(requires_grad) | set(frozen)]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    declared = {i.name for i in graph.input}
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                       for t in params if t.name not in declared)

    eval_model = copy.deepcopy(proto)
    _disable_training_mode(eval_model.graph)
    training_model = proto
    _batch_norm_mode(training_model.graph, int(batch_norm == "batch"))
    trainable = [t for t in params if t.name in set(requires_grad)]
    checkpoint = ckpt_format.Checkpoint(
        trainable={t.name: onnx.numpy_helper.to_array(t) for t in trainable},
        frozen={t.name: onnx.numpy_helper.to_array(t) for t in params if t.name in set(frozen)})
    optimizer_model = None if optim is None else _optimizer_model(optim, trainable, opset)
    out = Artifacts(training_model, eval_model, optimizer_model, checkpoint,
                    spec if callable(spec) else None)

    if artifact_directory is not None:
        d = Path(artifact_directory)
        d.mkdir(parents=True, exist_ok=True)
        onnx.save(training_model, d / f"{prefix}training_model.onnx")
        onnx.save(eval_model, d / f"{prefix}eval_model.onnx")
        ckpt_format.save(checkpoint, d / f"{prefix}checkpoint")
        if optimizer_model is not None:
            onnx.save(optimizer_model, d / f"{prefix}optimizer_model.onnx")
        out.directory = d
    return out


def loss_labels(loss_fn: Callable) -> list[str]:
    """The names of a JAX loss's label arguments: its required positional parameters after
    the first (the model's outputs)."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        raise TypeError(f"loss_fn {loss_fn!r}: its signature cannot be read; wrap it in a "
                        "function loss(outputs, label, ...)") from None
    ps = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in ps):
        raise TypeError("loss_fn must take a fixed number of arguments, loss(outputs, label, "
                        "...), so that Module knows its inputs; it takes *args")
    positional = [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if not positional:
        raise TypeError("loss_fn must take the model's outputs as its first argument")
    return positional[1:]


__all__ = ["AdamW", "Artifacts", "BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "LossType",
           "MSELoss", "OptimType", "SGD", "generate_artifacts"]
