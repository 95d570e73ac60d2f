"""Every ```python block of README.md and docs/*.md runs as written.

A block runs as a user would run it: in a fresh Python process (JAX's defaults: x64 off), in an
empty working directory, on JAX's CPU backend. An HTML comment on the line before the block (or
the nearest non-blank line before it) says what it needs, space-separated:

    <!-- test: devices=2 -->            that many CPU devices (XLA_FLAGS device count)
    <!-- test: needs=NAME,NAME -->      files put in the working directory or Python names
                                        defined before the block: the keys of PROVIDED below
    <!-- test: continues -->            runs after the file's previous block, in its process
                                        (a page whose blocks build on each other)
    <!-- test: not-run: REASON -->      not runnable by design (a GPU, several hosts, a user's
                                        own model): reported as a skip with the reason

A block without a comment runs on one device with nothing provided. Other fences (bash
commands, diagrams) are not run.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tiny_model(path):
    """model.onnx: y = tanh(x @ W + b), x: FLOAT[2, 4], W and b float initializers."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["z"]),
         helper.make_node("Tanh", ["z"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _pipeline_model(path):
    from onnx import save
    from test_p2p import _pipeline_model as pipeline

    save(pipeline(), path)


# What `needs=` can name: a file/folder made in the working directory (a callable taking its
# path), or a Python name (a string: code run before the block, in the block's namespace).
PROVIDED = {
    "artifacts": lambda path: shutil.copytree(DATA / "mlp", path),  # ORT's training artifacts
    "batches": "import numpy as np\n_data = np.load(%r)\n"
               "batches = list(zip(_data['inputs'][:3], _data['labels'][:3]))"
               % str(DATA / "mlp" / "data.npz"),  # (inputs, labels) for the artifacts above
    "model.onnx": _tiny_model,
    "x": "import numpy as np\nx = np.ones((2, 4), np.float32)",  # model.onnx's input
    "pipeline.onnx": _pipeline_model,  # docs/p2p.md's 2-stage pipeline (tests/test_p2p.py)
}

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*test:(.*?)-->\s*$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the code's first line
    code: str
    devices: int = 1
    needs: list = field(default_factory=list)
    continues: bool = False
    not_run: str | None = None


def _options(block, text):
    text = text.strip()
    if text.startswith("not-run"):
        block.not_run = text.partition(":")[2].strip()
        assert block.not_run, f"{block.page}:{block.line}: not-run needs a reason"
        return
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "devices":
            block.devices = int(value)
        elif key == "needs":
            block.needs = value.split(",")
            unknown = set(block.needs) - set(PROVIDED)
            assert not unknown, f"{block.page}:{block.line}: nothing provides {unknown}"
        elif key == "continues":
            block.continues = True
        else:
            raise AssertionError(f"{block.page}:{block.line}: unknown test option {word!r}")


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if lang == "python":
            code = textwrap.dedent("\n".join(lines[i + 1:end]))
            block = Block(page.name, i + 2, code)
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = _MARK.match(before)
            if mark:
                _options(block, mark.group(1))
            blocks.append(block)
        i = end + 1
    return blocks


def _groups():
    """Blocks that run together: a block and those that continue it."""
    groups = []
    for page in PAGES:
        for block in python_blocks(page):
            if block.continues:
                assert groups and groups[-1][0].page == block.page, \
                    f"{block.page}:{block.line} continues no earlier block of its page"
                groups[-1].append(block)
            else:
                groups.append([block])
    return groups


GROUPS = _groups()
# Runs the blocks of a group one after another in one namespace; each compiled under its
# page:line so that a traceback names the block.
_DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for name, code in json.load(sys.stdin):
    exec(compile(code, name, "exec"), namespace)
"""


def test_blocks_are_found():
    blocks = [b for g in GROUPS for b in g]
    assert len(blocks) >= 9 and {b.page for b in blocks} >= {"README.md", "p2p.md"}
    assert any(b.devices > 1 for b in blocks) and any(b.continues for b in blocks)


@pytest.mark.parametrize("group", GROUPS, ids=[f"{g[0].page}:{g[0].line}" for g in GROUPS])
def test_block_runs(group, tmp_path):
    reasons = [b.not_run for b in group if b.not_run]
    if reasons:  # reported in pytest's summary of skips (-rs), with the reason
        pytest.skip(f"not runnable by design: {reasons[0]}")
    steps = []
    for block in group:
        for name in block.needs:
            provide = PROVIDED[name]
            if callable(provide):
                if not (tmp_path / name).exists():
                    provide(tmp_path / name)
            else:
                steps.append((f"<provided {name}>", provide))
        steps.append((f"{block.page}:{block.line}", block.code))
    devices = max(b.devices for b in group)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    run = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(steps), cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
