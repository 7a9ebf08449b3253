"""The PyTorch peer for scripts/bench_train.py: nanoGPT's model and CPU training step.

A GPT with nanoGPT's architecture and settings for its CPU Shakespeare baseline (learned
positions, pre-LayerNorm without bias, GELU MLP, tied embeddings, AdamW with decay on
matrices only, gradient clipping at 1.0, no torch.compile, float32 on CPU), timed on random
tokens. Run by bench_train.py with an interpreter that has torch:

    python scripts/torch_reference.py --steps 50 --repeats 5   # prints one JSON line

With --full FILE it instead trains nanoGPT's whole CPU baseline on a text file the way
nanoGPT's train.py does (character vocab, 90/10 split, random windows from torch.randint, 2000
iterations, warmup 100 + cosine 1e-3 -> 1e-4, evaluation every 250 iterations on 20 batches)
and prints the final validation loss, for comparing loss distributions across seeds:

    python scripts/torch_reference.py --full ../shared/data/tinyshakespeare.txt --seed 1337

With --eval-nanogpt CKPT it scores a checkpoint written by nanoGPT's own train.py (its
ckpt.pt, for this character setup) on every non-overlapping window of the validation split
of --full's text, the windows that scripts/eval_split.py scores a tinyllm run on:

    python scripts/torch_reference.py --eval-nanogpt out/ckpt.pt --full tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

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
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # nanoGPT: N(0, 0.02), residual projections / sqrt(2 n_layer)
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
    )


def nanogpt_lr(it: int, warmup: int = 100, decay_iters: int = 2000) -> float:
    """nanoGPT's get_lr for its Shakespeare-char config (1e-3 -> 1e-4)."""
    lr, min_lr = 1e-3, 1e-4
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def full_run(a: argparse.Namespace) -> None:
    """nanoGPT's train.py loop for its CPU baseline, on a text file; prints one JSON line."""
    stoi, data = char_ids(a.full)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    torch.manual_seed(a.seed)
    model = GPT(len(stoi), a.block, a.n_layer, a.n_head, a.n_embd)
    opt = make_optimizer(model)

    def batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - a.block, (a.batch,))
        x = torch.stack([d[i : i + a.block] for i in ix])
        return x, torch.stack([d[i + 1 : i + 1 + a.block] for i in ix])

    @torch.no_grad()
    def estimate(iters: int) -> dict[str, float]:
        model.eval()
        out = {s: statistics.mean(model(*batch(s)).item() for _ in range(iters)) for s in splits}
        model.train()
        return out

    curve, start = [], time.perf_counter()
    for it in range(a.max_iters + 1):
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(it, decay_iters=a.max_iters)
        if it % 250 == 0 or it == a.max_iters:
            losses = estimate(20)
            curve.append(
                {
                    "step": it,
                    "val_loss": round(losses["val"], 4),
                    "minutes": round((time.perf_counter() - start) / 60, 3),
                }
            )
        if it == a.max_iters:
            break  # nanoGPT takes one more step after its last evaluation; it changes nothing
        loss = model(*batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    print(
        json.dumps(
            {
                "seed": a.seed,
                "final_val_loss": curve[-1]["val_loss"],
                "val_loss_200_batches": round(estimate(200)["val"], 4),
                "seconds": round(time.perf_counter() - start, 1),
                "curve": curve,
            }
        )
    )


def char_ids(path: str) -> tuple[dict[str, int], torch.Tensor]:
    """nanoGPT's character vocabulary (the sorted set of characters) and the text's ids."""
    text = Path(path).read_text(encoding="utf-8")
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    return stoi, torch.tensor([stoi[c] for c in text], dtype=torch.long)


def tinyllm_val_split(path: str) -> torch.Tensor:
    """tinyllm's validation split of the text's ids: the last int(0.1 * n) (nanoGPT's
    prepare.py gives validation one more character)."""
    _, data = char_ids(path)
    return data[len(data) - int(0.1 * len(data)) :]


def nanogpt_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanoGPT's parameter names -> this file's GPT (same tensors, shorter names)."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("_orig_mod.").removeprefix("transformer.")
        name = name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
        name = name.replace(".attn.", ".").replace(".mlp.c_fc.", ".fc.")
        name = name.replace(".mlp.c_proj.", ".proj.").replace("lm_head.", "head.")
        out[name] = tensor
    return out


def eval_nanogpt(a: argparse.Namespace) -> None:
    """A nanoGPT checkpoint scored on every non-overlapping validation window; one JSON line."""
    ckpt = torch.load(a.eval_nanogpt, map_location="cpu", weights_only=True)
    m = ckpt["model_args"]
    if m.get("bias"):
        raise SystemExit("torch_reference: error: only bias=False checkpoints (nanoGPT's default)")
    val = tinyllm_val_split(a.full)
    model = GPT(m["vocab_size"], m["block_size"], m["n_layer"], m["n_head"], m["n_embd"])
    model.load_state_dict(nanogpt_state_dict(ckpt["model"]))
    model.eval()
    t = m["block_size"]
    starts = range(0, len(val) - t, t)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(starts), 64):
            rows = starts[i : i + 64]
            x = torch.stack([val[o : o + t] for o in rows])
            y = torch.stack([val[o + 1 : o + 1 + t] for o in rows])
            total += model(x, y).item() * len(rows)
    print(
        json.dumps(
            {
                "checkpoint": a.eval_nanogpt,
                "iter_num": ckpt.get("iter_num"),
                "windows": len(starts),
                "val_loss_all_windows": round(total / len(starts), 4),
                "val_loss_logged": round(float(ckpt.get("best_val_loss", float("nan"))), 4),
            }
        )
    )


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
    p.add_argument("--full", metavar="TEXT_FILE", help="train nanoGPT's whole CPU baseline")
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-nanogpt", metavar="CKPT", help="score nanoGPT's ckpt.pt (needs --full)")
    a = p.parse_args()
    if a.eval_nanogpt:
        if not a.full:
            p.error("--eval-nanogpt needs --full TEXT_FILE (the text it was trained on)")
        return eval_nanogpt(a)
    if a.full:
        return full_run(a)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.block, a.n_layer, a.n_head, a.n_embd)
    opt = make_optimizer(model)
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
