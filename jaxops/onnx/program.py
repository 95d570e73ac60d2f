"""The graph interpreter: a loaded ONNX model as a function of (params, *inputs).

Each graph (the main one and every subgraph) is checked and ordered once, at load, into a
`_Plan`: its nodes in dependency order with their handlers found and attributes decoded. A call
walks the plan with a dict of values.

Host values: a value is known on the host when it does not depend on the data: integer
initializers, Constant nodes, the shapes of traced values (Shape, Size), and the results of
nodes whose inputs are all such values. Any node whose inputs are all known on the host runs on
the host, whatever its domain (`jax.ensure_compile_time_eval`, 64-bit types on, the results
turned into numpy), so the shape arithmetic of real exports (ORT rewrites their Concats into
com.microsoft.ConcatTraining) stays static under `jax.jit`. The model's inputs and params are
data even when they are concrete arrays.

A call's state is explicit: one `_Call` (the in-place updates that nodes declare, the sizes
that the inputs bind symbolic dims to), shared by the graphs it runs, and one `_Scope` per run
of a graph (its values over the enclosing graphs', its names known on the host).
"""
from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np
import onnx
from onnx import helper, numpy_helper

from jaxops._src.disable import disabled, routed_to_xla
from jaxops.cpu import (cpu_device, jit_options, jit_options_for, traced_with_kernel_threads,
                        xla_threads)
from jaxops.onnx import functions, registry, signature
from jaxops.onnx import precision as _precision
from jaxops.onnx.errors import OnnxImportError
from jaxops.onnx.registry import canonical_domain

_A = onnx.AttributeProto
_PYTHON_OPS = ("PythonOp", "PythonOpGrad")
# Nodes that act across devices or outside the graph: never run on the host, whatever their inputs.
_NEVER_ON_HOST = frozenset(("com.microsoft", op) for op in (
    "Send", "Recv", "NcclAllReduce", "NcclAllGather", "NcclReduceScatter", "AdasumAllReduce",
    "MegatronF", "MegatronG", "RecordEvent", "WaitEvent", "YieldOp", "PythonOp", "PythonOpGrad"))


def is_trainable(dtype) -> bool:
    """Float (incl. bfloat16, float8) and complex dtypes: what becomes a param."""
    return bool(jax.numpy.issubdtype(np.dtype(dtype), jax.numpy.inexact))


# Initializers of at most this many elements stay numpy: graphs compute shapes and indices
# from small float constants (Swin's ScatterND takes an index Cast from one), which only numpy
# values keep static under jit; the fused attention's scale is one too.
_HOST_SIZE = 64


def _on_device(params: dict) -> dict:
    """`program.params`: the float initializers put on jax's default device once, at load, so
    that a call given them copies nothing (as numpy, every call copied every weight: corpus
    MobileNetV3's jitted forward on one CPU core took 0.33 ms, 0.20 ms so). Small ones
    (_HOST_SIZE), and float64 and complex128 ones while jax's 64-bit types are off (jax narrows
    them when a call is given them, not before), stay numpy."""
    keep = {k: v for k, v in params.items()
            if jax.dtypes.canonicalize_dtype(v.dtype) == v.dtype and v.size > _HOST_SIZE}
    with jax.ensure_compile_time_eval():  # a load inside a trace still gives arrays
        placed = jax.device_put(keep) if keep else {}
    return {k: placed.get(k, v) for k, v in params.items()}


# A call of a small CPU program waits for its results by polling instead of sleeping. XLA:CPU
# runs a jitted call on its execute thread (async dispatch; inline only under 1000 FLOP) and a
# caller that blocks sleeps until the result is ready. With the process on every core the two
# threads sit on different cores, and waking a sleeping one costs tens of us on the 2-core dev
# VM (an idle vCPU halts), as much as a 0.1-0.3 ms forward. Polling (yielding the core between
# polls) keeps the caller awake. A/B in one process, all cores, two runs, ms (2026-11-25,
# the corpus exports, polling vs blocking): forwards bert_dynamo 0.179/0.175
# vs 0.195/0.222, regnet_dynamo 0.263/0.211 vs 0.304/0.252, mobilenetv3_ts 0.145/0.153 vs
# 0.180/0.149, gpt2_dynamo 0.153/0.092 vs 0.159/0.151, whisper_ts 0.150/0.150 vs 0.148/0.204;
# train steps (+ optimizer) within +-6%. "Small" by XLA's cost analysis: these exports' steps
# are 0.8-16 MFLOP and <= 15 MB moved, ResNet's 220-560 MFLOP and 25-90 MB (3+ ms a call: the
# wakes are under 2% of it, and its intra-op threads want the cores). A process bound to one
# core has no cross-core wake to spare and does not poll. A poll gives up after POLL_SECONDS
# (the caller then blocks as jax does).
POLL_MAX_FLOPS = 2 ** 25
POLL_MAX_BYTES = 2 ** 25
POLL_SECONDS = 0.01


def cost(stage) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of a `jax.stages.Lowered` or `Compiled` by XLA's cost analysis
    (-1 where it gives none)."""
    c = stage.cost_analysis() or {}
    if isinstance(c, (list, tuple)):  # older jax: one dict per program
        c = c[0] if len(c) == 1 else {}
    return c.get("flops", -1.0), c.get("bytes accessed", -1.0)


def polls(compiled) -> bool:
    """Whether calls of `compiled` (a `jax.stages.Compiled`) wait for their results by polling
    (`wait_polling`): a program on CPU devices only, at most POLL_MAX_FLOPS and POLL_MAX_BYTES
    by XLA's cost analysis, in a process that may use more than one core."""
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2:
        return False
    devices = [d for s in jax.tree_util.tree_leaves(compiled.output_shardings)
               for d in s.device_set]
    if not devices or any(d.platform != "cpu" for d in devices):
        return False
    flops, moved = cost(compiled)
    return 0 <= flops <= POLL_MAX_FLOPS and 0 <= moved <= POLL_MAX_BYTES


def may_move(arrays) -> bool:
    """Whether a program of `arrays` (its parameters) may move to `cpu_device(1)` when small:
    they are on jax's default device (or host arrays), a CPU whose XLA runs more than one
    thread. XLA:CPU's pool costs small programs more in hand-offs between threads than it
    gains (docs/training.md, "Small models on a CPU")."""
    home = jax.devices()[0]
    return (home.platform == "cpu" and xla_threads() > 1
            and all(x.devices() == {home} for x in jax.tree_util.tree_leaves(arrays)
                    if isinstance(x, jax.Array)))


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def wait_polling(outs, seconds: float | None = None) -> None:
    """Polls until every array in `outs` is ready, yielding the core between polls, for at most
    `seconds` (default POLL_SECONDS, read at the call; then returns: reading a value blocks as
    usual)."""
    seconds = POLL_SECONDS if seconds is None else seconds
    end = None
    for x in jax.tree_util.tree_leaves(outs):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            continue
        while not x.is_ready():
            now = time.perf_counter()
            if end is None:
                end = now + seconds
            elif now > end:
                return
            _yield()


class PollingJit:
    """A jitted function whose calls wait for their results by polling where its program is
    small (`polls`, decided at the first call). `move`, where given, makes the same function on
    `cpu_device(1)`: a program of at most POLL_MAX_FLOPS then runs there from its first call
    on (`may_move`). `move(args, kwargs)` and `remake(args, kwargs)` (where given: `fn` made
    again for the first call's arguments, whose jaxpr jit_options reads) get that call's
    arguments. Other attributes (`lower`, `trace`, ...) are the jitted function's."""

    def __init__(self, fn, move=None, remake=None):
        self._fn, self._polls, self._move, self._remake = fn, None, move, remake
        self._device = None  # where a moved program runs: arrays given from elsewhere go there
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        if self._device is not None and (kwargs or any(type(x) is not np.ndarray for x in args)):
            # (numpy arrays go as they are: the tree_map cost 1.7 us a call, MobileNetV3's
            # forward 53 us on one core)
            args, kwargs = jax.tree_util.tree_map(self._onto, (args, kwargs))
        if self._remake is not None and not any(
                isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
            self._fn = self.__wrapped__ = self._remake(args, kwargs)
            self._remake = None
        out = self._fn(*args, **kwargs)
        if self._polls is None:
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(out)):
                return out  # under a transformation: nothing runs now
            compiled = self._fn.lower(*args, **kwargs).compile()  # cached: ~1 ms
            if self._move is not None and 0 <= cost(compiled)[0] <= POLL_MAX_FLOPS:
                self._fn, self._device = self._move(args, kwargs)
                self.__wrapped__, self._polls = self._fn, False  # one thread: ready on return
                return self(*args, **kwargs)
            self._polls = polls(compiled)
            self._move = None
        if self._polls:
            wait_polling(out)
        return out

    def _onto(self, x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) \
                and x.devices() != {self._device}:
            return jax.device_put(x, self._device)
        return x

    def __getattr__(self, name):
        return getattr(self._fn, name)


def node_label(node) -> str:
    name = f"{node.name!r} " if node.name else ""
    dom = f"{node.domain}." if canonical_domain(node.domain) else ""
    return f"node {name}({dom}{node.op_type})"


def default_max_bytes() -> int:
    """The default memory budget: half the machine's physical memory (16 GiB where that cannot
    be read). No value larger than that can be held on the host next to its inputs, while real
    models stay far below it per value (the budget bounds each value, not the model)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, ValueError, OSError):
        return 16 << 30


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g} GiB" if n >= 2 ** 20 else f"{n} bytes"


def check_bytes(shape, dtype, max_bytes: int | None, what: str) -> int:
    """The bytes of a value of `shape` and `dtype`; an OnnxImportError (starting with `what`)
    when a dim is negative or they exceed `max_bytes` (None: the default budget). Python ints:
    a product of hostile dims cannot overflow into a small number."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise OnnxImportError(f"{what}: negative dim in shape {shape}")
    size = math.prod(shape) * np.dtype(dtype).itemsize
    limit = default_max_bytes() if max_bytes is None else max_bytes
    if size > limit:
        e = OnnxImportError(
            f"{what}: a value of shape {shape} ({np.dtype(dtype).name}) needs {_gib(size)}, "
            f"above the memory budget of {_gib(limit)} (load(..., max_bytes=...) raises it)")
        e.over_budget = True  # what Program._dry_run lets through
        raise e
    return size


def tensor_to_numpy(t, what: str, max_bytes: int | None = None) -> np.ndarray:
    try:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            raise ValueError("its external data was not loaded")
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    except Exception as e:  # noqa: BLE001 - any failure is a malformed tensor
        raise OnnxImportError(f"{what}: tensor {t.name!r} cannot be read: {e}") from None
    check_bytes(t.dims, dtype, max_bytes, f"{what}: tensor {t.name!r}")
    try:
        return numpy_helper.to_array(t)
    except Exception as e:  # noqa: BLE001 - any failure (MemoryError too) is a malformed tensor
        raise OnnxImportError(f"{what}: tensor {t.name!r} cannot be read: {e}") from None


def sparse_to_numpy(s, what: str, max_bytes: int | None = None) -> np.ndarray:
    """The dense value of a SparseTensorProto. Its dims come from the model, not from the data
    it holds: they are checked against the budget before the dense array exists."""
    what = f"{what}: sparse tensor {s.values.name!r}"
    try:
        dtype = helper.tensor_dtype_to_np_dtype(s.values.data_type)
    except Exception as e:  # noqa: BLE001
        raise OnnxImportError(f"{what}: unknown element type: {e}") from None
    dims = tuple(int(d) for d in s.dims)
    check_bytes(dims, dtype, max_bytes, what)
    values = tensor_to_numpy(s.values, what, max_bytes)
    indices = tensor_to_numpy(s.indices, what, max_bytes).astype(np.int64)
    try:
        dense = np.zeros(dims, values.dtype)
        if indices.ndim == 1:  # linear indices
            dense.reshape(-1)[indices] = values
        else:  # [nnz, rank] coordinates
            dense[tuple(indices.T)] = values
    except (IndexError, ValueError, MemoryError) as e:
        raise OnnxImportError(f"{what} cannot be made dense: {type(e).__name__}: {e}") from None
    return dense


def decode_attribute(a, what: str, max_bytes: int | None = None) -> Any:
    """An AttributeProto as a Python value (see `jaxops.onnx.registry`)."""
    t = a.type
    if t == _A.FLOAT:
        return float(a.f)
    if t == _A.INT:
        return int(a.i)
    if t == _A.STRING:
        return _text(a.s)
    if t == _A.TENSOR:
        return tensor_to_numpy(a.t, what, max_bytes)
    if t == _A.SPARSE_TENSOR:
        return sparse_to_numpy(a.sparse_tensor, what, max_bytes)
    if t == _A.GRAPH:
        return a.g
    if t == _A.TYPE_PROTO:
        return a.tp
    if t == _A.FLOATS:
        return [float(v) for v in a.floats]
    if t == _A.INTS:
        return [int(v) for v in a.ints]
    if t == _A.STRINGS:
        return [_text(v) for v in a.strings]
    if t == _A.TENSORS:
        return [tensor_to_numpy(v, what, max_bytes) for v in a.tensors]
    if t == _A.SPARSE_TENSORS:
        return [sparse_to_numpy(v, what, max_bytes) for v in a.sparse_tensors]
    if t == _A.GRAPHS:
        return list(a.graphs)
    if t == _A.TYPE_PROTOS:
        return list(a.type_protos)
    raise OnnxImportError(f"{what}: attribute {a.name!r} has no valid type ({t})")


def _text(b: bytes):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b


def subgraphs(node):
    """The GraphProtos held in a node's attributes."""
    for a in node.attribute:
        if a.type == _A.GRAPH:
            yield a.g
        elif a.type == _A.GRAPHS:
            yield from a.graphs


class _Step:
    """One node, ready to run."""

    __slots__ = ("node", "fn", "attrs", "inputs", "outputs", "label", "opsets", "reads",
                 "may_run_on_host")

    def __init__(self, node, fn, attrs, opsets):
        self.node = node
        self.opsets = opsets
        self.fn = fn
        self.attrs = attrs
        inputs = list(node.input)
        while inputs and not inputs[-1]:
            inputs.pop()  # trailing absent optional inputs: leave the handler's defaults
        self.inputs = inputs
        self.outputs = list(node.output)
        self.label = node_label(node)
        # every value the node reads: its inputs and what its subgraphs take from outside
        self.reads = [n for n in inputs if n] + sorted(_free_names(node), key=repr)
        self.may_run_on_host = (canonical_domain(node.domain), node.op_type) not in _NEVER_ON_HOST


class _Plan:
    """A checked graph: its steps in dependency order, its static initializers, its inputs."""

    def __init__(self, graph, steps, constants, params, input_names, output_names):
        self.graph = graph  # keeps the proto (and so the id used as the cache key) alive
        self.steps = steps
        self.producers = {o: s.node for s in steps for o in s.outputs if o}
        self.constants = constants
        self.params = params
        self.input_names = input_names
        self.output_names = output_names
        # the outputs the graph declares float32 (mixed precision restores their dtype)
        self.declared_f32 = {vi.name for vi in graph.output if vi.type.HasField("tensor_type")
                             and vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


class _Call:
    """The state of one call of the program, shared by the graphs it runs (the main graph and
    its subgraphs; a function body gets one of its own): the new values of the inputs that
    nodes update in place (None: not collected), and the sizes that the model's inputs bind
    their symbolic dims to."""

    __slots__ = ("updates", "dims")

    def __init__(self, updates: dict | None = None, dims: dict | None = None):
        self.updates = updates
        self.dims = {} if dims is None else dims


class _Scope:
    """The values of one run of a graph, over those of the enclosing graphs (a subgraph reads
    them), and which of its own names are known on the host (see the module)."""

    def __init__(self, plan: _Plan, call: _Call, outer: _Scope | None = None):
        self.plan = plan
        self.call = call
        self.outer = outer
        self.values = {} if outer is None else collections.ChainMap({}, outer.values)
        self.host: set = set()

    def on_host(self, name: str) -> bool:
        """Whether `name` (absent: '') is known on the host here or in an enclosing scope."""
        scope = self if name else None
        while scope is not None:
            if name in scope.host:
                return True
            scope = scope.outer
        return not name


class NodeContext:
    """What a handler sees of the importer: the node, its opsets, static values, subgraphs."""

    def __init__(self, program: "Program", step: _Step, scope: _Scope):
        self._program = program
        self._step = step
        self._scope = scope

    @property
    def node(self):
        return self._step.node

    @property
    def name(self) -> str:
        return self._step.node.name

    @property
    def num_outputs(self) -> int:
        """How many outputs the node declares (absent trailing ones included)."""
        return len(self._step.outputs)

    def output_used(self, i: int) -> bool:
        """Whether output `i` is named (an optional output may be left out with '')."""
        return i < len(self._step.outputs) and bool(self._step.outputs[i])

    def opset(self, domain: str = "") -> int:
        """The model's opset version for `domain` (0 when the model does not import it)."""
        return self._step.opsets.get(canonical_domain(domain), 0)

    def error(self, message: str) -> OnnxImportError:
        """An import error naming this node: `raise ctx.error("...")`."""
        return OnnxImportError(f"{self._step.label}: {message}")

    def static(self, x, what: str = "input"):
        """`x` as numpy (lists element-wise; None stays None), or an error naming the node when
        `x` depends on the data (a tracer under jit/grad/vmap)."""
        if x is None:
            return None
        if isinstance(x, (list, tuple)):
            return [self.static(v, what) for v in x]
        try:
            return np.asarray(x)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError):
            raise self.error(
                f"{what} must be known without the data (computed from constants, initializers "
                "or shapes), but here it depends on a traced input or parameter") from None

    def graph_has(self, op_type: str) -> bool:
        """Whether the model's main graph has a node of this op_type (any domain)."""
        return op_type in self._program._op_types

    def is_static(self, x) -> bool:
        """Whether `x` (or every element of a list) is known without the data."""
        if x is None:
            return True
        if isinstance(x, (list, tuple)):
            return all(self.is_static(v) for v in x)
        return not isinstance(x, jax.core.Tracer)

    def output_shape(self, i: int) -> tuple[int, ...] | None:
        """The shape the model declares for output `i` (its value_info, or what onnx's shape
        inference finds), its symbolic dims bound to the sizes of this call's inputs; None
        where it is not declared or a dim stays unknown."""
        name = self._step.outputs[i] if i < len(self._step.outputs) else ""
        return self._program.declared_shape(name, self._scope.call.dims) if name else None

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The shape of the value called `name` in this call (None where there is none yet)."""
        value = self._scope.values.get(name) if name else None
        return None if value is None or isinstance(value, list) else tuple(np.shape(value))

    def producer(self, name: str):
        """The NodeProto of this graph that computes `name`, or None."""
        return self._scope.plan.producers.get(name) if name else None

    def update(self, i: int, value) -> None:
        """Declares that this node updates its input `i` in place (ORT's optimizers and
        gradient accumulators do); `Program.run_with_updates` returns the new value under the
        input's name."""
        updates = self._scope.call.updates
        if updates is not None and i < len(self._step.inputs) and self._step.inputs[i]:
            updates[self._step.inputs[i]] = value

    def run_graph(self, graph, *inputs):
        """Runs a subgraph (an attribute of this node) on `inputs`, with the values of the
        enclosing graphs in scope; returns the list of its outputs."""
        program, scope = self._program, self._scope
        plan = program._plans.get(id(graph))
        if plan is None:  # a graph the handler built itself
            plan = program._plan_late(graph, frozenset(scope.values), self._step.opsets,
                                      self._step.label)
        # the handler made static (numpy) what it knows on the host: a loop's counter, ...
        return program._run(plan, inputs, scope.call, scope,
                            host_inputs=[_is_host_value(x) for x in inputs])

    def run_function(self, function: onnx.FunctionProto, inputs, defaults: dict | None = None):
        """Runs `function` as this node's expansion and returns the list of its outputs: its
        body with attribute references bound to this node's attributes (else to `defaults`,
        name -> AttributeProto), in this node's opsets overridden by those the function
        imports, each input known on the host where this node's is. The body is checked once
        per node and function (an op it lacks is an OnnxImportError naming this node) and
        runs on its own: no values of enclosing graphs, no in-place updates. Model functions
        and the schema's function bodies run through this (`jaxops.onnx.resolve`)."""
        program, step = self._program, self._step
        key = (id(step), function.SerializeToString())
        plan = program._expansions.get(key)
        if plan is None:
            graph = functions.body_graph(function, step.node, defaults or {})
            plan = program._plan_late(graph, frozenset(),
                                      functions.body_opsets(function, step.opsets),
                                      step.label, function=True)
            program._expansions[key] = plan
        return program._run(plan, inputs, _Call(), host_inputs=self.inputs_on_host())

    def check_size(self, shape, dtype, what: str = "output") -> None:
        """Refuses, naming the node, a value of `shape` and `dtype` above the program's memory
        budget. Every output is checked after its handler returns (free under jit, where it is
        abstract); a handler calls this first where it would allocate on the host, or loop in
        Python, by a size the model gives (numpy on static values, jnp under host evaluation)."""
        check_bytes(shape, dtype, self._program.max_bytes, f"{self._step.label}: {what}")

    def inputs_on_host(self) -> list[bool]:
        """For each input of this node, whether it is known on the host (see the module)."""
        return [self._scope.on_host(n) for n in self._step.inputs]


class Program:
    """A loaded ONNX model. Call `program(params, *inputs)` or `program(params, **inputs)`:
    one output is returned as is, several as a tuple in the graph's order. Pure: usable under
    `jax.jit`, `jax.grad` (w.r.t. params and float inputs) and `jax.vmap`. A node's handler
    that fails raises its own exception, with a note naming the node; the importer's own
    refusals are OnnxImportErrors (docs/onnx-importer.md, Errors)."""

    def __init__(self, model, *, python_ops: dict[str, Callable] | None = None, constants=(),
                 max_bytes: int | None = None, precision: str | None = None):
        self.model = model
        # None (float32 as the graph says) or "bf16": the per-node dtype policy of
        # jaxops.onnx.precision, applied in _run_step
        self.precision = _precision.check(precision)
        self._policy = None if self.precision is None else _precision.Policy(self.precision)
        # the memory budget: no value that the model asks for (initializer, sparse tensor,
        # node output) may need more bytes; see default_max_bytes
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self._sparse_bytes = 0  # the dense sparse tensors held at once count together
        self._dry_runs: set = set()  # the call signatures already checked abstractly
        self._types = None
        self.opsets = {}
        for o in model.opset_import:
            self.opsets[canonical_domain(o.domain)] = int(o.version)
        self.functions = {(canonical_domain(f.domain), f.name): f for f in model.functions}
        self.python_ops = dict(python_ops or {})
        self._static_names = set(constants)
        # input axes whose sizes calls do not check against the declared dims: a data-parallel
        # step runs the graph on any batch that splits over its devices
        self.free_axes: tuple[int, ...] = ()
        self._plans: dict[int, _Plan] = {}
        self._expansions: dict[tuple, _Plan] = {}  # function bodies, expanded when first run
        self._missing: set[tuple[str, str, int]] = set()
        self._refused: list[str] = []
        try:
            from jaxops.onnx.handlers.fused_attention import fuse_attention
            from jaxops.onnx.handlers.fused_conv import fuse_conv
            from jaxops.onnx.handlers.p2p import pair_transfers  # Send/Recv run as pairs

            graph = model.graph
            self._op_types = frozenset(n.op_type for n in graph.node)
            # bf16 anywhere (cuDNN on a GPU); float32 on a GPU (a Pallas flash attention)
            if ((self.precision == "bf16" or jax.default_backend() == "gpu")
                    and not disabled("fused_attention")):
                graph = fuse_attention(graph, self.opsets.get("", 1))
            if not disabled("fused_conv"):
                graph = fuse_conv(graph, self.opsets.get("", 1))
            self._main = self._plan(pair_transfers(graph), frozenset(), self.opsets, top=True)
        except RecursionError:
            raise OnnxImportError("the model's subgraphs nest too deeply") from None
        except MemoryError:  # what the budget lets through may still not fit
            raise OnnxImportError("the model does not fit in memory (MemoryError while "
                                  "loading it)") from None
        problems = list(self._refused)
        if self._missing:
            missing = ", ".join(f"({d or 'ai.onnx'!r}, {op!r}, {v})"
                                for d, op, v in sorted(self._missing))
            problems.append(f"the model uses {len(self._missing)} unsupported op(s) (domain, "
                            f"op_type, opset version): {missing}")
        if problems:  # everything that stops the model, in one error
            raise OnnxImportError("; ".join(problems))
        self.params = _on_device(self._main.params)
        self._param_names = frozenset(self.params)
        self._main.params = None  # the numpy copies go: the Program holds the params
        self.input_names = list(self._main.input_names)
        self.output_names = list(self._main.output_names)

    def jit(self, params=None) -> Callable:
        """The forward as one jitted function of the inputs alone, `params` (default:
        `program.params`) fixed in it: `forward = program.jit(); y = forward(x)` (or
        `forward(input_name=x)`) returns what `program(params, x)` does. The params are closed
        over as device arrays (numpy ones are put there now, as at load), so a call hands jit only the
        inputs: MobileNetV3 (corpus, one CPU core) 0.13 ms a call against 0.20 ms for
        `jax.jit(program)(program.params, x)` with its 62 params as arguments, and 0.15 ms
        with them packed into one buffer per dtype (slicing the weights back out costs more
        than it saves). Each `jit()` compiles anew; for params that change between calls
        (training, fine-tuning) use `jax.jit(program)(params, x)`. On a CPU, a small forward
        (at most POLL_MAX_FLOPS) with its params on jax's default device moves at its first
        call to `jaxops.cpu_device(1)`, a one-thread XLA client where each call runs on the
        calling thread (its outputs live there); other small ones return when their outputs
        are ready (`PollingJit`: polling, not sleeping, spares the cross-core wakes of async
        dispatch)."""
        params = self.params if params is None else params
        self._check_params(params)
        params = _on_device(params)

        def jitted(params, device, args=None, kwargs=None, kernel_threads=1, **placed):
            # (device: where the params are, None: default; args, kwargs: a call's arguments,
            # whose jaxpr jit_options reads on a one-thread CPU; kernel_threads: jaxops' CPU
            # kernels' threads in the trace)
            def forward(*args, **kwargs):
                return self(params, *args, **kwargs)
            forward = traced_with_kernel_threads(forward, kernel_threads)
            options = jit_options(device, forward=True) if args is None else \
                jit_options_for(device, forward, args, kwargs, forward=True)
            return jax.jit(forward, **placed, **options)

        def move(args, kwargs):  # (the outputs' sharding places the program, numpy params too)
            one = cpu_device(1)
            params_one = {k: jax.device_put(v, one) if isinstance(v, jax.Array) else v
                          for k, v in params.items()}
            # (XLA runs it on one thread now: jaxops' kernels may use the process's others)
            return jitted(params_one, one, args, kwargs, kernel_threads=xla_threads(),
                          out_shardings=jax.sharding.SingleDeviceSharding(one)), one
        home = next((d for x in params.values() if isinstance(x, jax.Array)
                     for d in x.devices()), None)
        remake = (lambda args, kwargs: jitted(params, home, args, kwargs)) \
            if jit_options(home) else None  # (a one-thread CPU: the call's jaxpr decides)
        return PollingJit(jitted(params, home), move if may_move(params) else None, remake)

    def _check_params(self, params) -> None:
        names = self.input_names
        if params is not None and not isinstance(params, Mapping):
            raise OnnxImportError(
                f"the first argument is the params dict (program.params), then the inputs "
                f"{names}: call program(program.params, *inputs); got {type(params).__name__}")
        unknown = set(params or {}) - self._param_names
        if unknown:
            raise OnnxImportError(f"params has entries the model does not: {sorted(unknown)}")
        absent = self._param_names - set(params or {})
        if absent:
            raise OnnxImportError(f"params lacks initializer(s) {sorted(absent)}")

    def declared_shape(self, name: str, dims: dict) -> tuple[int, ...] | None:
        """The declared shape of value `name` with its symbolic dims looked up in `dims`, or
        None where it is not declared or a dim is unknown."""
        t = self.declared_types().get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        shape = []
        for d in t.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param in dims:
                shape.append(dims[d.dim_param])
            else:
                return None
        return tuple(shape)

    def declared_types(self) -> dict:
        """Name -> TypeProto for every value the model declares, completed once by onnx's
        shape inference (which may fail on custom ops: then the declarations alone)."""
        if self._types is None:
            model = self.model
            try:
                model = onnx.shape_inference.infer_shapes(model)
            except Exception:  # noqa: BLE001 - inference is a bonus, not a requirement
                pass
            g = model.graph
            self._types = {}
            for v in (*g.input, *g.value_info, *g.output):  # the first one with a shape wins
                old = self._types.get(v.name)
                if old is None or not old.tensor_type.HasField("shape"):
                    self._types[v.name] = v.type
        return self._types

    def __repr__(self):
        return (f"<jaxops.onnx.Program {self.model.graph.name!r}: inputs {self.input_names}, "
                f"outputs {self.output_names}, {len(self._param_names)} params>")

    # -- calling ---------------------------------------------------------------------------

    def __call__(self, params, /, *args, **kwargs):
        outputs = self.run(params, *args, **kwargs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def run(self, params, /, *args, **kwargs) -> list:
        """Like calling the program, but always returns the list of outputs."""
        return self.run_with_updates(params, *args, **kwargs)[0]

    def run_with_updates(self, params, /, *args, **kwargs) -> tuple[list, dict]:
        """(outputs, updates): `updates` maps the name of each value that a node updates in
        place (in ORT training graphs: the gradient accumulation buffers, the optimizer's
        params and moments, which are graph inputs) to its new value. Functional code feeds
        them back in as the next call's inputs."""
        names = self.input_names
        if params is not None and not isinstance(params, Mapping):
            self._check_params(params)  # the error that says how to call
        if len(args) > len(names):
            raise OnnxImportError(f"the model takes {len(names)} inputs {names}, got {len(args)}")
        given = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise OnnxImportError(f"the model has no input {k!r} (inputs: {names})")
            if k in given:
                raise OnnxImportError(f"input {k!r} given twice")
            given[k] = v
        missing = [n for n in names if n not in given]
        if missing:
            raise OnnxImportError(f"missing model input(s) {missing} (inputs: {names}; "
                                  "call program(program.params, *inputs))")
        dims = signature.check_inputs(self.model.graph.input, given, self.free_axes)
        self._check_params(params)
        if params is None:
            params = {}
        inputs = [given[n] for n in names]
        self._dry_run(params, inputs, dims)
        call = _Call({}, dims)
        outputs = self._run(self._main, inputs, call, params=params)
        if self._policy is not None:  # an input updated in place keeps its dtype
            call.updates = {n: _precision.like(v, given.get(n))
                            for n, v in call.updates.items()}
        return outputs, call.updates

    def _dry_run(self, params, inputs, dims):
        """Called eagerly (no tracer among params and inputs), every jax operation would
        allocate its result at once: run the graph abstractly first (jax.eval_shape), once per
        signature, so that `_run_step`'s check of every output refuses an oversized value
        before anything is allocated. Under jit the values are abstract already. Other errors
        are left to the real run, which may succeed eagerly (it sees the data)."""
        leaves = jax.tree_util.tree_leaves((params, inputs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return
        key = (jax.tree_util.tree_structure((params, inputs)),
               tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        if key in self._dry_runs:
            return
        try:
            jax.eval_shape(lambda p, xs: self._run(self._main, xs, _Call({}, dims), params=p),
                           params, inputs)
        except OnnxImportError as e:
            if getattr(e, "over_budget", False):
                raise
        except Exception:  # noqa: BLE001 - the real run reports it (or succeeds on the data)
            pass
        if len(self._dry_runs) < 64:
            self._dry_runs.add(key)

    def _run(self, plan: _Plan, inputs, call: _Call, outer: _Scope | None = None, *,
             params=None, host_inputs=()):
        """Runs `plan` on `inputs` (the model's are data; a subgraph's or function's are known
        on the host where `host_inputs` says so) for `call`, in the scope of `outer`."""
        if len(inputs) > len(plan.input_names):
            raise OnnxImportError(f"graph {plan.graph.name!r} takes {len(plan.input_names)} "
                                  f"inputs, got {len(inputs)}")
        scope = _Scope(plan, call, outer)
        values = scope.values
        values.update(plan.constants)
        values.update(params or {})
        # inputs left out (a function's optional ones, a malformed loop body's) are None
        values.update(zip(plan.input_names, list(inputs) + [None] * len(plan.input_names)))
        scope.host.update(plan.constants)
        scope.host.update(n for n, h in zip(plan.input_names, host_inputs) if h)
        # mixed precision: the ops its policy measured faster as XLA's code run as such
        with routed_to_xla(self._policy.xla if self._policy is not None else ()):
            for step in plan.steps:
                self._run_step(step, scope)
        if self._policy is None:
            return [values[n] for n in plan.output_names]
        # mixed precision: what the graph declares float32 leaves it float32 (a loop's carried
        # values, a branch's results and the model's outputs keep their declared types)
        declared = plan.declared_f32
        return [_precision.cast(values[n], np.float32) if n in declared else values[n]
                for n in plan.output_names]

    def _run_step(self, step: _Step, scope: _Scope):
        ctx = NodeContext(self, step, scope)
        values = scope.values
        on_host = step.may_run_on_host and all(scope.on_host(n) for n in step.reads)
        try:
            args = [values[n] if n else None for n in step.inputs]
            if self._policy is not None and not on_host:
                args = self._policy.inputs(step.node.op_type, args)
            if on_host:
                _check_broadcast(ctx, args)
                with jax.ensure_compile_time_eval(), jax.enable_x64(True):
                    out = _to_host(step.fn(ctx, *args, **step.attrs))
            else:
                out = step.fn(ctx, *args, **step.attrs)
        except OnnxImportError:
            raise  # names its node already
        except RecursionError:
            raise OnnxImportError(f"{step.label}: subgraphs nest too deeply") from None
        except Exception as e:
            # the error keeps its type (what a caller catches); the note names the node, for
            # each graph that the error passes through
            e.add_note(f"(while running {step.label})")
            raise
        if not isinstance(out, tuple):
            out = (out,)
        for i, value in enumerate(out):  # abstract under jit: checked before XLA allocates
            _check_value(ctx, value, f"output {i}")
        for i, name in enumerate(step.outputs):
            if not name:
                continue
            if i >= len(out):
                raise OnnxImportError(f"{step.label}: output {i} ({name!r}) is used but the "
                                      f"handler gives only {len(out)} output(s)")
            values[name] = out[i]
            # a host value also where the handler read only the shapes of data (Shape, Size)
            if on_host or (_is_host_value(out[i]) and not any(
                    _is_host_value(values[n]) for n in step.reads if not scope.on_host(n))):
                scope.host.add(name)

    # -- loading ---------------------------------------------------------------------------

    def _plan(self, graph, outer: frozenset, opsets: dict, top: bool = False,
              function: bool = False) -> _Plan:
        plan = self._plans.get(id(graph))
        if plan is None:
            plan = self._check_graph(graph, top, outer, opsets, function)
            # the plan holds the proto, so its id stays unique while the entry lives
            self._plans[id(graph)] = plan
        return plan

    def _plan_late(self, graph, outer: frozenset, opsets: dict, label: str,
                  function: bool = False) -> _Plan:
        """Checks a graph met only while running (a function body, a handler's own graph).
        A function's outputs that its body does not compute (unused optional ones) are None."""
        before = len(self._missing), len(self._refused)
        try:
            plan = self._plan(graph, outer, opsets, function=function)
        except OnnxImportError as e:
            raise OnnxImportError(f"{label}: {e}") from None
        except RecursionError:
            raise OnnxImportError(f"{label}: graphs nest too deeply") from None
        if (len(self._missing), len(self._refused)) != before:
            self._plans.pop(id(graph), None)
            problems = sorted(self._missing)[before[0]:] + self._refused[before[1]:]
            raise OnnxImportError(f"{label}: its expansion needs what is unsupported: {problems}")
        return plan

    def _check_graph(self, graph, top: bool, outer: frozenset, opsets: dict,
                     function: bool = False) -> _Plan:
        where = "the model's graph" if top else f"subgraph {graph.name!r}"
        _check_text(where, graph.name, *(t.name for t in graph.initializer),
                    *(vi.name for vi in graph.input), *(vi.name for vi in graph.output))
        constants, params = {}, {}
        for t in graph.initializer:
            if not t.name:
                raise OnnxImportError(f"{where}: an initializer has no name")
            value = tensor_to_numpy(t, where, self.max_bytes)
            # float initializers of the main graph are what one trains: params; the rest
            # (integers, bools, strings, subgraph constants) stay static numpy
            if top and is_trainable(value.dtype) and t.name not in self._static_names:
                params[t.name] = value
            else:
                constants[t.name] = value
        for s in graph.sparse_initializer:
            constants[s.values.name] = self._sparse(s, where)
        known = set(constants) | set(params)
        input_names = []
        for vi in graph.input:
            if not vi.name:
                raise OnnxImportError(f"{where}: an input has no name")
            if vi.name in known and top:
                continue  # an initializer listed as an input (IR < 4): a param, not an input
            if vi.name in input_names:
                raise OnnxImportError(f"{where}: input {vi.name!r} is declared twice")
            input_names.append(vi.name)
        defined = set(input_names) | known
        steps = self._order(graph, where, defined, outer, opsets)
        output_names = []
        produced = defined | {o for s in steps for o in s.outputs if o} | outer
        for vi in graph.output:
            if vi.name not in produced:
                if not function:
                    raise OnnxImportError(f"{where}: output {vi.name!r} is computed by no node")
                constants[vi.name] = None
            output_names.append(vi.name)
        return _Plan(graph, steps, constants, params, input_names, output_names)

    def _sparse(self, s, where) -> np.ndarray:
        """A sparse tensor made dense: a few bytes of model each, so together they count
        against the budget as well (all of them are held for the program's life)."""
        dense = sparse_to_numpy(s, where, self.max_bytes - self._sparse_bytes)
        self._sparse_bytes += dense.nbytes
        return dense

    def _order(self, graph, where, defined, outer, opsets):
        """The graph's nodes as steps in dependency order; dangling inputs and cycles fail."""
        nodes = list(graph.node)
        producer = {}
        for i, node in enumerate(nodes):
            for o in node.output:
                if not o:
                    continue
                if o in producer or o in defined:
                    raise OnnxImportError(f"{where}: value {o!r} is produced twice "
                                          f"(again by {node_label(node)})")
                producer[o] = i
        # a node depends on the producers of its inputs and of the outer-scope names that its
        # subgraphs read
        deps = []
        for node in nodes:
            needs = set()
            # key=repr: a subgraph's non-text names are refused when it is checked, not here
            for name in list(node.input) + sorted(_free_names(node), key=repr):
                if not name or name in defined:
                    continue
                if name in producer:
                    needs.add(producer[name])
                elif name not in outer:
                    raise OnnxImportError(f"{where}: {node_label(node)} reads {name!r}, which "
                                          "no node, input or initializer defines")
            deps.append(needs)
        order, state = [], [0] * len(nodes)  # 0 new, 1 on the stack, 2 done
        for start in range(len(nodes)):
            if state[start]:
                continue
            stack = [(start, iter(sorted(deps[start])))]
            state[start] = 1
            while stack:
                i, it = stack[-1]
                j = next(it, None)
                if j is None:
                    stack.pop()
                    state[i] = 2
                    order.append(i)
                elif state[j] == 1:
                    raise OnnxImportError(f"{where}: the graph has a cycle through "
                                          f"{node_label(nodes[j])}")
                elif state[j] == 0:
                    state[j] = 1
                    stack.append((j, iter(sorted(deps[j]))))
        scope = frozenset(outer | defined | set(producer))
        return [self._step(nodes[i], where, scope, opsets) for i in order]

    def _step(self, node, where, scope, opsets) -> _Step:
        _check_text(where, node.op_type, node.domain, node.name, *node.input, *node.output)
        label = f"{where}, {node_label(node)}"
        attrs = {}
        for a in node.attribute:
            if a.ref_attr_name:
                raise OnnxImportError(f"{label}: attribute {a.name!r} refers to a function "
                                      "attribute outside a function")
            if a.name in attrs:
                raise OnnxImportError(f"{label}: attribute {a.name!r} is given twice")
            if a.type in (_A.SPARSE_TENSOR, _A.SPARSE_TENSORS):
                sparse = [a.sparse_tensor] if a.type == _A.SPARSE_TENSOR else a.sparse_tensors
                dense = [self._sparse(v, label) for v in sparse]
                attrs[a.name] = dense[0] if a.type == _A.SPARSE_TENSOR else dense
            else:
                attrs[a.name] = decode_attribute(a, label, self.max_bytes)
        # plan the very GraphProto objects the handler will get, so run_graph finds them
        for value in attrs.values():
            for g in value if isinstance(value, list) else [value]:
                if isinstance(g, onnx.GraphProto):
                    self._plan(g, scope, opsets)
        return _Step(node, self._resolve(node, label, opsets), attrs, opsets)

    def _resolve(self, node, label, opsets) -> Callable:
        from jaxops.onnx import resolve  # the op tables import handler modules: import late

        domain = canonical_domain(node.domain)
        if node.op_type in _PYTHON_OPS and domain == "com.microsoft":
            fn = resolve.python_op(node, self.python_ops)
            if fn is None:
                self._refused.append(
                    f"{label} names Python code ({_func_name(node)!r}); it is refused unless "
                    "the caller passes it explicitly: load(..., python_ops={name: function})")
                return _unavailable
            return fn
        # ORT's tools sometimes leave com.microsoft out of opset_import; 1 is its only version
        version = opsets.get(domain, 1)
        fn = resolve.find(domain, node.op_type, version, self)
        if fn is None:
            self._missing.add((domain, node.op_type, version))
            return _unavailable
        body = resolve.function_body(node, version, self, opsets)
        if body is not None:  # an expanded op: its body's ops must be there too
            graph, body_opsets = body
            self._plan(graph, frozenset(), body_opsets, function=True)
        return fn


def _is_host_value(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic, int, float, bool, str, bytes))


def _value_bytes(value) -> tuple[tuple, Any]:
    """(shape, dtype) of an output: an array, a tracer or a Python scalar."""
    dtype = getattr(value, "dtype", None)
    return np.shape(value), (np.asarray(value).dtype if dtype is None else dtype)


def _check_value(ctx, value, what):
    """Refuses an output (a sequence: all its elements together) above the budget."""
    if value is None or isinstance(value, (str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        total = sum(math.prod(np.shape(v)) * np.dtype(_value_bytes(v)[1]).itemsize
                    for v in value if v is not None and not isinstance(v, (str, bytes)))
        ctx.check_size((total,), np.uint8, f"{what} (a sequence)")
        return
    ctx.check_size(*_value_bytes(value), what)


def _check_broadcast(ctx, args):
    """Before a node runs on the host (numpy, or jax computing at once): inputs that broadcast
    together to a shape above the budget (an outer sum of two static ranges) are refused, so
    the elementwise ops of every family are covered without a check of their own."""
    arrays = [a for a in args if a is not None and not isinstance(a, (list, str, bytes))]
    if len(arrays) < 2:
        return
    try:
        shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
    except ValueError:  # not an elementwise node
        return
    dtype = max((_value_bytes(a)[1] for a in arrays), key=lambda d: np.dtype(d).itemsize)
    ctx.check_size(shape, dtype, "its inputs broadcast together")


def _to_host(out):
    """A handler's result as numpy (lists and tuples element-wise; None stays None)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_to_host(x) for x in out)
    return out if out is None or _is_host_value(out) else np.asarray(out)


def _check_text(where, *values):
    """Names and op types must be text (protobuf hands back bytes for invalid UTF-8)."""
    for v in values:
        if not isinstance(v, str):
            raise OnnxImportError(f"{where}: {v!r} is not valid UTF-8 text")


def _unavailable(ctx, *args, **kwargs):
    raise ctx.error("no handler")  # never reached: load fails first


def _func_name(node):
    for a in node.attribute:
        if a.name == "func_name":
            return _text(a.s)
    return None


def _free_names(node) -> set:
    """Names a node's subgraphs read from enclosing scopes."""
    free = set()
    for g in subgraphs(node):
        local = {vi.name for vi in g.input} | {t.name for t in g.initializer}
        local |= {s.values.name for s in g.sparse_initializer}
        local |= {o for n in g.node for o in n.output}
        for n in g.node:
            free |= {i for i in n.input if i and i not in local}
            free |= _free_names(n) - local
        free |= {vi.name for vi in g.output if vi.name not in local}
    return free


def registered_ops() -> dict:
    """Every (domain, op_type) with a handler (ai.onnx, training, com.microsoft)."""
    from jaxops.onnx import resolve

    return resolve.supported()


__all__ = ["NodeContext", "Program", "registry", "registered_ops"]
