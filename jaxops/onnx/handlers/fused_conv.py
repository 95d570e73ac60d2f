"""Conv -> BatchNormalization -> Relu or Clip, run as one convolution with an epilogue.

CNN exports write each convolution's BatchNormalization (inference) and activation as nodes of
their own: on the CPU, after the convolution kernel (jaxops/ops/conv_cpu.py), XLA ran them as one
more pass over the activations each, at ~0.5 ns an element where their per-channel factors are
broadcast (RegNet's 3-channel stem: 3.7 us for the pass against 3.8 us for the convolution,
one core, 2026-11-28). `fuse_conv` replaces a Conv whose output only a BatchNormalization in
inference mode (training_mode 0, one output) reads, a Relu or a Clip (opset >= 11) after
either, or both, by one node:

  FusedConv(X, W, B, scale, bias, mean, var, min, max) -> Y   (absent inputs: '')

with the Conv's attributes, the BatchNormalization's epsilon and `activation` ('', 'Relu' or
'Clip'). Where conv_general takes the CPU kernel, it applies the BatchNormalization folded into
one factor and one offset a channel (k = scale / sqrt(var + epsilon), y = sum * k +
(B - mean) * k + bias) and the activation's bounds as it stores each tile; elsewhere (a GPU,
XLA's convolution, bounds that depend on the data, parameters that are not per-channel vectors)
the replaced nodes' own formulas run, as unfused. JAXOPS_DISABLE=fused_conv turns the rewrite off.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
import onnx

from jaxops.ops.conv import Epilogue

from ..registry import handler
from ._patterns import Graph, attrs, is_op
from .activation import relu
from .conv import convolve, with_bias
from .elementwise import clip_11
from .norm import batch_norm
from .p2p import DOMAIN

_OP = "FusedConv"


def _inference_bn(node, reads) -> bool:
    a = attrs(node)
    return (is_op(node, "BatchNormalization") and node.input[0] == reads
            and not a.get("training_mode", 0) and not any(node.output[1:]))


def _match(g: Graph, conv, opset: int):
    """(the fused node, the replaced nodes) for the chain after `conv`, or None."""
    out, bn, act = conv.output[0], None, None
    after = g.only_consumer(out)
    if after is not None and _inference_bn(after, out):
        bn, out = after, after.output[0]
        after = g.only_consumer(out)
    if after is not None and after.input[0] == out and (
            is_op(after, "Relu") or (is_op(after, "Clip") and opset >= 11)):
        act, out = after, after.output[0]
    if bn is None and act is None:
        return None
    pad = lambda names, n: list(names) + [""] * (n - len(names))
    inputs = (pad(conv.input, 3) + (pad(bn.input[1:], 4) if bn else [""] * 4)
              + (pad(act.input[1:], 2) if act is not None and act.op_type == "Clip" else
                 ["", ""]))
    extra = {"epsilon": attrs(bn).get("epsilon", 1e-5)} if bn else {}
    node = onnx.helper.make_node(_OP, inputs, [out], domain=DOMAIN, name=f"{conv.name}/fused",
                                 activation=act.op_type if act is not None else "",
                                 **attrs(conv), **extra)
    return node, [conv, bn, act]


def fuse_conv(graph: onnx.GraphProto, opset: int) -> onnx.GraphProto:
    """`graph` with each matched chain fused (a copy), or `graph` itself when none is."""
    g = Graph(graph)
    new, gone = {}, set()
    for node in g.nodes:
        if is_op(node, "Conv"):
            found = _match(g, node, opset)
            if found is not None:
                replaced = [n for n in found[1] if n is not None]
                # in the last replaced node's place: every input is ready there
                new[id(replaced[-1])] = found[0]
                gone.update(id(n) for n in replaced)
    if not new:
        return graph
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    del copy.node[:]
    copy.node.extend(new.get(id(n), n) for n in g.nodes if id(n) not in gone or id(n) in new)
    return copy


def _bounds(ctx, activation, lo, hi):
    """The activation's static [lo, hi], or None where a bound depends on the data."""
    if activation == "Relu":
        return 0.0, math.inf
    if activation != "Clip":
        return -math.inf, math.inf
    if not ctx.is_static([lo, hi]):
        return None
    lo, hi = (None if v is None else np.asarray(ctx.static(v)) for v in (lo, hi))
    if any(v is not None and v.size != 1 for v in (lo, hi)):
        return None
    return (-math.inf if lo is None else float(lo.reshape(())),
            math.inf if hi is None else float(hi.reshape(())))


@handler(_OP, domain=DOMAIN)
def fused_conv(ctx, x, w, b=None, scale=None, bias=None, mean=None, var=None, lo=None,
               hi=None, *, activation="", epsilon=1e-5, **conv_attrs):
    operands = (b, scale, bias, mean, var)  # (None where absent)

    def exact(y, b, *bn):  # the replaced nodes, node by node
        y = with_bias(y, b)
        if bn[0] is not None:
            y = batch_norm(ctx, y, *bn, epsilon=epsilon)
        if activation == "Relu":
            y = relu(ctx, y)
        elif activation == "Clip":
            y = clip_11(ctx, y, lo, hi)
        return y

    def folded(b, *bn):
        f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)
        b, (s, beta, m, v) = f32(b), map(f32, bn)
        if s is None:
            return None, b  # (a bias alone: the kernel's shift)
        return _bn_factors(jnp, b, s, beta, m, v, epsilon)

    bounds = _bounds(ctx, activation, lo, hi)
    vectors = all(jnp.shape(v) == (w.shape[0],) for v in operands if v is not None)
    if not (bounds and vectors):  # the kernel cannot take it: the nodes as written
        return exact(convolve(ctx, x, w, **conv_attrs), *operands)
    if scale is not None and w.dtype == jnp.float32 and ctx.is_static([w, *operands]):
        # f32 constant weights and statistics (an inference forward, program.jit()): the
        # BatchNormalization folded into the weights, w * k, and one shift, as ORT's Conv +
        # BatchNormalization fusion computes it, here in numpy (the weights stay constants:
        # the CPU kernel takes them packed); the program then holds two constants a
        # convolution where it held up to five (each costs XLA:CPU an allocation a call,
        # ~0.08 us on one core)
        w, shift = _folded_into_weights(ctx, w, b, scale, bias, mean, var, epsilon)
        return convolve(ctx, x, w, **conv_attrs, epilogue=Epilogue(
            (shift,), functools.partial(_shifted, bounds), lambda s: (None, s), *bounds))
    return convolve(ctx, x, w, **conv_attrs,
                    epilogue=Epilogue(operands, exact, folded, *bounds))


def _folded_into_weights(ctx, w, b, scale, bias, mean, var, epsilon):
    """(w * k, shift) in f32 numpy, k = scale / sqrt(var + epsilon) a channel, shift =
    bias + (b - mean) * k (b absent: 0): folded's factors, k applied to the weights."""
    f32 = lambda v: None if v is None else np.asarray(ctx.static(v), np.float32)
    w, b, s, beta, m, v = map(f32, (w, b, scale, bias, mean, var))
    k, shift = _bn_factors(np, b, s, beta, m, v, epsilon)
    return w * k.reshape((-1,) + (1,) * (w.ndim - 1)), shift


def _bn_factors(xp, b, s, beta, m, v, epsilon):
    """(k, shift) of a BatchNormalization after a convolution with bias b (None: none), in
    f32 with xp = jnp (traced) or np (constants, computed once): y = conv * k + shift."""
    k = s / xp.sqrt(v + xp.float32(epsilon))
    return k, beta + ((-m) if b is None else (b - m)) * k


def _shifted(bounds, y, shift):
    """y + shift [C] clamped to the static bounds (lo, hi): what the folded epilogue computes
    where the kernel does not run."""
    y = with_bias(y, shift.astype(y.dtype))
    lo, hi = bounds
    if lo != -math.inf:
        y = jnp.maximum(y, jnp.asarray(lo, y.dtype))
    if hi != math.inf:
        y = jnp.minimum(y, jnp.asarray(hi, y.dtype))
    return y
