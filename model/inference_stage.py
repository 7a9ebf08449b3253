"""The --inference stage: tokenizer + latest checkpoint -> text streamed to stdout.

With one sample, text is printed as it is generated (chunks of a few tokens from the compiled
decode loop, decoded incrementally so a multi-byte character split across tokens prints once
complete). With several samples, each is printed when done, separated by a rule, as nanoGPT's
sample.py does. A timing line goes to stderr.
"""

from __future__ import annotations

import codecs
import sys
import time
from pathlib import Path

import numpy as np

from configs.schema import Config, config_from_dict
from model.checkpoint import has_checkpoint
from model.data import file_sha256
from model.generate import generate
from model.hf_gpt2 import started_from
from model.quant_checkpoint import (
    QUANT_FILE,
    has_quantized_checkpoint,
    load_float_model,
    load_quantized_model,
)
from tokenizer import load_tokenizer
from tokenizer.errors import UsageError
from tokenizer.stage import TOKENIZER_FILE


def load_trained(run_dir: Path):
    """(tokenizer, model, saved config) of a run directory's latest checkpoint, or of its
    quantized checkpoint (dequantized to float32) when it holds one."""
    run_dir = Path(run_dir)
    tok_path = run_dir / TOKENIZER_FILE
    quantized = has_quantized_checkpoint(run_dir)
    if not (quantized or has_checkpoint(run_dir)):
        raise UsageError(
            f"no checkpoint in {run_dir}: train first (python tinyllm.py --train ...) or point "
            "--out at a trained run directory"
        )
    if not tok_path.is_file():
        raise UsageError(f"no tokenizer in {run_dir}: the run directory is incomplete")
    tokenizer = load_tokenizer(tok_path)
    model, meta = (load_quantized_model if quantized else load_float_model)(run_dir)
    if meta.get("tokenizer_sha256") != file_sha256(tok_path):
        raise UsageError(
            f"the tokenizer in {run_dir} is not the one {QUANT_FILE} was made with: "
            "quantize the trained run again"
            if quantized
            else f"the tokenizer in {run_dir} changed since the model was trained: retrain it"
        )
    return tokenizer, model, config_from_dict(meta["config"])


def encode_prompt(tokenizer, prompt: str, block_size: int) -> list[int]:
    ids = tokenizer.encode(prompt)
    if not ids:
        eot = stop_token_of(tokenizer)
        if eot is None:
            raise UsageError("the prompt is empty: give some text with --prompt")
        ids = [eot]
    if len(ids) >= block_size:
        raise UsageError(
            f"the prompt is {len(ids)} tokens, longer than the model's context of {block_size} "
            "tokens minus one: shorten it"
        )
    return ids


def stop_token_of(tokenizer) -> int | None:
    eot = "<|endoftext|>"
    if eot in getattr(tokenizer, "special_tokens", ()):
        return tokenizer.token_to_id(eot)
    return None


def run_inference(cfg: Config, run_dir: Path, out=None) -> dict:
    """Sample `cfg.sample` from the run's model; returns timing figures."""
    out = out or sys.stdout
    s = cfg.sample
    if s.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be positive, got {s.max_new_tokens}")
    if cfg.init_from and not started_from(run_dir, cfg.init_from):
        from model.hf_gpt2 import load_gpt2

        tokenizer, model = load_gpt2(cfg.init_from, cfg.model)  # GPT-2 itself, not a run
    else:
        tokenizer, model, _ = load_trained(run_dir)
    prompt_ids = encode_prompt(tokenizer, s.prompt, model.cfg.block_size)
    stream = generate(
        model,
        prompt_ids,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        num_samples=s.num_samples,
        use_cache=s.kv_cache,
        stop_token=stop_token_of(tokenizer),
    )
    start = time.perf_counter()
    first_chunk_at, first_chunk_tokens = None, 0
    samples = [[] for _ in range(s.num_samples)]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if s.num_samples == 1:
        out.write(s.prompt)
    for chunk in stream:
        chunk = np.asarray(chunk)
        if first_chunk_at is None:
            first_chunk_at, first_chunk_tokens = time.perf_counter(), chunk.shape[1]
        for row, ids in zip(samples, chunk.tolist(), strict=True):
            row.extend(i for i in ids if i >= 0)  # a stopped sample pads with PAD_ID (-1)
        if s.num_samples == 1:
            out.write(decoder.decode(tokenizer.decode_bytes(chunk[0].tolist())))
            out.flush()
    end = time.perf_counter()
    if s.num_samples == 1:
        out.write(decoder.decode(b"", final=True) + "\n")
    else:
        for ids in samples:
            out.write(s.prompt + tokenizer.decode(ids) + "\n---------------\n")
    out.flush()

    generated = sum(len(row) for row in samples)
    decode_tokens = generated - first_chunk_tokens * s.num_samples
    decode_seconds = end - (first_chunk_at or end)
    rate = decode_tokens / decode_seconds if decode_seconds > 0 and decode_tokens > 0 else 0.0
    stats = {
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": generated,
        "seconds": end - start,
        "decode_tokens_per_sec": rate,
    }
    print(
        f"inference: {stats['prompt_tokens']} prompt tokens, {generated} generated tokens, "
        f"{stats['seconds']:.2f} s, {rate:,.0f} tokens/s decode "
        f"({'KV cache' if s.kv_cache else 'no cache'})",
        file=sys.stderr,
    )
    return stats
