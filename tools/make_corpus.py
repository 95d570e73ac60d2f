"""Build tests/data/corpus/: small real-architecture ORT training artifacts and ORT's references.

Every model is one of the libraries' own classes (transformers, torchvision, timm) in a tiny
configuration (2 layers or the fewest blocks the class allows, widths 16-64, vocab 128, 32x32
images (ResNet 128x128), batch 2, sequences 8-12, dropout 0), wrapped so that its one output is a
2-D [N, C] tensor: logits for CrossEntropyLoss (an LM's [b, s, V] as [b*s, V]), or, for the
Whisper encoder, its last hidden state [b*frames, d] for MSELoss. Each family is exported with
both torch exporters:

    <family>_ts      torch.onnx.export(..., dynamo=False), opset 17, TrainingMode.EVAL,
                     do_constant_folding=False
    <family>_dynamo  torch.onnx.export(..., dynamo=True), opset 18, static shapes,
                     optimize=False, then the exporter's optimizer run with the weights held as
                     graph inputs (see optimize_keeping_parameters: left as initializers, the
                     optimizer folds parameters into constants and BatchNorm into Conv)

then goes through onnxruntime.training.artifacts.generate_artifacts (AdamW; trainable: every float
initializer that is a torch parameter, i.e. every weight but no buffer: BatchNorm's running stats
and the exporters' own constants stay frozen) and 5 AdamW steps (lr 1e-3) of ORT's training API
on fixed random data (the same for both exporters). It writes

    tests/data/corpus/<family>_<exporter>/
        training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint
                          as generate_artifacts writes them (the graphs are not edited after it)
        reference.npz     in_<name> [5, ...] for each user input of the training model (labels
                          or target included), losses [5] (float64, ORT's loss of each step of
                          module(...); optimizer.step(); module.lazy_reset_grad()), and
                          grad_<param> (ORT's gradient after step 1's module() call)
        reference.json    family, exporter, opset, loss ("ce" | "mse"), lr, steps, inputs (in the
                          order module() takes them), trainable, source, made_by, label_input,
                          and checks against torch on the same weights and data:
                          torch_step1_loss and grad_check (the worst relative gradient error)
    tests/data/corpus/manifest.json   every (family, exporter) tried: status "ok" |
                          "forward_only" | "failed", for the others the stage (export |
                          generate_artifacts | ort_training) and the error's first line, and
                          the exporter workaround used

Forward-only families: ORT 1.19.2 has no gradient builder for HardSwish (MobileNetV3) or
Softplus (Mamba), and no CPU kernel for ResizeGrad (DeepLabV3's bilinear upsampling; there the
generated artifacts are kept, untested by ORT). They get forward.onnx (the exported graph, IR
version clamped to 10), reference.npz with in_<name> [5, ...], labels [5, ...], torch_losses [5]
(torch's loss of each batch at the initial weights, in eval mode as forward.onnx computes it) and
torch_grad_<param> (torch's eval-mode gradient for the first batch), and reference.json with
"forward_only": true and ORT's error in why_forward_only.

Before exporting, every parameter or buffer whose values are all equal (LayerNorm/BatchNorm
weights and biases, layer scales, class tokens, running stats) gets distinct random values: the
TorchScript exporter merges equal initializers into one, and ORT's update overwrites BatchNorm
stats that alias its scale or bias. At opset 17 LayerNormalization needs its optional mean and
inv-std outputs declared or generate_artifacts fails; they are added to every LayerNormalization of
the forward graph (both exporters) before generate_artifacts, and IR versions above 10 are
lowered to 10. ORT's training graph runs BatchNorm in training mode (batch statistics) although
the forward graph was exported in eval mode, so the torch checks use torch's train mode.

Set-up (Python 3.11; torch's Python 3.12 wheel pulls a multi-GB CUDA build here):

    python3.11 -m venv /work/venvs/gen
    /work/venvs/gen/bin/python -m pip install torch==2.14.1 torchvision==0.29.1
    /work/venvs/gen/bin/python -m pip install timm transformers onnx==1.17.0 onnxscript \\
        onnxruntime-training-cpu==1.19.2
    # seen working: timm 1.0.31, transformers 5.23.0, onnxscript 0.7.2, onnx-ir 1.1.0, numpy 2.4.6

Run:

    /work/venvs/gen/bin/python tools/make_corpus.py                 # every family
    /work/venvs/gen/bin/python tools/make_corpus.py gpt2 resnet     # some; the manifest is merged
    /work/venvs/gen/bin/python tools/make_corpus.py --exporters ts gpt2
"""
import argparse
import contextlib
import copy
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "corpus"
STEPS = 5
LR = 1e-3
SEED = 0
BATCH = 2
OPSETS = {"ts": 17, "dynamo": 18}
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


NOTES = [
    "ts: torch.onnx.export(dynamo=False, opset_version=17, do_constant_folding=False, "
    "training=TrainingMode.EVAL); dynamo: torch.onnx.export(dynamo=True, opset_version=18, "
    "optimize=False) then the exporter's optimization with the weights held as graph inputs "
    "(else it folds parameters into constants and BatchNorm into Conv)",
    "trainable: the float initializers that are torch parameters; buffers (BatchNorm running "
    "stats, folded constants) stay frozen",
    "ORT's training graph runs BatchNorm in training mode (BatchNormInternal, batch statistics) "
    "though the forward is exported in eval mode; the torch checks (torch_step1_loss, "
    "grad_check) therefore use torch's train mode",
    "torch's Embedding(padding_idx=...) gives the padding row no gradient; the exported Gather "
    "does (BERT, DistilBERT: row 0): the torch checks drop padding_idx",
]


# ---------------------------------------------------------------- model specs

@dataclass
class Input:
    name: str
    kind: str  # "ids": int64 in [0, high); "ones"; "mask": int64 with trailing padding; "float"
    shape: tuple
    high: int = 0


@dataclass
class Spec:
    model: nn.Module  # takes the inputs positionally, returns one [N, C] tensor
    inputs: list
    loss: str  # "ce" | "mse"
    classes: int  # for "ce"
    source: str
    forward_only: bool = False
    notes: list = field(default_factory=list)


class Logits2D(nn.Module):
    """Calls `inner` with the named inputs and flattens its (first) output to [N, C]."""

    def __init__(self, inner, names, attr=None, channels_last=False):
        super().__init__()
        self.inner = inner
        self.names = list(names)
        self.attr = attr
        self.channels_last = channels_last

    def forward(self, *args):
        out = self.inner(**dict(zip(self.names, args))) if self.names else self.inner(*args)
        if self.attr is not None:
            out = out[self.attr] if isinstance(out, dict) else getattr(out, self.attr)
        if self.channels_last:  # [b, C, h, w] -> [b, h, w, C]
            out = out.permute(0, 2, 3, 1)
        return out.reshape(-1, out.shape[-1])


class Positional(nn.Module):
    """Calls `inner` with positional inputs and flattens its output to [N, C]."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        out = self.inner(*args)
        return out.reshape(-1, out.shape[-1])


def text(names, seq, vocab=128, mask="ones"):
    ins = [Input("input_ids", "ids", (BATCH, seq), vocab)]
    if "attention_mask" in names:
        ins.append(Input("attention_mask", mask, (BATCH, seq)))
    return ins


def image(size=32, channels=3):
    return [Input("pixel_values", "float", (BATCH, channels, size, size))]


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return Spec(Logits2D(GPT2LMHeadModel(cfg), names, "logits"), text(names, 8), "ce", 128,
                "transformers.GPT2LMHeadModel")


def bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return Spec(Logits2D(BertForMaskedLM(cfg), names, "logits"), text(names, 12, mask="mask"),
                "ce", 128, "transformers.BertForMaskedLM")


def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                           seq_classif_dropout=0.0, num_labels=4, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return Spec(Logits2D(DistilBertForSequenceClassification(cfg), names, "logits"),
                text(names, 12, mask="mask"), "ce", 4,
                "transformers.DistilBertForSequenceClassification")


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    names = ["input_ids", "decoder_input_ids"]
    ins = [Input("input_ids", "ids", (BATCH, 12), 128),
           Input("decoder_input_ids", "ids", (BATCH, 8), 128)]
    return Spec(Logits2D(T5ForConditionalGeneration(cfg), names, "logits"), ins, "ce", 128,
                "transformers.T5ForConditionalGeneration")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
                      attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return Spec(Logits2D(LlamaForCausalLM(cfg), names, "logits"), text(names, 8), "ce", 128,
                "transformers.LlamaForCausalLM")


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        sliding_window=4, attention_dropout=0.0, use_cache=False,
                        tie_word_embeddings=False, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return Spec(Logits2D(MistralForCausalLM(cfg), names, "logits"), text(names, 12), "ce", 128,
                "transformers.MistralForCausalLM")


def whisper():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=2,
                        encoder_attention_heads=2, encoder_ffn_dim=64, decoder_layers=1,
                        decoder_attention_heads=2, decoder_ffn_dim=64, max_source_positions=8,
                        max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0, decoder_start_token_id=0, attn_implementation="eager")
    names = ["input_features"]
    # 16 frames: the encoder wants 2 * max_source_positions
    ins = [Input("input_features", "float", (BATCH, 16, 16))]
    spec = Spec(Logits2D(WhisperEncoder(cfg), names, "last_hidden_state"), ins, "mse", 0,
                "transformers.models.whisper.modeling_whisper.WhisperEncoder")
    spec.notes.append("mse: regresses the encoder's last hidden state [b*frames, d_model]")
    return spec


def vit():
    from torchvision.models.vision_transformer import VisionTransformer
    m = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                          mlp_dim=64, dropout=0.0, attention_dropout=0.0, num_classes=10)
    return Spec(Positional(m), image(), "ce", 10, "torchvision.models.VisionTransformer")


def swin():
    from torchvision.models.swin_transformer import SwinTransformer
    m = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                        window_size=[4, 4], mlp_ratio=2.0, dropout=0.0, attention_dropout=0.0,
                        stochastic_depth_prob=0.0, num_classes=10)
    return Spec(Positional(m), image(), "ce", 10, "torchvision.models.SwinTransformer")


def small_resnet(classes=10, **kw):
    from timm.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, layers=(1, 1, 1, 1), channels=(16, 24, 32, 48), stem_width=16,
                  num_classes=classes, zero_init_last=False, **kw)


def resnet():
    # 128x128: layer4's train-mode BatchNorm normalises batch x 4 x 4 values. At 32x32 (1x1,
    # 2 values: outputs +-1) ORT and torch differed by 1e-3 in the gradients; at 64x64 (2x2)
    # the step-1 gradients agreed to 1e-5 but a 1e-5 change of the weights changed the next
    # gradient by 5% (ReLU kinks), so any two float32 runs parted after 2 steps (measured)
    spec = Spec(Positional(small_resnet()), image(128), "ce", 10, "timm.models.resnet.ResNet")
    spec.notes.append("images 128x128 (layer4 4x4 rather than 1x1)")
    return spec


def efficientnet():
    from timm.models._efficientnet_builder import decode_arch_def
    from timm.models.efficientnet import EfficientNet
    arch = [["ds_r1_k3_s1_e1_c16_se0.25"], ["ir_r1_k3_s2_e4_c24_se0.25"],
            ["ir_r1_k5_s2_e3_c32_se0.25"]]
    m = EfficientNet(decode_arch_def(arch), num_classes=10, num_features=64, stem_size=16,
                     act_layer=nn.SiLU)
    return Spec(Positional(m), image(), "ce", 10, "timm.models.efficientnet.EfficientNet")


def convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    m = ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                 stochastic_depth_prob=0.0, layer_scale=0.5, num_classes=10)
    return Spec(Positional(m), image(), "ce", 10, "torchvision.models.ConvNeXt")


def regnet():
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams(depths=[1, 1], widths=[16, 32], group_widths=[8, 8],
                         bottleneck_multipliers=[1.0, 1.0], strides=[2, 2], se_ratio=0.25)
    m = RegNet(params, num_classes=10, stem_width=16)
    return Spec(Positional(m), image(), "ce", 10, "torchvision.models.RegNet")


def deeplabv3():
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabV3
    # output stride 8: layer3 and layer4 dilated, as DeepLabV3's backbones are
    backbone = IntermediateLayerGetter(small_resnet(output_stride=8), {"layer4": "out"})
    head = nn.Sequential(ASPP(48, [2, 4, 6], out_channels=16),
                         nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 4, 1))
    m = DeepLabV3(backbone, head)
    spec = Spec(Logits2D(m, [], "out", channels_last=True), image(), "ce", 4,
                "torchvision.models.segmentation.DeepLabV3 (timm ResNet backbone at output "
                "stride 8, ASPP head)")
    spec.notes.append("per-pixel classes: logits [b*32*32, 4]")
    return spec


def mobilenetv3():
    from torchvision.models.mobilenetv3 import InvertedResidualConfig as C, MobileNetV3
    setting = [C(16, 3, 16, 16, True, "RE", 2, 1, 1.0), C(16, 3, 48, 24, False, "HS", 2, 1, 1.0),
               C(24, 5, 64, 24, True, "HS", 1, 1, 1.0)]
    m = MobileNetV3(setting, last_channel=64, num_classes=10, dropout=0.0)
    return Spec(Positional(m), image(), "ce", 10, "torchvision.models.MobileNetV3",
                forward_only=True)


def mamba():
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                      conv_kernel=4, time_step_rank=4, use_cache=False, use_mambapy=False)
    names = ["input_ids"]
    return Spec(Logits2D(MambaForCausalLM(cfg), names, "logits"), text(names, 8), "ce", 128,
                "transformers.MambaForCausalLM (slow path: sequential selective scan)",
                forward_only=True)


FAMILIES = OrderedDict([
    ("gpt2", gpt2), ("bert", bert), ("distilbert", distilbert), ("t5", t5), ("llama", llama),
    ("mistral", mistral), ("whisper", whisper), ("vit", vit), ("swin", swin), ("resnet", resnet),
    ("efficientnet", efficientnet), ("convnext", convnext), ("regnet", regnet),
    ("deeplabv3", deeplabv3), ("mobilenetv3", mobilenetv3), ("mamba", mamba),
])


# ---------------------------------------------------------------- helpers

class Failure(Exception):
    def __init__(self, stage, error):
        super().__init__(f"{stage}: {error}")
        self.stage = stage
        self.error = error


@contextlib.contextmanager
def quiet():
    """Silence Python warnings and the C++ libraries' prints (ORT's graph transformers log
    every pass at info level while generate_artifacts runs) on stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings(), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def first_line(exc):
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    # ORT's messages start with a source location and a C++ signature: keep what follows
    for marker in (" was false. ", "[ONNXRuntimeError] : "):
        if marker in line:
            line = line.split(marker, 1)[1]
    return f"{type(exc).__name__}: {line}"[:600]


def build(family):
    torch.manual_seed(SEED)
    spec = FAMILIES[family]()
    model = spec.model
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
                m.p = 0.0
        gen = torch.Generator().manual_seed(SEED + 1)
        tensors = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        for _, t in tensors:  # distinct values: equal initializers get merged / aliased
            if t.numel() > 1 and t.is_floating_point() and bool((t == t.flatten()[0]).all()):
                c = float(t.flatten()[0])
                u = torch.rand(t.shape, generator=gen)
                t.copy_(u * 0.2 - 0.1 if c == 0 else c * (0.5 + u))
    model.eval()
    return spec


def make_data(spec, rng):
    data = {}
    for inp in spec.inputs:
        shape = (STEPS,) + tuple(inp.shape)
        if inp.kind == "ids":
            data[inp.name] = rng.integers(0, inp.high, shape).astype(np.int64)
        elif inp.kind == "ones":
            data[inp.name] = np.ones(shape, np.int64)
        elif inp.kind == "mask":  # trailing padding, at least half of each row kept
            lens = rng.integers(shape[-1] // 2, shape[-1] + 1, shape[:-1])
            data[inp.name] = (np.arange(shape[-1]) < lens[..., None]).astype(np.int64)
        else:
            data[inp.name] = rng.standard_normal(shape).astype(np.float32)
    with torch.no_grad():
        out = spec.model(*[torch.from_numpy(data[i.name][0]) for i in spec.inputs])
    if spec.loss == "ce":
        labels = rng.integers(0, spec.classes, (STEPS, out.shape[0])).astype(np.int64)
    else:
        labels = rng.standard_normal((STEPS,) + tuple(out.shape)).astype(np.float32)
    return data, labels


def torch_loss_and_grads(spec, data, labels, step=0, train=True):
    """Torch's loss and gradients. Train mode is what ORT's training graph computes (its
    BatchNormInternal uses the batch's statistics though the forward was exported in eval mode);
    eval mode is what the exported forward graph computes."""
    model = copy.deepcopy(spec.model).train(train)
    for m in model.modules():  # ONNX's Gather has no padding_idx: its row gets a gradient there
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    out = model(*[torch.from_numpy(data[i.name][step]) for i in spec.inputs])
    y = torch.from_numpy(labels[step])
    fn = nn.functional.cross_entropy if spec.loss == "ce" else nn.functional.mse_loss
    loss = fn(out, y)
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy()
             for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return float(loss.detach()), grads


def export(spec, exporter, path):
    args = tuple(torch.from_numpy(spec.data[i.name][0]) for i in spec.inputs)
    names = [i.name for i in spec.inputs]
    workaround = None
    with quiet():
        if exporter == "ts":
            torch.onnx.export(spec.model, args, str(path), input_names=names,
                              output_names=["output"], opset_version=OPSETS["ts"],
                              do_constant_folding=False, training=torch.onnx.TrainingMode.EVAL,
                              dynamo=False)
        else:
            program = torch.onnx.export(spec.model, args, input_names=names,
                                        output_names=["output"], opset_version=OPSETS["dynamo"],
                                        dynamo=True, optimize=False)
            optimize_keeping_parameters(program)
            program.save(str(path), external_data=False)
            workaround = ("exported with optimize=False, then optimized with the weights held "
                          "as graph inputs (optimize_keeping_parameters)")
    return workaround


def optimize_keeping_parameters(program):
    """The dynamo exporter's own optimization (onnxscript's constant folding and rewrites), with
    the weights held as graph inputs meanwhile. Left as initializers they count as constants: the
    optimizer folds GPT-2's position-embedding Gather into a new constant (losing the parameter)
    and fuses eval-mode BatchNorm into the Conv before it (changing the conv weights' values and
    dropping BatchNorm's parameters). Unoptimized graphs keep aten.split as SplitToSequence/
    SequenceAt, which ORT cannot differentiate through ("unreachable from the output")."""
    graph = program.model.graph
    held = [v for v in graph.initializers.values() if v not in graph.inputs]
    graph.inputs.extend(held)
    program.optimize()
    for v in held:
        graph.inputs.remove(v)


def prepare(path):
    """The forward graph as generate_artifacts needs it (IR <= 10, LayerNorm's extra outputs)."""
    model = onnx.load(str(path))
    if model.ir_version > 10:
        model.ir_version = 10
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}_mean", f"{node.output[0]}_inv_std"])
    return model


def trainable_names(spec, model):
    """Float initializers that are torch parameters (by name, else by identical value)."""
    params = OrderedDict((n, p.detach().numpy())
                         for n, p in spec.model.named_parameters(remove_duplicate=False))
    floats = [t for t in model.graph.initializer
              if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                 onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)]
    names, unmatched = [], []
    for t in floats:
        if t.name in params:
            names.append(t.name)
            continue
        if t.name.endswith(BUFFER_SUFFIXES):
            continue
        arr = onnx.numpy_helper.to_array(t)
        if arr.size > 1 and any(arr.shape == v.shape and np.array_equal(arr, v)
                                for v in params.values()):
            names.append(t.name)
        else:
            unmatched.append(t.name)
    missing = [n for n, v in params.items()
               if n not in names and not any(
                   np.array_equal(onnx.numpy_helper.to_array(t), v) for t in floats
                   if t.name in names)]
    return names, unmatched, missing


def versions():
    import timm
    import torchvision
    import transformers
    import onnxscript
    return {"torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__,
            "transformers": transformers.__version__, "timm": timm.__version__,
            "torchvision": torchvision.__version__, "tool": "tools/make_corpus.py"}


def ort_reference(out, trainable):
    from onnxruntime.training import api as ort_api
    state = ort_api.CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = ort_api.Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    optimizer = ort_api.Optimizer(str(out / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()
    return state, module, optimizer


# ---------------------------------------------------------------- one (family, exporter)

def make(family, exporter, out):
    from onnxruntime.training import artifacts
    spec = build(family)
    rng = np.random.default_rng(SEED)
    spec.data, labels = make_data(spec, rng)
    out.mkdir(parents=True, exist_ok=True)
    entry = {"family": family, "exporter": exporter, "opset": OPSETS[exporter],
             "source": spec.source}
    if spec.notes:
        entry["notes"] = list(spec.notes)

    fwd = out / "forward.onnx"
    try:
        workaround = export(spec, exporter, fwd)
    except Exception as exc:  # noqa: BLE001 (recorded)
        raise Failure("export", first_line(exc)) from exc
    if workaround:
        entry["workaround"] = workaround
    model = prepare(fwd)
    trainable, unmatched, missing = trainable_names(spec, model)
    if unmatched:
        entry["frozen_float_initializers"] = unmatched
    if missing:
        entry["params_not_in_graph"] = missing
    torch_loss, torch_grads = torch_loss_and_grads(spec, spec.data, labels)

    loss_type = (artifacts.LossType.CrossEntropyLoss if spec.loss == "ce"
                 else artifacts.LossType.MSELoss)
    gen_error = None
    try:
        with quiet():
            artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=[],
                                         loss=loss_type, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=str(out))
    except Exception as exc:  # noqa: BLE001 (recorded)
        gen_error = first_line(exc)

    ref = {"family": family, "exporter": exporter, "opset": OPSETS[exporter], "loss": spec.loss,
           "lr": LR, "steps": STEPS, "source": spec.source, "made_by": versions()}
    if spec.notes:
        ref["notes"] = list(spec.notes)

    if gen_error is not None:
        if not spec.forward_only:
            raise Failure("generate_artifacts", gen_error)
        return forward_only(spec, out, labels, trainable, ref, entry, "generate_artifacts",
                            gen_error)
    if spec.forward_only:
        entry["unexpected"] = "generate_artifacts succeeded on a forward-only family"

    try:
        state, module, optimizer = ort_reference(out, trainable)
        names = list(module.input_names())
        feeds = {}
        for n in names:
            feeds[n] = spec.data[n] if n in spec.data else labels
        losses, grads = [], {}
        for s in range(STEPS):
            loss = module(*[feeds[n][s].copy() for n in names])
            losses.append(float(np.asarray(loss)))
            if s == 0:
                grads = {p: np.array(state.parameters[p].grad, copy=True) for p in trainable}
            optimizer.step()
            module.lazy_reset_grad()
    except Exception as exc:  # noqa: BLE001 (recorded)
        error = first_line(exc)
        if "NOT_IMPLEMENTED" not in error:
            raise Failure("ort_training", error) from exc
        # ORT built the gradient graph but has no CPU kernel for one of its ops: keep the
        # artifacts (untested by ORT) and give the forward graph for jax.grad
        entry["artifacts_kept"] = "training/eval/optimizer graphs and checkpoint, no ORT run"
        return forward_only(spec, out, labels, trainable, ref, entry, "ort_training", error)
    fwd.unlink()

    arrays = {f"in_{n}": feeds[n] for n in names}
    arrays["losses"] = np.array(losses, np.float64)
    for p, g in grads.items():
        arrays[f"grad_{p}"] = g
    np.savez(out / "reference.npz", **arrays)

    ref.update({"inputs": names, "trainable": trainable,
                "label_input": [n for n in names if n not in spec.data][0],
                "torch_step1_loss": torch_loss, "grad_check": grad_check(grads, torch_grads)})
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    entry.update(status="ok", losses=losses, torch_step1_loss=torch_loss,
                 grad_check=ref["grad_check"])
    return entry


def grad_check(grads, torch_grads):
    """ORT's step-1 gradients against torch's: the largest |ort - torch| of each parameter over
    max(|torch| of that parameter, 1% of |torch| over all parameters), the worst of them. The
    floor keeps gradients that are zero in exact arithmetic (a bias before a train-mode
    BatchNorm, an attention key's bias) from reporting their rounding noise as large errors."""
    pairs = {p: (g, torch_grads[p]) for p, g in grads.items()
             if p in torch_grads and torch_grads[p].shape == g.shape}
    if not pairs:
        return {"compared": 0, "of": len(grads)}
    floor = 0.01 * max(float(np.abs(t).max()) for _, t in pairs.values())
    errs = {p: float(np.abs(g - t).max() / max(float(np.abs(t).max()), floor, 1e-30))
            for p, (g, t) in pairs.items()}
    worst = max(errs, key=errs.get)
    return {"compared": len(errs), "of": len(grads), "worst_param": worst,
            "worst_rel_err": errs[worst]}


def forward_only(spec, out, labels, trainable, ref, entry, stage, error):
    """forward.onnx (IR version clamped to 10), inputs, labels and torch's losses."""
    fwd = out / "forward.onnx"
    if stage == "generate_artifacts":
        for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"):
            (out / f).unlink(missing_ok=True)
    raw = onnx.load(str(fwd))
    if raw.ir_version > 10:
        raw.ir_version = 10
        onnx.save(raw, str(fwd))
    inputs = [i.name for i in spec.inputs]
    torch_losses, torch_grads = [], {}
    for s in range(STEPS):  # eval mode, as forward.onnx computes
        loss, grads = torch_loss_and_grads(spec, spec.data, labels, s, train=False)
        torch_losses.append(loss)
        torch_grads = torch_grads or grads
    sess = onnxruntime.InferenceSession(str(fwd), providers=["CPUExecutionProvider"])
    ort_out = sess.run(None, {n: spec.data[n][0] for n in inputs})[0]
    with torch.no_grad():  # eval mode: as exported
        ref_out = spec.model(*[torch.from_numpy(spec.data[n][0]) for n in inputs]).numpy()
    arrays = {f"in_{n}": spec.data[n] for n in inputs}
    arrays["labels"] = labels
    arrays["torch_losses"] = np.array(torch_losses, np.float64)
    for p in trainable:
        if p in torch_grads:
            arrays[f"torch_grad_{p}"] = torch_grads[p]
    np.savez(out / "reference.npz", **arrays)
    diff = float(np.abs(ort_out - ref_out).max())
    ref.update({"forward_only": True, "inputs": inputs, "label_input": "labels",
                "trainable": trainable, "why_forward_only": f"{stage}: {error}",
                "torch_losses": "torch's loss of each step's batch at the initial weights, in "
                                "eval mode (as forward.onnx computes it)",
                "torch_grads": "torch_grad_<param>: torch's eval-mode gradient for step 1's batch",
                "ort_inference_max_abs_diff": diff})
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    entry.update(status="forward_only", stage=stage, error=error, ort_inference_max_abs_diff=diff)
    return entry


def main():
    onnxruntime.set_default_logger_severity(3)
    logging.getLogger("onnx_ir").setLevel(logging.ERROR)  # "Skipped deduplication of ..."
    logging.getLogger("onnxscript").setLevel(logging.ERROR)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--exporters", nargs="+", default=list(OPSETS), choices=list(OPSETS))
    p.add_argument("families", nargs="*", help=f"default: all of {list(FAMILIES)}")
    args = p.parse_args()
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    entries = manifest.get("entries", {})
    start = time.time()
    for family in args.families or list(FAMILIES):
        for exporter in args.exporters:
            key = f"{family}_{exporter}"
            target = args.out / key
            shutil.rmtree(target, ignore_errors=True)
            t0 = time.time()
            try:
                entry = make(family, exporter, target)
            except Failure as exc:
                shutil.rmtree(target, ignore_errors=True)
                entry = {"family": family, "exporter": exporter, "opset": OPSETS[exporter],
                         "status": "failed", "stage": exc.stage, "error": exc.error}
                if exc.__cause__ is not None:
                    traceback.print_exception(exc.__cause__, limit=-3, file=sys.stderr)
            except Exception as exc:  # noqa: BLE001 (a bug here or in a model builder)
                shutil.rmtree(target, ignore_errors=True)
                traceback.print_exc()
                entry = {"family": family, "exporter": exporter, "opset": OPSETS[exporter],
                         "status": "failed", "stage": "build", "error": first_line(exc)}
            entry["seconds"] = round(time.time() - t0, 1)
            entries[key] = entry
            brief = entry.get("losses") or entry.get("error")
            print(f"{key}: {entry['status']} ({entry['seconds']} s) {brief}", flush=True)
            manifest = {"made_by": versions(), "lr": LR, "steps": STEPS, "notes": NOTES,
                        "entries": dict(sorted(entries.items()))}
            manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
