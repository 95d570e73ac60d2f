"""Times bench/optim's cases phase by phase (inputs, first call = compile + run, later calls),
to find where a case's time goes when the bench runs out of its time box.

    python tools/optim_phases.py [layers] [kind ...]
"""
import sys
import time

import jax

from bench import optim as bo


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    kinds = sys.argv[2:] or ["adamw", "lamb"]
    shapes = bo.gpt2_small_shapes(layers=layers)
    for kind in kinds:
        c = bo.case(kind, shapes, f"l{layers}")
        t = time.perf_counter()
        args = jax.block_until_ready(c.make_inputs(jax.random.key(0)))
        print(f"{c.name}: inputs {time.perf_counter() - t:.1f} s", flush=True)
        for name, f in [("jaxops", c.jaxops), *c.xla.items(), ("reference", c.reference)]:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - t)
            print(f"  {name}: " + ", ".join(f"{x:.3f} s" for x in times), flush=True)


if __name__ == "__main__":
    main()
