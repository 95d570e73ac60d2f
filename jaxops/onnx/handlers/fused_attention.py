"""Attention written out in a training graph, run as one fused attention.

Exported transformers spell attention as MatMul(Q, K^T) -> Div or Mul by a scalar -> Softmax
-> MatMul(., V), and ORT's gradient builder adds its backward as FusedMatMuls around a
SoftmaxGrad_13. Run node by node, the [batch, heads, seq, seq] probabilities and their gradient
cross memory several times a layer: at seq 1024 they are most of a bf16 step's memory traffic.
Under precision="bf16" (jaxops.onnx.precision) `fuse_attention` replaces each such forward and
its backward, when every intermediate value is used only inside the pattern, by two nodes:

  FusedAttention(Q, KT, V, c) -> O                      (scale: 1/c for Div, c for Mul)
  FusedAttentionGrad(Q, KT, V, c, dO) -> dQ, dKT, dV

which run cuDNN's flash attention (jax.nn.dot_product_attention) on a GPU for bf16/f16 operands
of a head size it takes, and elsewhere the graph's own formula, as the policy runs the nodes
(bf16 products, the softmax in float32). Float32 graphs are rewritten too when jax runs on a
GPU: there float32 operands take jaxops' own flash attention (Pallas; no bias, lengths a
multiple of 64, power-of-2 head sizes), otherwise the written-out formula with ORT's
SoftmaxGrad_13 kernel in its backward, as unfused. Where Q, K and V are thirds of one fused QKV
projection, both nodes also take the projection itself and the backward node makes its
gradient (_packed_source, _packed_gradient). Both nodes call the same jax.vjp on the same
operands, so XLA keeps one forward a layer (the backward's training forward). cuDNN
keeps scores and probabilities in float32 inside the kernel and rounds the probabilities to
bf16 before the product with V, as the policy's own MatMul reads them. An
additive mask or bias between the scale and the softmax (Add) is taken along when nothing
trains it (its gradient would read the softmax's); dropout on the probabilities, or an
intermediate used elsewhere, leaves the pattern as written.
JAXOPS_DISABLE=fused_attention turns the rewrite off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from jaxops._src import flash_attention
from jaxops.nn import softmax as nn_softmax

from ..registry import handler
from ._patterns import Graph as _Graph, attrs as _attrs, is_op as _is
from .p2p import DOMAIN
from .shape import reshape

_FWD, _BWD = "FusedAttention", "FusedAttentionGrad"


def _fused_matmul(node, trans_a, trans_b) -> bool:
    """A com.microsoft FusedMatMul that is op(A) @ op(B) with these transposes and nothing else
    (alpha 1, no batch transposes)."""
    if not _is(node, "FusedMatMul", "com.microsoft"):
        return False
    a = _attrs(node)
    return (a.get("transA", 0) == trans_a and a.get("transB", 0) == trans_b
            and a.get("alpha", 1.0) == 1.0 and not a.get("transBatchA", 0)
            and not a.get("transBatchB", 0))


def _scores_side(g, add):
    """(scores input, bias input) of Add(scaled scores, bias), or None: the scores side is the
    one a MatMul, or a Div/Mul of one, produces (both: which is which is not known, None)."""
    sides = []
    for i in (0, 1):
        p = g.producer.get(add.input[i])
        inner = g.producer.get(p.input[0]) if _is(p, "Div") or _is(p, "Mul") else p
        if _is(inner, "MatMul"):
            sides.append((add.input[i], add.input[1 - i]))
    return sides[0] if len(sides) == 1 else None


def _match(g: _Graph, softmax, opset: int):
    """(new nodes, replaced nodes) for the attention around `softmax`, or None."""
    a = _attrs(softmax)
    if a.get("axis", -1 if opset >= 13 else 1) != -1:
        return None
    if g.only_consumer(softmax.input[0]) is not softmax:
        return None
    logits, bias, add = softmax.input[0], "", None
    if _is(g.producer.get(logits), "Add"):  # an additive mask or bias
        add = g.producer[logits]
        sides = _scores_side(g, add)
        if sides is None or g.only_consumer(sides[0]) is not add:
            return None
        logits, bias = sides
    scaled = g.producer.get(logits)
    if _is(scaled, "Div") or _is(scaled, "Mul"):
        scores, c, scale_op = g.producer.get(scaled.input[0]), scaled.input[1], scaled.op_type
        if g.only_consumer(scaled.input[0]) is not scaled:
            return None
    else:
        scores, c, scale_op, scaled = scaled, "", "", None
    if not _is(scores, "MatMul"):
        return None
    q, kt = scores.input
    probs = softmax.output[0]
    users = g.consumers.get(probs, [])
    if probs in g.outputs or not users:
        return None
    forward = [n for n in users if _is(n, "MatMul") and n.input[0] == probs]
    if len(forward) != 1:
        return None
    v, o = forward[0].input[1], forward[0].output[0]
    attrs = {"scale_op": scale_op}
    name = softmax.name or "Softmax"
    replaced = [scores, scaled, add, softmax, forward[0]]
    qkv = _packed_source(g, q, kt, v)
    if len(users) == 1:  # an inference graph: the forward alone
        return [_fwd_node(name, [q, kt, v, c, bias], qkv, o, attrs)], replaced
    backward = _match_backward(g, users, forward[0], probs, q, kt, v, c, scale_op)
    if backward is None:
        return None
    grad_nodes, outs, d_out = backward
    inputs = [q, kt, v, c, d_out, bias]
    concat = _packed_gradient(g, outs) if qkv else None
    if concat is None:  # both nodes packed or neither: they share one forward (_attend_vjp)
        qkv = None
    else:
        concat, between, shapes = concat
        inputs += [qkv, *shapes]
        outs, grad_nodes = [concat.output[0]], grad_nodes + between + [concat]
    fwd = _fwd_node(name, [q, kt, v, c, bias], qkv, o, attrs)
    if qkv is not None:
        attrs = {**attrs, "packed": 1, "concat_axis": _attrs(concat)["axis"]}
    bwd = onnx.helper.make_node(_BWD, inputs, outs, domain=DOMAIN, name=f"{name}/fused_grad",
                                **attrs)
    return [fwd, bwd], replaced + grad_nodes


def _fwd_node(name, inputs, qkv, o, attrs):
    return onnx.helper.make_node(_FWD, inputs + ([qkv] if qkv else []), [o], domain=DOMAIN,
                                 name=f"{name}/fused", **attrs)


# A fused QKV projection split in three: Q, K^T and V are Transpose(Reshape(Split output i))
# with these permutations; their gradients go back through the inverse permutations and a
# Concat. Both ends then pass the packed [B, T, 3D] tensor (_packed_operand checks the shapes
# at run time), so the float32 kernel reads it as it is and writes its gradient packed.
_PERMS = ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])
_GRAD_PERMS = ([0, 2, 1, 3], [0, 3, 1, 2], [0, 2, 1, 3])


def _packed_source(g, q, kt, v):
    """The input of the Split that Q, K^T and V come from, or None."""
    split = None
    for i, (name, perm) in enumerate(zip((q, kt, v), _PERMS)):
        t = g.producer.get(name)
        if not _is(t, "Transpose") or _attrs(t).get("perm") != perm:
            return None
        r = g.producer.get(t.input[0])  # (any allowzero: the run-time shapes decide)
        if not _is(r, "Reshape"):
            return None
        s = g.producer.get(r.input[0])
        if not _is(s, "Split") or (split is not None and s is not split):
            return None
        split = s
        if list(s.output).index(r.input[0]) != i:
            return None
    if len(split.output) != 3 or _attrs(split).get("axis", 0) not in (-1, 2):
        return None
    return split.input[0]


def _packed_gradient(g, grads):
    """(Concat, the nodes between, the Reshapes' shape inputs) that pack dQ, dK^T and dV into
    the gradient of the packed source, or None."""
    between, shapes, concat = [], [], None
    for i, (name, perm) in enumerate(zip(grads, _GRAD_PERMS)):
        t = g.only_consumer(name)
        if not _is(t, "Transpose") or _attrs(t).get("perm") != perm:
            return None
        r = g.only_consumer(t.output[0])
        if not _is(r, "Reshape") or _attrs(r).get("allowzero"):
            return None
        c = g.only_consumer(r.output[0])
        if (not _is(c, "Concat") or (concat is not None and c is not concat)
                or len(c.input) != 3 or c.input[i] != r.output[0]):
            return None
        concat = c
        between += [t, r]
        shapes.append(r.input[1])
    if _attrs(concat).get("axis") not in (-1, 2):
        return None
    return concat, between, shapes


def _past_identities(g, value, nodes):
    """The value after a chain of Identity nodes each read only by the next (appended to
    nodes)."""
    while (step := g.only_consumer(value)) is not None and _is(step, "Identity"):
        nodes.append(step)
        value = step.output[0]
    return value


def _match_backward(g, users, forward, probs, q, kt, v, c, scale_op):
    """ORT's gradient of the forward: (its nodes, [dQ, dKT, dV], dO), or None."""
    rest = [n for n in users if n is not forward]
    dv = [n for n in rest if _fused_matmul(n, 1, 0) and n.input[0] == probs]
    sgrad = [n for n in rest if _is(n, "SoftmaxGrad_13", "com.microsoft") and n.input[1] == probs
             and _attrs(n).get("axis", -1) == -1]
    if len(rest) != 2 or len(dv) != 1 or len(sgrad) != 1:
        return None
    dv, sgrad = dv[0], sgrad[0]
    d_out = dv.input[1]
    da = g.producer.get(sgrad.input[0])
    if (not _fused_matmul(da, 0, 1) or list(da.input) != [d_out, v]
            or g.only_consumer(sgrad.input[0]) is not sgrad):
        return None
    nodes = [dv, da, sgrad]
    # the mask's Add passes the gradient on as is (an Identity); a bias that is trained would
    # also read it (a second consumer: no match)
    value = _past_identities(g, sgrad.output[0], nodes)
    if scale_op:  # the scale's gradient: the same op by the same scalar
        unscale = g.only_consumer(value)
        if not _is(unscale, scale_op) or list(unscale.input) != [value, c]:
            return None
        nodes.append(unscale)
        value = _past_identities(g, unscale.output[0], nodes)
    users = g.consumers.get(value, [])
    dq = [n for n in users if _fused_matmul(n, 0, 1) and list(n.input) == [value, kt]]
    dkt = [n for n in users if _fused_matmul(n, 1, 0) and list(n.input) == [q, value]]
    if value in g.outputs or len(users) != 2 or len(dq) != 1 or len(dkt) != 1:
        return None
    return nodes + dq + dkt, [dq[0].output[0], dkt[0].output[0], dv.output[0]], d_out


def fuse_attention(graph: onnx.GraphProto, opset: int) -> onnx.GraphProto:
    """`graph` with each matched attention fused (a copy), or `graph` itself when none is."""
    g = _Graph(graph)
    new, gone = [], set()
    for node in g.nodes:
        if _is(node, "Softmax"):
            found = _match(g, node, opset)
            if found is not None:
                new += found[0]
                gone.update(id(n) for n in found[1] if n is not None)
    if not new:
        return graph
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    del copy.node[:]
    copy.node.extend([n for n in g.nodes if id(n) not in gone] + new)
    return copy


def _scale(c, scale_op, label):
    if not scale_op:
        return 1.0
    if not isinstance(c, (np.ndarray, np.generic, float, int)) or np.size(c) != 1:
        return None  # known only at run time
    c = float(np.asarray(c).reshape(()))
    if scale_op == "Div" and c == 0:
        raise ValueError(f"{label}: attention scores divided by 0")
    return 1.0 / c if scale_op == "Div" else c


def _written_out(q, kt, v, c, scale_op, bias):
    """The graph's own formula (the fallback): bf16 products, the softmax in float32."""
    s = jnp.matmul(q, kt)
    if scale_op:
        c = jnp.asarray(c, s.dtype)
        s = s / c if scale_op == "Div" else s * c
    if bias is not None:
        s = s + bias
    # float32 graphs keep the SoftmaxGrad_13 kernel of their unfused backward
    softmax = nn_softmax if s.dtype == jnp.float32 else jax.nn.softmax
    p = softmax(s.astype(jnp.float32), axis=-1)
    return jnp.matmul(p.astype(v.dtype), v)


def _cudnn(q) -> bool:
    """Whether cuDNN's flash attention applies: a GPU, bf16/f16, a head size that is a multiple
    of 8 up to 128."""
    return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def _flash_f32(q4, k4, v4, scale):
    """Float32 flash attention on a GPU ([B, N, T, H] operands; jaxops/_src/flash_attention.py),
    or None where it does not apply: see flash_attention.applies."""
    btnh = lambda x: jnp.swapaxes(x, 1, 2)
    q, k, v = btnh(q4), btnh(k4), btnh(v4)
    if not flash_attention.applies(q, k, v):
        return None
    return btnh(flash_attention.flash_attention(q, k, v, scale))


def _as_bnts(bias, shape):
    """The bias as [B or 1, N or 1, T, S] for scores of `shape` [B, N, T, S] (what the fused
    call broadcasts itself), or None where it does not broadcast to them."""
    if bias.ndim > 4:
        return None
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    try:
        np.broadcast_shapes(bias.shape, shape)
    except ValueError:
        return None
    lead = [d if d == full else 1 for d, full in zip(bias.shape[:2], shape[:2])]
    return jnp.broadcast_to(bias, (*lead, *shape[2:]))


def _attend(q, kt, v, c, scale_op, label, bias=None):
    """O = softmax(scale * Q K^T + bias) V over the last two axes; leading axes are batch (a
    rank-4 Q is [batch, heads, seq, head])."""
    if q.ndim < 3 or q.ndim > 4 or q.ndim != kt.ndim or q.ndim != v.ndim:
        raise ValueError(f"{label}: Q, K^T and V must share a rank of 3 or 4, got {q.shape}, "
                         f"{kt.shape}, {v.shape}")
    scale = _scale(c, scale_op, label)
    if scale is None and jnp.size(c) == 1 and jax.default_backend() == "gpu":
        # a scale known only at run time (an initializer jit passes as an argument): folded
        # into Q, so the fused kernels keep a static one (one more rounding of Q in bf16)
        c = jnp.reshape(c, ()).astype(jnp.float32)
        q = (q * (1 / c if scale_op == "Div" else c)).astype(q.dtype)
        c, scale_op, scale = None, "", 1.0
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, jnp.swapaxes(kt, -1, -2), v))
    scores = (*q4.shape[:3], k4.shape[2])
    b = None if bias is None else _as_bnts(bias.astype(q.dtype), scores)
    same = (q4.shape[:2] == k4.shape[:2] == v4.shape[:2] and k4.shape[2] == v4.shape[2]
            and q4.shape[3] == k4.shape[3] == v4.shape[3])  # no broadcast batch, one head size
    if not same or scale is None or len({q.dtype, kt.dtype, v.dtype}) != 1:
        return _written_out(q, kt, v, c, scale_op, bias)
    if bias is None and (out := _flash_f32(q4, k4, v4, scale)) is not None:
        return out if q.ndim == 4 else out[0]
    if not _cudnn(q) or (bias is not None and b is None):
        return _written_out(q, kt, v, c, scale_op, bias)
    # dot_product_attention's layout is [batch, seq, heads, head]
    btnh = lambda x: jnp.swapaxes(x, 1, 2)
    try:
        out = btnh(jax.nn.dot_product_attention(btnh(q4), btnh(k4), btnh(v4), bias=b,
                                                scale=scale, implementation="cudnn"))
    except NotImplementedError:  # a shape cuDNN refuses (e.g. odd lengths with a bias, training)
        return _written_out(q, kt, v, c, scale_op, bias)
    return out if q.ndim == 4 else out[0]


def _packed_operand(qkv, q, kt, v, c, scale_op, label, bias):
    """The packed source as [B, T, 3, N, H] where the float32 kernel takes it (the shapes say
    Q, K^T and V are its thirds, split on the last axis, heads then head size), else None."""
    if qkv is None or bias is not None or q.ndim != 4 or np.ndim(qkv) != 3:
        return None
    b, n, t, h = q.shape
    if (kt.shape != (b, n, h, t) or v.shape != q.shape or qkv.shape != (b, t, 3 * n * h)
            or len({qkv.dtype, q.dtype, kt.dtype, v.dtype}) != 1
            or _scale(c, scale_op, label) is None):
        return None
    packed = jnp.reshape(qkv, (b, t, 3, n, h))
    return packed if flash_attention.applies_packed(packed) else None


def _attend_vjp(q, kt, v, c, scale_op, label, bias, qkv=None):
    """jax.vjp of the attention: in the packed source (one cotangent, the source's gradient)
    where the kernel reads it packed, else in Q, K^T and V. Both nodes call it on the same
    operands, so the forward node's output and the backward's training forward are one
    computation that XLA's common-subexpression pass keeps once."""
    packed = _packed_operand(qkv, q, kt, v, c, scale_op, label, bias)
    if packed is not None:
        scale = _scale(c, scale_op, label)
        attend = flash_attention.flash_attention_packed
        return jax.vjp(lambda x: jnp.swapaxes(attend(x.reshape(packed.shape), scale), 1, 2),
                       qkv)
    return jax.vjp(lambda a, b, w: _attend(a, b, w, c, scale_op, label, bias), q, kt, v)


def _onnx_reshape(shape, dims):
    """Reshape's target for an input of `dims` (allowzero 0: a 0 copies the input's size, one
    -1 takes what is left), or None where `shape` is not known at trace time."""
    if not isinstance(shape, (np.ndarray, np.generic)):
        return None
    out = [dims[i] if d == 0 else int(d) for i, d in enumerate(np.asarray(shape).reshape(-1))]
    if out.count(-1) == 1:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(dims)) // known if known else 0
    return tuple(out)


def _packed_grad(ctx, grads, shapes, axis):
    """The replaced Transposes, Reshapes and Concat on dQ, dK^T and dV."""
    parts = [reshape(ctx, jnp.transpose(d, perm), shape)
             for d, perm, shape in zip(grads, _GRAD_PERMS, shapes)]
    return jnp.concatenate(parts, axis=axis)


@handler(_FWD, domain=DOMAIN)
def fused_attention(ctx, q, kt, v, c=None, bias=None, qkv=None, *, scale_op):
    return _attend_vjp(q, kt, v, c, scale_op, ctx.name, bias, qkv)[0]


@handler(_BWD, domain=DOMAIN)
def fused_attention_grad(ctx, q, kt, v, c, d_out, bias=None, qkv=None, *shapes, scale_op,
                         packed=0, concat_axis=-1):
    if packed:
        b, n, t, h = q.shape if q.ndim == 4 else (0,) * 4
        if any(_onnx_reshape(s, (b, t, n, h)) != (b, t, n * h) for s in shapes):
            qkv = None  # not the packed source's layout: the replaced nodes' formula
    out, vjp = _attend_vjp(q, kt, v, c, scale_op, ctx.name, bias, qkv)
    grads = vjp(d_out.astype(out.dtype))
    if not packed or len(grads) == 1:
        return grads
    return _packed_grad(ctx, grads, shapes, concat_axis)
