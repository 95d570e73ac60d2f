"""If, Loop and Scan: subgraphs run through `ctx.run_graph`, which sees the enclosing values.

If: a condition known without the data picks its branch at trace time; a traced one goes
through `lax.cond` (both branches must then give the same shapes, as XLA needs).
Loop: while the trip count and the condition stay known without the data, the loop runs in
Python (unrolled under jit; exact ONNX semantics, scan outputs of any shape). A condition that
depends on the data is handled with `lax.while_loop` (no scan outputs then, since their length
would depend on the data); a long loop over traced values with a known trip count uses
`lax.scan`.
Scan: `lax.scan` over the scan axis (opset 9 on; opset 8's batch axis and sequence_lens too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from onnx import helper

from jaxops.onnx.registry import handler

_UNROLL = 64  # a loop over traced values with more iterations than this goes through lax.scan


def _outputs(values):
    return tuple(values) if len(values) != 1 else values[0]


def _truth(ctx, x, what):
    x = ctx.static(x, what)
    if x.size != 1:
        raise ctx.error(f"{what} must hold one element, has shape {x.shape}")
    return bool(x.reshape(()))


# -- If --------------------------------------------------------------------------------------

@handler("If", since=1)
def if_(ctx, cond, *, then_branch, else_branch):
    if ctx.is_static(cond):
        branch = then_branch if _truth(ctx, cond, "cond") else else_branch
        return _outputs(ctx.run_graph(branch))
    pred = jnp.reshape(cond, ()).astype(bool)
    out = jax.lax.cond(pred, lambda: _as_jax(ctx.run_graph(then_branch)),
                       lambda: _as_jax(ctx.run_graph(else_branch)))
    return _outputs(list(out))


def _as_jax(values):
    return [jax.tree_util.tree_map(jnp.asarray, v) for v in values]


# -- Loop ------------------------------------------------------------------------------------

@handler("Loop", since=1)
def loop(ctx, M=None, cond=None, *v_initial, body):
    n_carried = len(v_initial)
    n_scan = len(body.output) - 1 - n_carried
    if n_scan < 0:
        raise ctx.error(f"the body gives {len(body.output)} outputs for {n_carried} "
                        "loop-carried values (it must give cond + carried + scan outputs)")
    trips = None if M is None else int(ctx.static(M, "M (the trip count)").reshape(()))
    if cond is not None and not ctx.is_static(cond):
        return _while_loop(ctx, trips, cond, v_initial, body, n_scan)
    if (trips is not None and trips > _UNROLL
            and not all(ctx.is_static(v) for v in v_initial)):
        return _scan_loop(ctx, trips, cond, v_initial, body, n_scan)

    keep_going = True if cond is None else _truth(ctx, cond, "cond")
    values, scans, i = list(v_initial), [[] for _ in range(n_scan)], 0
    live = None  # once the body's condition depends on the data: the traced "still running"
    while keep_going and (trips is None or i < trips):
        # an iteration runs only under a true condition, so the body's cond input is True
        out = ctx.run_graph(body, np.array(i, np.int64), np.array(True), *values)
        c, new, scanned = out[0], out[1:1 + n_carried], out[1 + n_carried:]
        i += 1
        if live is None and ctx.is_static(c):
            keep_going = _truth(ctx, c, "the body's condition")
            values = list(new)
            for s, x in zip(scans, scanned):
                s.append(x)
            continue
        # the condition became data-dependent: run on to the trip count, freezing the
        # carried values once it turns false
        if trips is None or n_scan:
            raise ctx.error("the loop's condition depends on the data while the loop has "
                            + ("scan outputs" if n_scan else "no trip count (M)")
                            + ": its length would be data-dependent")
        c = jnp.reshape(c, ()).astype(bool)
        if live is None:  # this iteration ran under a true condition
            values, live = list(new), c
        else:
            values = [jnp.where(live, n, o) for n, o in zip(new, values)]
            live = jnp.logical_and(live, c)
    return _outputs(values + [_stack(ctx, s, body, k + 1 + n_carried)
                              for k, s in enumerate(scans)])


def _stack(ctx, items, body, out_index):
    if not items:  # zero iterations: an empty tensor of the declared type
        t = body.output[out_index].type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else np.float32
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        return np.zeros([0] + dims, dtype)
    if all(isinstance(x, np.ndarray) for x in items):
        return np.stack(items)
    return jnp.stack([jnp.asarray(x) for x in items])


def _while_loop(ctx, trips, cond, v_initial, body, n_scan):
    if n_scan:
        raise ctx.error("a loop whose condition depends on the data cannot have scan outputs "
                        "(their length would depend on the data)")
    limit = np.iinfo(np.int64).max if trips is None else trips

    def step(state):
        i, _, values = state
        out = ctx.run_graph(body, i, np.array(True), *values)
        new = [jnp.asarray(x).astype(jnp.asarray(o).dtype) for x, o in zip(out[1:], values)]
        return i + 1, jnp.reshape(out[0], ()).astype(bool), new

    def go_on(state):
        i, c, _ = state
        return jnp.logical_and(c, i < limit)

    init = (jnp.asarray(0, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32),
            jnp.reshape(cond, ()).astype(bool), [jnp.asarray(v) for v in v_initial])
    _, _, values = jax.lax.while_loop(go_on, step, init)
    return _outputs(list(values))


def _scan_loop(ctx, trips, cond, v_initial, body, n_scan):
    """A known trip count over traced values: one traced body; a data-dependent condition
    only freezes the carried values (so it needs no scan outputs)."""
    start = True if cond is None else _truth(ctx, cond, "cond")
    if not start:
        return _outputs(list(v_initial) + [_stack(ctx, [], body, k + 1 + len(v_initial))
                                           for k in range(n_scan)])

    def step(carry, i):
        live, values = carry
        out = ctx.run_graph(body, i, np.array(True), *values)
        c, new, scanned = out[0], out[1:1 + len(values)], out[1 + len(values):]
        if scanned and not (ctx.is_static(c) and _truth(ctx, c, "the body's condition")):
            raise ctx.error("a loop with scan outputs must keep its condition true without "
                            "depending on the data")
        new = [jnp.where(live, jnp.asarray(n).astype(jnp.asarray(o).dtype), o)
               for n, o in zip(new, values)]
        live = jnp.logical_and(live, jnp.reshape(c, ()).astype(bool))
        return (live, new), [jnp.asarray(s) for s in scanned]

    counter = np.arange(trips, dtype=np.int64 if jax.config.jax_enable_x64 else np.int32)
    (_, values), scanned = jax.lax.scan(
        step, (jnp.asarray(True), [jnp.asarray(v) for v in v_initial]), counter)
    return _outputs(list(values) + list(scanned))


# -- Scan ------------------------------------------------------------------------------------

@handler("Scan", since=9)
def scan(ctx, *inputs, body, num_scan_inputs, scan_input_axes=None,
         scan_input_directions=None, scan_output_axes=None, scan_output_directions=None):
    n_state = len(inputs) - num_scan_inputs
    if n_state < 0:
        raise ctx.error(f"num_scan_inputs={num_scan_inputs} but the node has {len(inputs)} "
                        "inputs")
    states, xs = list(inputs[:n_state]), list(inputs[n_state:])
    n_out = len(body.output) - n_state
    in_axes = scan_input_axes or [0] * len(xs)
    in_dirs = scan_input_directions or [0] * len(xs)
    out_axes = scan_output_axes or [0] * n_out
    out_dirs = scan_output_directions or [0] * n_out
    moved = []
    for x, axis, d in zip(xs, in_axes, in_dirs):
        x = jnp.moveaxis(jnp.asarray(x), axis, 0)
        moved.append(jnp.flip(x, 0) if d else x)
    if not moved:
        raise ctx.error("Scan needs at least one scan input")
    length = moved[0].shape[0]
    if any(m.shape[0] != length for m in moved):
        raise ctx.error(f"scan inputs differ in length along their scan axes: "
                        f"{[m.shape[0] for m in moved]}")

    def step(carry, x):
        out = ctx.run_graph(body, *carry, *x)
        new = [jnp.asarray(n).astype(jnp.asarray(o).dtype) for n, o in zip(out[:n_state], carry)]
        return new, [jnp.asarray(y) for y in out[n_state:]]

    final, ys = jax.lax.scan(step, [jnp.asarray(s) for s in states], moved, length=length)
    outs = []
    for y, axis, d in zip(ys, out_axes, out_dirs):
        y = jnp.flip(y, 0) if d else y
        outs.append(jnp.moveaxis(y, 0, axis % y.ndim))
    return _outputs(list(final) + outs)


@handler("Scan", since=8)
def scan_8(ctx, sequence_lens, *inputs, body, num_scan_inputs, directions=None):
    """Opset 8: a leading batch axis on every input, scan along axis 1 of the scan inputs."""
    if sequence_lens is not None:
        lens = ctx.static(sequence_lens, "sequence_lens")
        full = jnp.asarray(inputs[-1]).shape[1]
        if np.any(lens != full):
            raise ctx.error("sequence_lens shorter than the scan axis is not supported")
    def one(*row):
        return scan(ctx, *row, body=body, num_scan_inputs=num_scan_inputs,
                    scan_input_directions=directions)

    return jax.vmap(one)(*[jnp.asarray(x) for x in inputs])
