"""The PyTorch peer for scripts/bench_train.py: nanoGPT's model and CPU training step.

A GPT with nanoGPT's architecture and settings for its CPU Shakespeare baseline (learned
positions, pre-LayerNorm without bias, GELU MLP, tied embeddings, AdamW with decay on
matrices only, gradient clipping at 1.0, no torch.compile, float32 on CPU), timed on random
tokens. Run by bench_train.py with an interpreter that has torch:

    python scripts/torch_reference.py --steps 50 --repeats 5   # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's flash path
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT(a.vocab, a.block, a.n_layer, a.n_head, a.n_embd)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
    )
    data = torch.randint(0, a.vocab, (100_000,))

    def step() -> None:
        ix = torch.randint(len(data) - a.block - 1, (a.batch,))
        x = torch.stack([data[i : i + a.block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + a.block] for i in ix])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()  # nanoGPT reads the loss every step on CPU (log_interval=1)

    for _ in range(5):
        step()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        times.append((time.perf_counter() - t0) / a.steps)
    ms = statistics.median(times) * 1000
    print(
        json.dumps(
            {
                "peer": f"PyTorch {torch.__version__} (nanoGPT architecture, CPU)",
                "threads": torch.get_num_threads(),
                "ms_per_step": round(ms, 2),
                "tokens_per_sec": round(a.batch * a.block / (ms / 1000), 1),
                "params": sum(q.numel() for q in model.parameters()),
                "check": math.isfinite(ms),
            }
        )
    )


if __name__ == "__main__":
    main()
