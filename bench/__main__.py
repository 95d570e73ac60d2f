"""python -m bench [--quick] [--out results.json] [--only NAME[,NAME...]] [--list]"""
import argparse
import datetime
import fnmatch
import importlib
import os
import sys
from pathlib import Path

# Before jax is imported: allocate on demand (torch shares the GPU in the same process).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One module per op family: bench/<family>.py with `cases(quick) -> list[bench.harness.Case]`.
FAMILIES = sorted(p.stem for p in Path(__file__).parent.glob("*.py")
                  if not p.stem.startswith("_") and p.stem != "harness")


def _matches(case, patterns):
    for p in patterns:
        if p in (case.family, case.op) or p in case.name or fnmatch.fnmatchcase(case.name, p):
            return True
    return False


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small shapes (runs on CPU in seconds)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/<time>.json); "
                   "the table also goes next to it as .md")
    p.add_argument("--only", help="comma list: a family, an op, a case-name substring or glob")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--budget", type=float, help="seconds of timing per implementation and case")
    args = p.parse_args(argv)

    from bench import harness

    cases = []
    for family in FAMILIES:
        cases += importlib.import_module(f"bench.{family}").cases(args.quick)
    if args.only:
        pats = [x.strip() for x in args.only.split(",") if x.strip()]
        cases = [c for c in cases if _matches(c, pats)]
        if not cases:
            sys.exit(f"--only {args.only!r} matches no case (see --list)")
    if args.list:
        for c in cases:
            print(c.name)
        return 0
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path(__file__).resolve().parent / "results" / f"{stamp}{'-quick' if args.quick else ''}.json"
    report = harness.run(cases, quick=args.quick, out=out, budget_s=args.budget)
    failed = [r["name"] for r in report["results"]
              if r["impls"].get("jaxops", {}).get("status") != "ok"
              or not r["impls"]["jaxops"].get("correct")]
    if failed:
        print(f"jaxops failed (error or check) in {len(failed)} case(s): {', '.join(failed)}")
    return 1 if failed or not report["complete"] else 0


if __name__ == "__main__":
    sys.exit(main())
