"""python -m bench.all [--parts kernels,optim_api,train_step,cpu_corpus] [--quick] [--out F.md]

Every benchmark of the project in one command, each part in its own process (so one part's
GPU memory and compiled programs do not weigh on the next), their tables gathered into one
markdown report with the machine, the date and the commit:

  kernels     python -m bench: each kernel against the XLA-compiled reference and PyTorch
              eager, in µs, GB/s and % of measured copy bandwidth;
  optim_api   python -m bench.optim_api: AdamW the ways users call it (optax, jaxops.optim's
              update and .step, the ORT-API mirror), in a jitted loop and per call;
  train_step  python -m bench.train_step: whole training steps of imported ORT graphs against
              PyTorch eager and torch.compile;
  cpu_corpus  JAX_PLATFORMS=cpu python -m bench.cpu_corpus: the real-model corpus's training
              step and forward against ORT on the CPU, at 1 thread and at all.

On one H100 the whole run takes longer than one 10-minute device call: run it in parts
(`--parts kernels`, then `--parts optim_api,train_step,cpu_corpus`) and join the reports.
docs/bench-report.md is such a report, pasted as written; docs/performance.md discusses it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = {
    "kernels": (["-m", "bench"], {}),
    "optim_api": (["-m", "bench.optim_api"], {}),
    "train_step": (["-m", "bench.train_step"], {}),
    "cpu_corpus": (["-m", "bench.cpu_corpus"], {"JAX_PLATFORMS": "cpu"}),
}


def _tables(text: str) -> str:
    """The markdown tables (and the lines just before each) of a part's output."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|"):
            if not out or not out[-1].startswith("|"):
                title = next((lines[j] for j in range(i - 1, max(-1, i - 4), -1)
                              if lines[j].strip()), "")
                out += ["", title, ""] if title and not title.startswith("|") else [""]
            out.append(line)
    return "\n".join(out).strip()


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_part(name: str, quick: bool, timeout: float, log=print) -> tuple[str, int, float]:
    args, env = PARTS[name]
    cmd = [sys.executable, *args, *(["--quick"] if quick else [])]
    t = time.perf_counter()
    log(f"== {name}: {' '.join(cmd[1:])}")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, text=True,
                              capture_output=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, rc = out + f"\n(timed out after {timeout:.0f} s)", 124
    log(text[-4000:])
    return text, rc, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    p.add_argument("--quick", action="store_true", help="each part's small shapes")
    p.add_argument("--timeout", type=float, default=900, help="seconds per part")
    p.add_argument("--out", type=Path, help="the report (default bench/results/<time>-all.md)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or ROOT / "bench" / "results" / f"{stamp:%Y%m%d-%H%M%S}-all.md"
    report = [f"Run {stamp:%Y-%m-%d %H:%M} UTC, commit {_git()}, host {platform.node()}, "
              f"`python -m bench.all --parts {','.join(parts)}{' --quick' if args.quick else ''}`"]
    failed = []
    for name in parts:
        text, rc, seconds = run_part(name, args.quick, args.timeout)
        status = "" if rc == 0 else f" (exit {rc})"
        report += ["", f"### {name}{status}, {seconds:.0f} s", "", _tables(text) or "(no table)"]
        if rc:
            failed.append(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"\nwrote {out}")
    return 1 if failed else 0


def cases(quick):  # not a harness family
    return []


if __name__ == "__main__":
    sys.exit(main())
