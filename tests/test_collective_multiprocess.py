"""The multi-process path: two processes on loopback joined by jax.distributed (CPU, gloo),
each with 2 devices, run the collectives over one 4-device mesh."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
from test_collective import _adasum_reference

WORKER = textwrap.dedent("""
    import json, os, sys
    pid, port = int(sys.argv[1]), sys.argv[2]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxops import ops

    mesh = jax.make_mesh((4,), ("data",))
    x = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 7
    spec = P("data")
    arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
    out = {}
    for name in ("nccl_all_reduce", "nccl_all_gather", "nccl_reduce_scatter", "adasum_all_reduce"):
        fn = getattr(ops, name)
        body = lambda v: jax.numpy.concatenate(fn(v[0, :32], v[0, 32:]))[None]
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        res = f(arr)
        out[name] = {str(s.index[0].start): np.asarray(s.data)[0].tolist()
                     for s in res.addressable_shards}
    print("RESULT" + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                                 "out": out}))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_loopback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    results = {}
    try:
        for p in procs:
            text, _ = p.communicate(timeout=120)
            line = [ln for ln in text.splitlines() if ln.startswith("RESULT")]
            assert p.returncode == 0 and line, text[-3000:]
            r = json.loads(line[0][len("RESULT"):])
            results[r["process"]] = r
    finally:
        for p in procs:
            p.kill()
    assert sorted(results) == [0, 1] and all(r["devices"] == 4 for r in results.values())
    x = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 7
    out = {name: {int(r): np.array(v) for p in (0, 1) for r, v in results[p]["out"][name].items()}
           for name in results[0]["out"]}
    assert all(sorted(rows) == [0, 1, 2, 3] for rows in out.values())  # 2 ranks per process
    for r in range(4):
        np.testing.assert_allclose(out["nccl_all_reduce"][r], x.sum(0), rtol=1e-6)
        # two 32-element tensors on 4 ranks: 32 elements per rank, tensor t owned by rank t
        np.testing.assert_array_equal(out["nccl_all_gather"][r], np.r_[x[0, :32], x[1, 32:]])
        want = x[r].copy()
        if r < 2:
            want[32 * r:32 * r + 32] = x[:, 32 * r:32 * r + 32].sum(0)
        np.testing.assert_allclose(out["nccl_reduce_scatter"][r], want, rtol=1e-6)
        np.testing.assert_array_equal(out["adasum_all_reduce"][r], out["adasum_all_reduce"][0])
    want = np.r_[_adasum_reference(list(x[:, :32])), _adasum_reference(list(x[:, 32:]))]
    np.testing.assert_allclose(out["adasum_all_reduce"][0], want, rtol=1e-5)
