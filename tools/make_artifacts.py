"""Generate ORT training artifacts and ORT's reference losses for tests/data/.

Needs Python 3.11 with torch==2.13.0 (CPU), onnxruntime-training-cpu==1.19.2 and onnx<1.18
(ORT 1.19.2's generate_artifacts refuses newer IR versions):

    python3.11 -m venv /tmp/artifacts
    /tmp/artifacts/bin/pip install torch==2.13.0 onnxruntime-training-cpu==1.19.2 "onnx<1.18"
    /tmp/artifacts/bin/python tools/make_artifacts.py            # writes tests/data/<model>/

For each model (mlp: embedding + MLP; cnn: Conv/BatchNorm/MaxPool; transformer: 2 encoder
layers with LayerNorm, GELU, softmax attention, dropout 0) it exports the forward graph with
torch's legacy exporter, runs `generate_artifacts` (CrossEntropyLoss, AdamW), then trains 20
steps in ORT on fixed data and records the losses and the final checkpoint:

    tests/data/<model>/{training,eval,optimizer}_model.onnx, checkpoint, data.npz,
    reference.json (ORT's losses, eval loss, lr, steps), checkpoint_after (ORT's state after)

The transformer is bench/_transformer.py's, shared with the train-step benchmark. `--bench`
writes that benchmark's graphs instead, the same transformer at two sizes (BENCH below):

    /tmp/artifacts/bin/python tools/make_artifacts.py --bench  # writes bench/data/<size>/

    bench/data/<size>/{training,optimizer}_model.onnx, config.json (the architecture)

Only the graphs are kept: parameters are graph inputs, so the graphs are small files (150 kB
for the 46M-parameter model), and the benchmark starts from fresh parameters (the seeded
default init of the same torch model); the checkpoint (the weights) and the eval model are
deleted. LayerNorm weights are randomised before the export: equal initializers would be
merged into one parameter (as the fixture's LayerNorms are, all tied to layers.0.norm1).
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from onnxruntime.training import api as ort_api
from onnxruntime.training import artifacts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._transformer import Transformer  # noqa: E402  (needs ROOT on the path)

STEPS = 20
DATA_BATCHES = 64  # the first STEPS train in the reference run; the last one evaluates
LR = 1e-2
SEED = 0


class MLP(torch.nn.Module):
    """Embedding -> mean over tokens -> Linear -> ReLU -> Linear."""

    def __init__(self, vocab=64, dim=16, hidden=32, classes=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, ids):
        h = self.embed(ids).mean(dim=1)
        return self.fc2(torch.relu(self.fc1(h)))


class CNN(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU -> MaxPool -> Linear."""

    def __init__(self, channels=4, classes=5):
        super().__init__()
        # no conv bias: BatchNorm cancels it, so its gradient is rounding noise, which AdamW
        # amplifies to full-size steps and any two implementations then drift apart
        self.conv = torch.nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(channels)
        self.fc = torch.nn.Linear(channels * 4 * 4, classes)
        with torch.no_grad():  # distinct values: ORT's update would overwrite aliased ones
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)
            self.bn.running_mean.uniform_(-0.1, 0.1)
            self.bn.running_var.uniform_(0.9, 1.1)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


def batches(name, rng, count, batch=8):
    """Fixed data with a learnable rule: `count` batches of (input, labels)."""
    if name == "cnn":  # label: the brightness quintile of the image's top-left quadrant
        xs = rng.standard_normal((count, batch, 1, 8, 8)).astype(np.float32)
        score = xs[:, :, 0, :4, :4].mean(axis=(2, 3))
        ys = np.searchsorted(np.quantile(score, [0.2, 0.4, 0.6, 0.8]), score)
    else:  # label: the first token's id mod 5
        xs = rng.integers(0, 64, (count, batch, 8)).astype(np.int64)
        ys = xs[:, :, 0] % 5
    return xs, ys.astype(np.int64)


def export(model, example, path, opset):
    model.eval()  # BatchNorm must be exported in eval mode or ORT refuses eval_model.onnx
    torch.onnx.export(model, (torch.from_numpy(example),), str(path), input_names=["input"],
                      output_names=["output"], opset_version=opset, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.EVAL, dynamo=False)


def make(name, model, opset, out):
    rng = np.random.default_rng(SEED)
    xs, ys = batches(name, rng, DATA_BATCHES)
    out.mkdir(parents=True, exist_ok=True)
    fwd = out / "forward.onnx"
    export(model, xs[0], fwd, opset)
    forward = onnx.load(str(fwd))
    for node in forward.graph.node:  # else generate_artifacts fails on opset-17 LayerNorm
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}_mean", f"{node.output[0]}_inv_std"])
    requires_grad = [t.name for t in forward.graph.initializer
                     if not t.name.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    artifacts.generate_artifacts(forward, requires_grad=requires_grad, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(out))
    fwd.unlink()

    state = ort_api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = ort_api.Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    optimizer = ort_api.Optimizer(str(out / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()
    losses = []
    for x, y in zip(xs[:STEPS], ys[:STEPS]):
        losses.append(float(module(x.copy(), y.copy())))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    eval_loss = float(module(xs[-1].copy(), ys[-1].copy()))
    ort_api.CheckpointState.save_checkpoint(state, str(out / "checkpoint_after"),
                                           include_optimizer_state=True)

    np.savez(out / "data.npz", inputs=xs, labels=ys)
    (out / "reference.json").write_text(json.dumps({
        "steps": STEPS, "lr": LR, "train_losses": losses, "eval_loss": eval_loss,
        "made_by": f"tools/make_artifacts.py (torch {torch.__version__}, onnx {onnx.__version__}, "
                   f"onnxruntime {onnxruntime.__version__})",
    }, indent=1) + "\n")
    print(f"{name}: losses {losses[0]:.4f} -> {losses[-1]:.4f}, eval {eval_loss:.4f}")


MODELS = {"mlp": (MLP, 14), "cnn": (CNN, 14), "transformer": (Transformer, 17)}

# The train-step benchmark's transformers (bench/train_step.py): the size and a
# quick one for CPU runs and tests. The batch is part of the graph (its shapes are static).
BENCH = {
    "transformer_l6_d768_s512_b16": dict(vocab=4096, dim=768, heads=12, hidden=3072, layers=6,
                                         classes=5, seq=512, batch=16),
    # GPT-2-small-sized (124M): its vocabulary (padded to 50304), width, depth and context
    "transformer_l12_d768_s1024_b8": dict(vocab=50304, dim=768, heads=12, hidden=3072,
                                          layers=12, classes=5, seq=1024, batch=8),
    "transformer_l2_d64_s32_b4": dict(vocab=256, dim=64, heads=4, hidden=256, layers=2,
                                      classes=5, seq=32, batch=4),
}


def make_bench(name, config, out):
    arch = {k: v for k, v in config.items() if k != "batch"}
    torch.manual_seed(SEED)
    model = Transformer(**arch)
    with torch.no_grad():  # distinct values: the exporter merges equal initializers (it ties
        for m in model.modules():  # every LayerNorm of the fixture into one parameter)
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    ids = np.zeros((config["batch"], config["seq"]), np.int64)
    out.mkdir(parents=True, exist_ok=True)
    fwd = out / "forward.onnx"
    export(model, ids, fwd, 17)
    forward = onnx.load(str(fwd))
    for node in forward.graph.node:  # as in make(): opset-17 LayerNorm needs its extra outputs
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}_mean", f"{node.output[0]}_inv_std"])
    names = [n for n, _ in model.named_parameters()]
    missing = set(names) - {t.name for t in forward.graph.initializer}
    if missing:
        raise RuntimeError(f"{name}: parameters {sorted(missing)} were not exported as such")
    artifacts.generate_artifacts(forward, requires_grad=names, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(out))
    for f in ("forward.onnx", "checkpoint", "eval_model.onnx"):
        (out / f).unlink()
    params = sum(p.numel() for p in model.parameters())
    (out / "config.json").write_text(json.dumps({
        **config, "params": params,
        "made_by": f"tools/make_artifacts.py --bench (torch {torch.__version__}, onnx "
                   f"{onnx.__version__}, onnxruntime {onnxruntime.__version__})",
    }, indent=1) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    print(f"{name}: {params / 1e6:.1f}M parameters, files {sizes}")


def main():
    onnxruntime.set_default_logger_severity(3)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="default: tests/data, or bench/data with --bench")
    p.add_argument("--bench", action="store_true", help="write the benchmark's graphs (BENCH)")
    p.add_argument("models", nargs="*", help=f"default: all of {list(MODELS)} (or of BENCH)")
    args = p.parse_args()
    table = BENCH if args.bench else MODELS
    out = args.out or ROOT / ("bench" if args.bench else "tests") / "data"
    for name in args.models or list(table):
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        if args.bench:
            make_bench(name, table[name], target)
        else:
            cls, opset = table[name]
            torch.manual_seed(SEED)
            make(name, cls(), opset, target)


if __name__ == "__main__":
    main()
