"""Every registered CPU FFI target refuses element types it does not support with a clean
INVALID_ARGUMENT naming the dtype, never a crash (issue 21).

A registered target is public: anyone can reach it through `jax.ffi.ffi_call`, past the
Python checks. Sub-byte types (int4, uint2, float4_e2m1fn, ...) pack several elements per
byte, so a handler that sizes a copy as elements * ByteWidth overruns the heap (the concat
handler aborted the process). The calls run in a subprocess so that a crash fails the test
instead of killing pytest.
"""
import json
import subprocess
import sys
import textwrap

import pytest

# One call per target: CALLS[target](bad) -> (results, args, attrs), where the data buffers
# take dtype `bad` and the other buffers (indices, scalars, statistics) keep valid types; with
# bad=float32 every call is valid (checked below, so the specs are known to be right). ALL_BAD
# makes every buffer `bad` instead.
_SCRIPT = textwrap.dedent(r'''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxops import _cpu
    from jaxops._src.ffi import available_platforms

    available_platforms()
    S = jax.ShapeDtypeStruct
    f32, i32, b = jnp.float32, jnp.int32, jnp.bool_  # int32 steps: x64 is off
    R, C, N = 4, 2048, 3

    def arr(shape, dt):
        return jnp.zeros(shape, dt)

    def concat(t):
        return [S((R, 2 * C), t)], [arr((R, C), t), arr((R, C), t)], dict(axis=np.int64(1))

    def split(t):
        return [S((R, C), t), S((R, C), t)], [arr((R, 2 * C), t)], dict(axis=np.int64(1))

    def gather(t):
        return ([S((8, C), t)], [arr((N,), i32), arr((N, C), t)],
                dict(axis=np.int64(0), v=np.int64(8)))

    def encoder(t):
        return [S((R, C), jnp.uint8)], [arr((R, C), t)], {}

    def decoder(t):
        return [S((R, C), t)], [arr((R, C), jnp.uint8)], {}

    def softmax(t):
        return ([S((R, C), t)], [arr((R, C), t), arr((R, C), t)],
                dict(axis=np.int64(1), through_end=np.int64(0)))

    def sce_fwd(t, log_prob=False):
        res = [S((R,), f32), S((R,), f32)] + ([S((R, C), t)] if log_prob else [])
        return res, [arr((R, C), t), arr((R,), i32)], dict(out_type=np.int64(1)) if log_prob else {}

    def sce_bwd(t, bias=False):
        args = [arr((R,), f32), arr((R, C), t), arr((R,), f32), arr((R,), i32)]
        return ([S((R, C), t)], args + ([arr((R, C), t)] if bias else []),
                dict(out_type=np.int64(1)))

    def layer_norm(t, simplified=False, invertible=False):
        middle = [] if simplified else [arr((C,) if invertible else (R,), f32)]  # bias or mean
        small = [arr((C,), f32)] + middle + [arr((R,), f32)]
        res = [S((R, C), t), S((C,), f32)] + ([] if simplified else [S((C,), f32)])
        args = [arr((R, C), t), arr((R, C), t)] + small
        return res, args, dict(axis=np.int64(1), batch=np.int64(0))

    def bn_grad(t):
        return ([S((R, N, C), t), S((N,), f32), S((N,), f32)],
                [arr((R, N, C), t), arr((R, N, C), t)] + [arr((N,), f32)] * 3,
                dict(batch=np.int64(0)))

    def bn_train(t):
        return ([S((R, N, C), t)] + [S((N,), f32)] * 4, [arr((R, N, C), t)] + [arr((N,), f32)] * 4,
                dict(epsilon=np.float32(1e-5), momentum=np.float32(0.9), batch=np.int64(0)))

    def adamw(t):
        w = [arr((R, C), t) for _ in range(2)]
        return ([S((), b)] + [S((R, C), t)] * 6,
                [arr((), f32), arr((), i32), jnp.ones((), b)] + w * 4,
                dict(count=np.int64(2), alpha=np.float32(0.9), beta=np.float32(0.999),
                     epsilon=np.float32(1e-8), weight_decay=np.float32(0.0),
                     correct_bias=np.int64(1), adam_mode=np.int64(0)))

    def sgd(t):
        w = [arr((R, C), t) for _ in range(2)]
        return ([S((), b)] + [S((R, C), t)] * 2, [arr((), f32), jnp.ones((), b)] + w * 2,
                dict(count=np.int64(2)))

    def lamb(t):
        w = [arr((R, C), t) for _ in range(2)]
        scalars = [jnp.ones((), b), arr((), f32), arr((), f32), arr((), f32), arr((), i32),
                   arr((2, 5), f32)]
        return ([S((), i32)] + [S((R, C), t)] * 8, scalars + w * 4,
                dict(count=np.int64(2), ratio_min=np.float32(0), ratio_max=np.float32(1e9),
                     do_bias_correction=np.int64(1), has_step=np.int64(1), has_norm=np.int64(0),
                     new_gradients=np.int64(1)))

    def conv_nhwc(t):  # the epilogue's scale and shift read (affine 1), a Relu's bounds
        return ([S((2, 4, 4, 8), t)], [arr((2, 6, 6, 3), t), arr((3, 3, 3, 8), t),
                                       arr((8,), t), arr((8,), t)],
                dict(sh=np.int64(1), sw=np.int64(1), dh=np.int64(1), dw=np.int64(1),
                     ph=np.int64(0), pw=np.int64(0), groups=np.int64(1), affine=np.int64(1),
                     lo=np.float32(0), hi=np.float32(np.inf), isa=np.int64(0),
                     threads=np.int64(1)))

    def depthwise(role):  # x [2, 3, 5, 5] by w [6, 1, 3, 3] (multiplier 2), pads 1
        shapes = {"y": (2, 6, 5, 5), "x": (2, 3, 5, 5), "w": (6, 1, 3, 3)}
        operands, result = {"fwd": (("x", "w"), "y"), "dx": (("y", "w"), "x"),
                            "dw": (("y", "x"), "w")}[role]
        return lambda t: ([S(shapes[result], t)], [arr(shapes[o], t) for o in operands],
                          dict(dh=np.int64(1), dw=np.int64(1), ph=np.int64(1), pw=np.int64(1),
                               isa=np.int64(0)))

    def max_pool(t):  # x [2, 6, 6, 3], 3x3 stride 2, pads 1
        return ([S((2, 3, 3, 3), t)], [arr((2, 6, 6, 3), t)],
                {k: np.int64(v) for k, v in dict(kh=3, kw=3, sh=2, sw=2, dh=1, dw=1, ph=1, pw=1,
                                                 isa=0).items()})

    def take_ranges(t):  # two pieces with a gap between them
        return ([S((2, 3), t), S((4,), t)], [arr((20,), t)], dict(offsets=np.array([1, 9])))

    CALLS = {
        "jaxops_conv_nhwc": conv_nhwc,
        "jaxops_take_ranges": take_ranges,
        "jaxops_max_pool_nhwc": max_pool,
        "jaxops_depthwise_conv": depthwise("fwd"),
        "jaxops_depthwise_conv_dx": depthwise("dx"),
        "jaxops_depthwise_conv_dw": depthwise("dw"),
        "jaxops_concat_training": concat,
        "jaxops_split_training": split,
        "jaxops_gather_grad": gather,
        "jaxops_gist_pack_msfp15_encoder": encoder,
        "jaxops_gist_pack_msfp15_decoder": decoder,
        "jaxops_softmax_grad": softmax,
        "jaxops_log_softmax_grad": softmax,
        "jaxops_sce_fwd": sce_fwd,
        "jaxops_sce_fwd_log_prob": lambda t: sce_fwd(t, log_prob=True),
        "jaxops_sce_bwd": sce_bwd,
        "jaxops_sce_bwd_bias": lambda t: sce_bwd(t, bias=True),
        "jaxops_layer_normalization_grad": layer_norm,
        "jaxops_invertible_layer_normalization_grad": lambda t: layer_norm(t, invertible=True),
        "jaxops_simplified_layer_normalization_grad": lambda t: layer_norm(t, simplified=True),
        "jaxops_batch_normalization_grad": bn_grad,
        "jaxops_batch_norm_internal": bn_train,
        "jaxops_adamw_optimizer": adamw,
        "jaxops_sgd_optimizer_v2": sgd,
        "jaxops_lamb_optimizer": lamb,
    }
    missing = sorted(set(_cpu.registrations()) - set(CALLS))
    print(json.dumps({"missing": missing}), flush=True)

    def all_bad(results, args, bad):
        return ([S(r.shape, bad) for r in results], [arr(a.shape, bad) for a in args])

    bad_names = [n for n in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn") if hasattr(jnp, n)]
    cases = [(target, "float32", False) for target in CALLS]
    cases += [(target, n, every) for target in CALLS for n in bad_names for every in (False, True)]
    for target, name, every in cases:
        print(json.dumps({"start": [target, name, every]}), flush=True)  # names a crash
        results, args, attrs = CALLS[target](jnp.dtype(name))
        if every:
            results, args = all_bad(results, args, jnp.dtype(name))
        try:
            jax.block_until_ready(jax.ffi.ffi_call(target, results)(*args, **attrs))
            error = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            error = f"{type(e).__name__}: {e}"
        print(json.dumps({"case": [target, name, every], "error": error}), flush=True)
    print(json.dumps({"done": True}), flush=True)
''')


def _run():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, lines


@pytest.fixture(scope="module")
def sweep():
    return _run()


def test_no_crash(sweep):
    proc, lines = sweep
    started = [x["start"] for x in lines if "start" in x]
    assert proc.returncode == 0 and lines and lines[-1] == {"done": True}, (
        f"exit {proc.returncode} while calling {started[-1] if started else None}:\n"
        f"{proc.stderr[-3000:]}")


def test_every_target_covered(sweep):
    _, lines = sweep
    assert lines and lines[0] == {"missing": []}, "add the new targets to CALLS"


def test_valid_dtype_runs(sweep):
    """The specs are right: with float32 data every call succeeds."""
    _, lines = sweep
    runs = [x for x in lines if "case" in x and x["case"][1] == "float32"]
    assert len(runs) >= 19
    assert all(x["error"] is None for x in runs), [x for x in runs if x["error"]]


def test_unsupported_dtypes_refused(sweep):
    _, lines = sweep
    refused = [x for x in lines if "case" in x and x["case"][1] != "float32"]
    assert refused
    for x in refused:
        target, name, _ = x["case"]
        error = x["error"] or ""
        assert "INVALID_ARGUMENT" in error and f"unsupported dtype {name}" in error, x
