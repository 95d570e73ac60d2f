"""The transformer of tests/data/transformer, in PyTorch: one definition for the artifacts
(tools/make_artifacts.py exports it) and for the train-step benchmark's eager peer
(bench/train_step.py), so both run the same model. Needs only torch."""
import torch


class EncoderLayer(torch.nn.Module):
    """Pre-norm encoder layer, written out so the exported graph holds plain ops."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        split = lambda z: z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(q), split(k), split(v)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        h = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(h))
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x)))))


class Transformer(torch.nn.Module):
    """Token embedding + learned positions -> encoder layers -> LayerNorm -> mean over
    tokens -> Linear: a sequence classifier (logits)."""

    def __init__(self, vocab=64, dim=16, heads=2, hidden=32, layers=2, classes=5, seq=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(seq, dim))
        self.layers = torch.nn.ModuleList(EncoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))
