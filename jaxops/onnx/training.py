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
step is one jit-compiled function whose old buffers are donated, so the update happens in
place on the device; an optimizer step goes into the next train call's function (or runs on
its own when anything reads the state first), so that a step of the loop is one dispatch.

Models ORT cannot differentiate (HardSwish, Softplus, a trainable Pow exponent, ...) train
from their forward graph: `jaxops.onnx.artifacts.generate_artifacts` writes the same four
artifacts with a training model that is the forward graph plus the loss, and `Module` takes
`jax.grad` of it (see `Module` and docs/training.md).

The classes are thin stateful wrappers over `jaxops.onnx.train_core`: CheckpointState holds a
`TrainState` pytree (`state.train_state`), Module and Optimizer call jitted pure functions of
it (`module.core`, a TrainingModel; `optimizer.core`, an OptimizerModel). A whole step, or a
loop of steps, as one jitted function: `train_core.Trainer(module.core, optimizer.core)`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import MutableMapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.cpu import (concurrent_scheduler, cpu_device, jit_options, jit_options_for,
                        traced_with_kernel_threads, xla_threads)
from jaxops.onnx import checkpoint as ckpt_format
from jaxops.onnx.packed import PackedState
from jaxops.onnx.program import POLL_MAX_FLOPS, cost, may_move, polls, wait_polling
from jaxops.onnx.train_core import GROUP, OptimizerModel, TrainingModel, TrainState


_pack = jax.jit(PackedState.pack, static_argnums=1)
_unpack = jax.jit(PackedState.unpack)


class Parameter:
    """One parameter of a CheckpointState (ORT's `Parameter`)."""

    def __init__(self, state: CheckpointState, name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return np.asarray(self._state.train_state.param(self.name))

    @property
    def requires_grad(self) -> bool:
        return self.name in self._state.train_state.params

    @property
    def grad(self) -> np.ndarray | None:
        g = self._state.train_state.grads.get(self.name)
        return None if g is None else np.asarray(g)

    def copy_from(self, data) -> None:
        ts = self._state.train_state
        old, data = ts.param(self.name), np.asarray(data)
        if data.shape != old.shape or data.dtype != old.dtype:
            raise ValueError(f"parameter {self.name!r} is {old.dtype}{list(old.shape)}, "
                             f"got {data.dtype}{list(data.shape)}")
        self._state.train_state = ts.with_params({self.name: jnp.asarray(data)})

    def __repr__(self):
        return f"Parameter({self.name!r}, requires_grad={self.requires_grad})"


class _Parameters(MutableMapping):
    def __init__(self, state):
        self._state = state

    def _names(self):
        ts = self._state.train_state
        return {**ts.params, **ts.frozen}

    def __getitem__(self, name):
        if name not in self._names():
            raise KeyError(name)
        return Parameter(self._state, name)

    def __setitem__(self, name, value):
        self[name].copy_from(value)

    def __delitem__(self, name):
        raise TypeError("parameters cannot be removed from a checkpoint state")

    def __iter__(self):
        return iter(self._names())

    def __len__(self):
        return len(self._names())


class _Properties(MutableMapping):
    def __init__(self, props: dict):
        self._props = props

    def __getitem__(self, name):
        return self._props[name]

    def __setitem__(self, name, value):
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            raise TypeError(f"property {name!r} must be an int, float or str, "
                            f"got {type(value).__name__}")
        self._props[name] = value

    def __delitem__(self, name):
        del self._props[name]

    def __iter__(self):
        return iter(self._props)

    def __len__(self):
        return len(self._props)


class CheckpointState:
    """Parameters, gradients, optimizer state and properties, shared by Module and Optimizer.

    train_state: the arrays, a `train_core.TrainState` (replaced, never changed in place, by
      each step). The classes keep its `step` a host number, so that reading it (the LR
      scheduler, checkpoints) never waits for the device. Between steps the arrays live
      packed, one flat buffer per dtype and kind (`jaxops.onnx.packed`), so that a step hands
      its jitted function a few buffers rather than four per parameter; reading
      `train_state` unpacks them (one jitted copy, kept until the next step).
    initial_learning_rate: the optimizer group's, saved with the optimizer state.
    """

    @property
    def train_state(self) -> TrainState:
        self._issue_pending()
        if self._state is None:
            self._state = _unpack(self._packed.replace(step=None)).replace(
                step=self._packed.step)
        return self._state

    @train_state.setter
    def train_state(self, state: TrainState) -> None:
        # the new state replaces what a pending optimizer step would have made: it is dropped
        self._state, self._packed, self._pending = state, None, None

    def _packed_state(self, trained: tuple[str, ...]) -> PackedState:
        """The state packed with `trained` (a training model's) as the main layout."""
        self._issue_pending()
        packed = self._packed
        if packed is None or (packed.trained_names is not trained
                              and packed.trained_names != trained):
            ts = self.train_state
            self._packed = _pack(ts.replace(step=None), trained).replace(step=ts.step)
        return self._packed

    def _set_packed(self, packed: PackedState) -> None:
        self._packed, self._state = packed, None

    def _issue_pending(self) -> None:
        """Runs the optimizer step that waits for the next train call (Optimizer.step), for
        anything that reads the state in between (a new train_state drops it instead)."""
        if self._pending is not None:
            self._pending._issue()

    def _step_count(self):
        """The optimizer steps taken, a pending one included, without running it (the LR
        scheduler reads this between optimizer.step() and the next train call)."""
        return (self._state if self._packed is None else self._packed).step

    def block_until_ready(self) -> CheckpointState:
        """Runs a pending optimizer step and waits for the steps that write this state (for
        timing a loop of steps)."""
        self._issue_pending()
        jax.block_until_ready(self._packed if self._state is None else self._state)
        return self

    def __init__(self, checkpoint: ckpt_format.Checkpoint):
        # (train_state's setter also sets _pending: an Optimizer whose step is not issued yet)
        self.train_state = TrainState.from_checkpoint(checkpoint)
        group = checkpoint.optimizer.get(GROUP, ckpt_format.OptimizerGroup())
        self.initial_learning_rate = float(group.initial_learning_rate)
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
        return _Properties(self._properties)

    def _to_checkpoint(self, include_optimizer_state):
        ts = self.train_state
        host = lambda d: {k: np.asarray(v) for k, v in d.items()}
        out = ckpt_format.Checkpoint(trainable=host(ts.params), frozen=host(ts.frozen),
                                     properties=dict(self._properties))
        if include_optimizer_state and ts.moments:
            out.optimizer[GROUP] = ckpt_format.OptimizerGroup(
                int(ts.step), self.initial_learning_rate,
                {p: host(m) for p, m in ts.moments.items()})
        return out


def _matrices(core, state) -> frozenset[str]:
    """The parameters a step on a CPU takes out of the packed buffers in one kernel call a
    dtype (PackedState.unpack): the matrices (rank 2 and more) no Gather reads. XLA:CPU
    copies each slice in a thunk of its own (with the transpose a MatMul of the torch exports
    applies), all ready at the program's start, and its executor hands some of them to a pool
    thread: a hand-off, and on one core a context switch (jaxops/ops/ranges.py). A Gather's
    table stays a slice, which XLA fuses into the Gather (a copy would be the whole table's)."""
    gathered = {n.input[0] for p in (core.program, core.eval_program) if p is not None
                for n in p.model.graph.node if n.op_type in _GATHERS and n.input}
    arrays = {**state.params, **state.frozen}
    return frozenset(n for n, x in arrays.items() if jnp.ndim(x) >= 2 and n not in gathered)


@dataclasses.dataclass(frozen=True, eq=False)
class _Placement:
    """Where a Module's steps run and how they are traced: `device` (None: jax's default),
    the matrices each step kind takes out of the packed buffers there (`taken`: `_matrices`
    on a CPU), and the threads of jaxops' CPU kernels inside the steps."""
    device: jax.Device | None
    taken: dict[str, frozenset[str]]
    kernel_threads: int

    @classmethod
    def of(cls, device, matrices: frozenset[str], kernel_threads: int = 1) -> _Placement:
        """The placement on `device` of a Module whose `_matrices` are `matrices`. An eval
        step on one thread takes them only where XLA schedules for concurrency (its default;
        not after configure_cpu): there its copies were ready at once, A/B on 2 vCPUs
        (2026-11-29): llama_ts, gpt2_ts, vit_ts, distilbert_ts evals 0.56-0.69x the time
        (train steps 0.96-0.99x); with the memory-minimizing scheduler evals took
        0.96-1.09x, train steps 0.93-1.00x (one core) and 0.96-0.99x (two)."""
        platform = device.platform if device is not None else jax.default_backend()
        if platform != "cpu":
            matrices = frozenset()
        eval_taken = concurrent_scheduler() or xla_threads(device) > 1
        return cls(device, {"train": matrices, "eval": matrices if eval_taken else frozenset()},
                   kernel_threads)

    def jit(self, step, args, **kwargs):
        """jax.jit of a step placed here, with the jit_options its jaxpr on `args` asks for on
        a one-thread CPU, traced under kernel_threads. With a device the step places its
        arguments there itself: numpy inputs go straight to it, arrays elsewhere move (a
        jax.device_put of the inputs first cost 90-170 us a step on a CPU, gpt2_ts, one core,
        more than the eval step's program)."""
        place = {}
        if self.device is not None:
            on = jax.sharding.SingleDeviceSharding(self.device)
            place = {"in_shardings": on, "out_shardings": on}
        step = traced_with_kernel_threads(step, self.kernel_threads)
        return jax.jit(step, **kwargs, **place, **jit_options_for(self.device, step, args))


_GATHERS = frozenset({"Gather", "GatherElements", "GatherND"})


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


class _EvalAt:
    """A Module's eval step placed on `device` (Module._place_eval), with a copy of the
    parameters' buffers there, made again where they are new (after a train step: a packed
    state keeps its buffers until then; ResNet's 341 KB, 18 us). It keeps the packed state
    it copied (to know it again): at most one old state more until the next eval call."""

    def __init__(self, module, device):
        self._device = device
        at = _Placement.of(device, module._matrices, xla_threads())
        self._steps = _Steps(functools.partial(module._make_step, at=at))
        self._source = self._copy = None

    def __call__(self, packed, inputs):
        if self._source is not packed:
            self._copy = jax.device_put((packed.trained, packed.rest), self._device)
            self._source = packed
        return self._steps.call("eval", packed, *self._copy, inputs)[0]


class _Steps:
    """Jitted steps by kind and packed layouts, each made once by `make(kind, static)`. The
    layouts of the state last seen are recognized by identity (the packed state keeps its
    layout objects from step to step), not by hash: hashing them cost 2 us a call."""

    def __init__(self, make):
        self._make, self._fns, self._last = make, {}, {}
        self._polls = {}  # step -> whether its calls wait by polling (program.polls)

    def call(self, kind: str, packed: PackedState, *args, wait: bool = True):
        """(The step `kind`'s outputs on `args`, whether the step is small: program.polls).
        With `wait`, a small step returns when its outputs are ready (program.wait_polling),
        as ORT's calls do, sparing the cross-core wakes of XLA:CPU's async dispatch."""
        fn = self.get(kind, packed, args)
        small = self._polls.get(fn)
        if small is None:  # before the first call, which may donate the buffers; cached after
            small = self._polls[fn] = polls(fn.lower(*args).compile())
        out = fn(*args)
        if wait and small:
            wait_polling(out)
        return out, small

    def get(self, kind: str, packed: PackedState, args=None):
        """The step `kind` for `packed`'s layouts; made (on `args`, its arguments: they are
        needed then) where there is none yet."""
        last = self._last.get(kind)
        if (last is not None and last[0] is packed.layout and last[1] is packed.rest_layout
                and last[2] is packed.order):
            return last[3]
        static = packed.static
        fn = self._fns.get((kind, static))
        if fn is None:
            fn = self._fns[kind, static] = self._make(kind, static, args)
        self._last[kind] = (*static, fn)
        return fn


# A step this small (XLA's cost analysis; the corpus's train steps are 2.3-11 MFLOP, ResNet's 555:
# jaxops/onnx/program.py's POLL_MAX_FLOPS) runs faster on one thread than with XLA's pool.
SMALL_FLOPS = POLL_MAX_FLOPS


def _session_device(options, device):
    """The Module's device under ORT's session_options: a CPU device whose XLA runs
    intra_op_num_threads threads (cpu_device), unless that is 0 (ORT's default, every core:
    XLA's default client), the process already runs that many (configure_cpu before jax
    started), or the Module runs off the CPU."""
    threads = getattr(options, "intra_op_num_threads", 0) if options is not None else 0
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"Module: session_options.intra_op_num_threads must be an int >= 0, "
                         f"got {threads!r}")
    if threads == 0 or os.environ.get("PJRT_NPROC") == str(threads):
        return device
    resolved = _device(device)
    if (resolved.platform if resolved is not None else jax.default_backend()) != "cpu":
        return device
    return cpu_device(threads)


class Module:
    """A training model (and optionally its eval model) bound to a CheckpointState.

    Trains ORT's artifacts (with their backward graph) and forward-only training models
    (`jax.grad` of the loss), as `train_core.TrainingModel` describes; either way one train
    call is one jit-compiled function with the old state donated.

    loss_fn: a JAX loss for a forward-only model, `loss_fn(outputs, *labels) -> scalar`:
      `outputs` is the model's output (a tuple when it has several), `labels` the arguments
      given to the call after the model's inputs; their names (`input_names()`) are loss_fn's
      parameters after the first. A JAX callable cannot be written to ONNX, so it is passed
      here each time the artifacts are loaded. It also gives the eval model's result.
    device: where the parameters and the steps live: None (jax's default device, a GPU where
      jax has one), a jax.Device, or ORT's names 'cpu', 'cuda', 'cuda:N'.
    precision: None (float32, as the graphs say) or "bf16" (mixed precision of the training
      and eval graphs; parameters, gradients and the optimizer stay float32): see
      `jaxops.onnx.load`.
    session_options: ORT's argument (an `onnxruntime.SessionOptions` or anything with an
      `intra_op_num_threads`): on a CPU, a count above 0 places this Module's state and steps
      on `jaxops.cpu_device(count)`, an XLA:CPU client of their own with that many threads
      (one: each call on the calling thread), as an ORT session's own thread pool; jax's
      default client and other Modules keep theirs. Other options have no XLA counterpart
      and are ignored.

    state: the CheckpointState; core: the TrainingModel whose pure steps this calls.
    """

    def __init__(self, train_model_uri, state: CheckpointState, eval_model_uri=None,
                 device: str | jax.Device | None = None, session_options=None, *,
                 loss_fn=None, precision=None):
        self.state = state
        placed = _session_device(session_options, device)
        # placed by default (None, or ORT's "cpu") on jax's default CPU client with XLA's
        # threads, a Module whose step is small moves to a one-thread client of its own at
        # its first call (_move_if_small)
        ts = state.train_state
        self._may_move = ((device is None or str(device).lower() == "cpu") and placed is device
                          and may_move(ts))
        # the eval step's own placement (an _EvalAt, or None: the Module's), decided at the
        # first eval call of a Module that may move (_place_eval)
        self._eval_undecided, self._eval_at = self._may_move, None
        self.core = TrainingModel(train_model_uri, ts, eval_model_uri, loss_fn=loss_fn,
                                  precision=precision)
        self._matrices = _matrices(self.core, ts)
        self._reset = False  # gradients are zero already: accumulating into them is the same
        self._queued_small = True  # no train step queued, or only small ones (_Steps.call)
        self._training = True
        self._trained = tuple(self.core.trained)
        self._use_device(_device(placed))
        state.train_state = self.core.init(state.train_state)

    def _use_device(self, device, kernel_threads: int = 1) -> None:
        """Places the state and the steps on `device` (None: jax's default device), with
        jaxops' CPU kernels on `kernel_threads` threads in them."""
        if device is not None:
            ts = self.state.train_state
            moved = jax.device_put(ts, device)  # (a host step count stays on the host)
            self.state.train_state = moved.replace(
                step=moved.step if isinstance(ts.step, jax.Array) else ts.step)
        self._at = _Placement.of(device, self._matrices, kernel_threads)
        self._steps = _Steps(functools.partial(self._make_step, at=self._at))
        # lazy_reset_grad's flag as device arrays: a numpy bool would be a device_put a step
        put = (lambda x: jax.device_put(x, device)) if device else jnp.asarray
        self._flags = (put(np.bool_(False)), put(np.bool_(True)))

    def _move_if_small(self, packed, args) -> bool:
        """At the first train call of a Module that may move (__init__): a train step of at
        most SMALL_FLOPS by XLA's cost analysis moves the Module to `cpu_device(1)`, as ORT's
        `intra_op_num_threads=1` would run it, its eval step with it. XLA:CPU's thread pool
        costs such steps more in hand-offs between threads than it gains (docs/training.md,
        "Small models on a CPU"). Returns whether it moved."""
        self._may_move = False
        flops = cost(self._steps.get("train", packed, args).lower(*args))[0]
        if not 0 <= flops <= SMALL_FLOPS:
            return False
        # XLA runs the steps on one thread: jaxops' CPU kernels may use the process's others
        self._use_device(cpu_device(1), xla_threads())
        self._eval_undecided, self._eval_at = False, None  # (a moved eval: now the Module's)
        return True

    def _place_eval(self, flops) -> None:
        """At the first eval call of a Module on XLA's pool that may move, or that stayed
        there where it might (its first train step was not small), given the eval step's FLOPs
        by XLA's count (which leaves out jaxops' CPU convolution kernel): an eval step of at
        most SMALL_FLOPS runs on `cpu_device(1)` from then on (until a small train step moves
        the whole Module there), its kernels on the process's cores, with a copy of the
        parameters made there after each train step (_EvalAt). Each step kind is placed by
        its own cost: a ResNet Module that evaluates first still trains on the pool. ResNet's
        eval (a 555 MFLOP train step; an eval of 195 MFLOP, 5.1 of them by XLA's count) ran
        its loops 0.76-0.80x the time on 2 vCPUs, 0.82-0.83x on 16 cores (in-process A/B,
        2026-12-04: docs/performance.md, thirty-first session)."""
        self._eval_undecided = False
        if 0 <= flops <= SMALL_FLOPS:
            self._eval_at = _EvalAt(self, cpu_device(1))

    def _make_step(self, kind, static, args, at: _Placement):
        """The jitted step `kind` for the packed state's layouts `static`, closed over: as a
        static argument jit hashes it every call (2 us, bert_ts), placed by `at`. The steps
        take the buffers as dicts, which a jitted call dispatches 10-16 us faster than the
        PackedState (PackedState.static). The eval step takes only the parameters' buffers."""
        core = self.core
        if kind == "train":
            return at.jit(self._train_fn(static), args, donate_argnums=1)
        taken = at.taken["eval"]

        def eval_step(trained, rest, inputs):
            packed = PackedState.from_buffers(static, trained=trained, rest=rest)
            return core.eval_step(packed.unpack(taken), inputs)
        return at.jit(eval_step, args)

    def _train_fn(self, static):
        """The train step on the buffers of the packed layouts `static`: (outputs, the new
        gradient buffers), placed as the Module."""
        core, taken = self.core, self._at.taken["train"]

        def train_step(trained, grads, rest, inputs, reset):
            packed = PackedState.from_buffers(static, trained=trained, grads=grads, rest=rest)
            # the step's own gradients (reset: the graph's accumulators pass them on), added
            # to the old ones in the flat buffers: a copy and one loop a dtype. Adding each
            # parameter's was a thunk (bert_ts: 21), all ready at once at the step's end,
            # which XLA:CPU's executor split with its pool thread: a context switch a step on
            # one core (docs/performance.md, seventeenth session)
            outs, new = core.train_step(packed.unpack(taken), inputs, True)
            fresh = packed.layout.pack(new.grads)
            return outs, {key: jnp.where(reset, g, grads[key] + g) for key, g in fresh.items()}
        return train_step

    def __call__(self, *user_inputs):
        """One step: in train mode forward + backward (gradients accumulate); in eval mode the
        eval model. Returns the model's user outputs (the loss for ORT's artifacts)."""
        training = self._training
        names = self.core.input_names if training else self._eval_names()
        if len(user_inputs) != len(names):  # before the inputs move to the device
            raise TypeError(f"expected {len(names)} inputs {list(names)}, "
                            f"got {len(user_inputs)}")
        # jit takes numpy and jax arrays as they are (jnp.asarray would cost a dispatch each);
        # numpy's type first: isinstance(x, jax.Array) is an abstract class's check
        inputs = [x if type(x) is np.ndarray or isinstance(x, jax.Array) else np.asarray(x)
                  for x in user_inputs]
        pending = self.state._pending
        if training and pending is not None and pending.module is self:
            outs = pending._issue(inputs, self._flags[self._reset])  # (still pending if it raises)
            self._reset = False
            return outs[0] if len(outs) == 1 else outs
        packed = self.state._packed_state(self._trained)
        if training and self._may_move and self._move_if_small(
                packed, (packed.trained, packed.grads, packed.rest, inputs,
                         self._flags[self._reset])):
            packed = self.state._packed_state(self._trained)
        # the steps read neither the moments nor the step count, and eval no gradients: left
        # out, they cost no dispatch (and the count stays on the host)
        if training:
            # not waited for: the optimizer step that follows (run alone, or with the next
            # train step) queues behind it and waits for both where both are small (waiting
            # here too, bert_dynamo's whole step took 0.41 ms instead of 0.33, all cores)
            (outs, grads), self._queued_small = self._steps.call(
                "train", packed, packed.trained, packed.grads, packed.rest, inputs,
                self._flags[self._reset], wait=False)
            self.state._set_packed(packed.replace(grads=grads))
            self._reset = False
        else:
            args = (packed.trained, packed.rest, inputs)
            if self._eval_undecided:
                self._place_eval(cost(self._steps.get("eval", packed, args).lower(*args))[0])
            outs = (self._eval_at(packed, inputs) if self._eval_at is not None else
                    self._steps.call("eval", packed, *args)[0])
        return outs[0] if len(outs) == 1 else outs

    def _eval_names(self) -> list[str]:
        if self.core.eval_program is None:
            raise RuntimeError("this Module has no eval model")
        return self.core.eval_input_names

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
        return list(self.core.input_names if self._training else self._eval_names())

    def output_names(self) -> list[str]:
        """The call's outputs (with a loss_fn: ["loss"])."""
        if self._training:
            return list(self.core.output_names)
        if self.core.eval_program is None:
            raise RuntimeError("this Module has no eval model")
        return list(self.core.eval_output_names)

    def _names(self, trainable_only):
        return list(self.core.trained if trainable_only else self.core.param_names)

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        ts = self.state.train_state
        return sum(int(ts.param(n).size) for n in self._names(trainable_only))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> jax.Array:
        """All parameters (training-model input order) as one flat array."""
        ts = self.state.train_state
        return jnp.concatenate([ts.param(n).ravel() for n in self._names(trainable_only)])

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        buffer, ts = jnp.asarray(buffer), self.state.train_state
        size = self.get_parameters_size(trainable_only)
        if buffer.ndim != 1 or buffer.size != size:
            raise ValueError(f"buffer must be 1-D with {size} elements, got shape {buffer.shape}")
        values, offset = {}, 0
        for n in self._names(trainable_only):
            p = ts.param(n)
            values[n] = buffer[offset:offset + p.size].reshape(p.shape).astype(p.dtype)
            offset += p.size
        self.state.train_state = ts.with_params(values)


class Optimizer:
    """The optimizer model (AdamWOptimizer or SGDOptimizerV2) over a Module's parameters.

    module: the Module; core: the OptimizerModel whose pure update `step` calls.
    """

    def __init__(self, optimizer_uri, module: Module):
        self.module = module
        self.core = OptimizerModel(optimizer_uri, module.core)
        state = module.state
        if state.initial_learning_rate == 0.0:
            state.initial_learning_rate = 1e-3  # ORT's default when the checkpoint has none
        self._lr = state.initial_learning_rate
        state.train_state = self.core.init(state.train_state)
        self._steps = _Steps(self._make_update)
        self._count = (None, None)  # (the host step count, the same count on the device)
        self._args = None  # a pending step's (step count, lr to hand the update, lr): step()
        self._lr_on_device = (None, None)  # (a learning rate, it on the device)

    def _make_update(self, kind, static, args):
        """The jitted update of the packed state's buffers (see Module._make_step), all
        donated: it passes grads and rest through, which jit copies unless they are donated.
        It returns the new step count and the learning rate on the device too: handed to
        the next update, they save it a device_put of each (6.6 us for the rate alone,
        gpt2_dynamo on one core). Kind "update_train": the update, then the module's train
        step on the new parameters, in one program (Optimizer.step)."""
        core = self.core

        def update(trained, grads, moments, other_moments, rest, step, lr):
            packed = PackedState.from_buffers(static, trained=trained, grads=grads, rest=rest,
                                              moments=moments, other_moments=other_moments,
                                              step=step)
            new = core.update_packed(packed, lr)
            return (new.trained, new.grads, new.moments, new.other_moments, new.rest, new.step,
                    lr)
        donated = (0, 1, 2, 3, 4)
        if kind == "update":
            return jax.jit(update, donate_argnums=donated, **jit_options(self.module._at.device))
        train = self.module._train_fn(static)

        def update_train(trained, grads, moments, other_moments, rest, step, lr, inputs, reset):
            new = update(trained, grads, moments, other_moments, rest, step, lr)
            outs, grads = train(new[0], new[1], new[4], inputs, reset)
            return outs, (new[0], grads, *new[2:])
        return self.module._at.jit(update_train, args, donate_argnums=donated)

    def step(self) -> None:
        """One update of every trainable parameter from its accumulated gradient.

        The update is issued with the module's next train call, as one jitted program with
        it (one dispatch a step, not two: llama_ts's, bert_dynamo's and vit_ts's whole steps
        on one core took 383, 450 and 437 us instead of 422, 484 and 467, 2026-12-02), or on
        its own before anything else reads the state (a parameter, the eval model, a
        checkpoint, block_until_ready): the values are those of issuing it here. A
        train_state assigned in between replaces its result, which is then not computed."""
        module, state = self.module, self.module.state
        # (a step before the module's first call: the module stays where the moments are)
        module._may_move = False
        p = state._packed_state(module._trained)  # (issues an earlier step not issued yet)
        host, device = self._count
        step = device if p.step is host else p.step  # `is`: the count this class set
        rate, device_lr = self._lr_on_device
        lr = device_lr if rate == self._lr else np.float32(self._lr)
        self._args = (step, lr, self._lr)
        # the count stays on the host (CheckpointState), and counts this step at once (an
        # int64 already after the first step: np.int64() of it cost 2.4 us in a loop, one core)
        count = p.step if type(p.step) is np.int64 else np.int64(p.step)
        state._set_packed(p.replace(step=count + 1))
        state._pending = self

    def _issue(self, inputs=None, reset=None):
        """Issues the pending step (`step`): alone, or with the module's train step on
        `inputs` (returning its outputs)."""
        module, state = self.module, self.module.state
        p, (step, lr, rate) = state._packed, self._args
        args = (p.trained, p.grads, p.moments, p.other_moments, p.rest, step, lr)
        if inputs is None:
            new, _ = self._steps.call("update", p, *args, wait=module._queued_small)
            module._queued_small = True  # (not waited for while a big train step runs)
        else:
            (outs, new), module._queued_small = self._steps.call(
                "update_train", p, *args, inputs, reset)
        trained, grads, moments, other, rest, device, device_lr = new
        self._count, self._lr_on_device = (p.step, device), (rate, device_lr)
        state._set_packed(p.replace(trained=trained, grads=grads, moments=moments,
                                    other_moments=other, rest=rest))
        state._pending = None
        return None if inputs is None else outs

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
        step = int(self._optimizer.module.state._step_count())
        self._optimizer.set_learning_rate(self._initial * self._factor(step))


__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter"]
