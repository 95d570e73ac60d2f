"""GIST encoders and decoders against copy bandwidth (issue 10's target: each at least 80% of
copy bandwidth on 256 MiB of float32 input; bytes = what an ideal kernel reads + writes: the
input read and the packed output written for an encoder, the reverse for a decoder).

"jaxops" is the op under jax.jit: XLA code, except msfp15's kernels (jaxops/ops/gist.py says
why). Where a second jnp formulation exists it is the XLA peer: jnp.packbits/unpackbits for
pack1, the pure-JAX reference for msfp15.
PyTorch eager is the peer where it has the same operation (comparisons, casts, shifts); pack8
and msfp15 have no torch equivalent (torch=None). The reference is the op itself where no
independent jnp formulation exists: tests/test_gist.py checks the ops bit for bit against a
per-element model.
"""
import jax
import jax.numpy as jnp

from bench.harness import MiB, Case
from jaxops import ops
from jaxops.reference import gist as ref

FAMILY = "gist"
WIDTH = 1024  # msfp15 tiles run along the last axis: inputs are [N / 1024, 1024]
FLOAT = 1


def _pack1_torch(torch, x):
    shifts = torch.arange(7, -1, -1, device=x.device, dtype=torch.uint8)
    return ((x > 0).reshape(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def _unpack1_torch(torch, b):
    shifts = torch.arange(7, -1, -1, device=b.device, dtype=torch.uint8)
    return ((b.reshape(-1, 1) >> shifts) & 1).reshape(-1).to(torch.float32)


def _unpack1_jnp(b):
    return jnp.unpackbits(b.reshape(-1)).astype(jnp.float32)


# name -> (encoder, packed bytes per element, decoder, XLA alternatives (enc, dec), torch (enc, dec))
CODECS = {
    "binarize": (ops.gist_binarize_encoder, 1, lambda b: ops.gist_binarize_decoder(b, to=FLOAT),
                 (lambda x: x > 0, lambda b: b.astype(jnp.float32)),
                 (lambda t, x: x > 0, lambda t, b: b.to(t.float32))),
    "pack1": (ops.gist_pack1_encoder, 1 / 8, lambda b: ops.gist_pack1_decoder(b, to=FLOAT),
              (lambda x: jnp.packbits(x.reshape(-1) > 0), _unpack1_jnp),
              (_pack1_torch, _unpack1_torch)),
    "pack8": (ops.gist_pack8_encoder, 1, lambda b: ops.gist_pack8_decoder(b, to=FLOAT),
              None, None),
    "pack16": (ops.gist_pack16_encoder, 2, lambda h: ops.gist_pack16_decoder(h, to=FLOAT),
               (lambda x: x.astype(jnp.float16), lambda h: h.astype(jnp.float32)),
               (lambda t, x: x.half(), lambda t, h: h.float())),
    "msfp15": (ops.gist_pack_msfp15_encoder, 1,
               lambda b: ops.gist_pack_msfp15_decoder(b, to=FLOAT),
               (ref.msfp15_encoder, ref.msfp15_decoder), None),
}


def _shape(input_bytes):
    n = input_bytes // 4
    return (n // WIDTH, WIDTH)


def _float_input(shape):
    def make(key):
        return (jax.random.normal(key, shape, jnp.float32),)
    return make


def _packed_input(shape, encode):
    def make(key):
        return (encode(jax.random.normal(key, shape, jnp.float32)),)
    return make


def cases(quick: bool) -> list[Case]:
    input_bytes = 1 * MiB if quick else 256 * MiB
    shape = _shape(input_bytes)
    n = shape[0] * shape[1]
    out = []
    for name, (enc, per_elem, dec, alt, torch) in CODECS.items():
        packed = int(n * per_elem)
        out.append(Case(
            name=f"gist/{name}_encoder/f32/{input_bytes // MiB}MiB", family=FAMILY,
            op=f"gist_{name}_encoder", dtype="f32", shape=shape, params={},
            make_inputs=_float_input(shape), jaxops=enc,
            reference=alt[0] if alt else enc, xla={"jnp": alt[0]} if alt else {},
            torch=torch[0] if torch else None, bytes=4 * n + packed, tol=0.0))
        out.append(Case(
            name=f"gist/{name}_decoder/f32/{input_bytes // MiB}MiB", family=FAMILY,
            op=f"gist_{name}_decoder", dtype="f32", shape=shape, params={},
            make_inputs=_packed_input(shape, enc), jaxops=dec,
            reference=alt[1] if alt else dec, xla={"jnp": alt[1]} if alt else {},
            torch=torch[1] if torch else None, bytes=packed + 4 * n, tol=0.0))
    return out
