"""A trained run out, as a Hugging Face GPT-2 checkpoint directory that `transformers` loads
(the format's mapping is model/interop/hf_format.py). scripts/export_hf.py is its command.

    >>> export_run("runs/shakespeare", "hf/shakespeare")              # doctest: +SKIP
    PosixPath('hf/shakespeare')
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flax import nnx

from model.interop.hf_format import (
    CONFIG_JSON,
    EOT,
    MERGES_TXT,
    TOKENIZER_JSON,
    VOCAB_JSON,
    WEIGHTS,
    check_exportable,
    hf_config_of,
    params_to_hf,
)
from model.network.config import ModelConfig, model_config_of
from model.rundir.trained import open_trained_run
from plumbing.atomic import staged_directory
from plumbing.errors import UsageError
from tokenizer import BPETokenizer
from tokenizer.gpt2_files import write_tokenizer_json
from tokenizer.pretokenize import PATTERNS


def export_run(run_dir: Path, out_dir: Path) -> Path:
    """Write a trained run (float or quantized, dequantized) as a GPT-2 checkpoint directory:
    config.json, model.safetensors, the tokenizer both as tokenizer.json (what transformers 5
    reads and writes) and as vocab.json + merges.txt (older readers), tokenizer_config.json.
    UsageError for what GPT-2's format cannot hold, found from the run's config and tokenizer
    before any weights are read."""
    from safetensors.numpy import save_file

    run, out_dir = open_trained_run(run_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir} already exists: pick another --out or delete it")
    saved = run.saved_config()
    if not isinstance(run.tokenizer, BPETokenizer):
        kind = saved.get("tokenizer", {}).get("kind")
        raise UsageError(
            f"GPT-2's format cannot express tokenizer.kind={kind!r} (GPT-2 has a byte-level "
            "BPE): this run cannot be exported"
        )
    if run.tokenizer.pattern != PATTERNS["gpt2"]:
        raise UsageError(
            "GPT-2's format cannot express tokenizer.pattern other than gpt2 (its tokenizer "
            "splits text with GPT-2's regex): this run cannot be exported"
        )
    check_exportable(model_config_of(saved))
    tokenizer, model, _ = run.load()
    cfg = model.cfg
    params = nnx.state(model, nnx.Param)
    eot = tokenizer.special_tokens.get(EOT)
    with staged_directory(out_dir) as staging:  # never half written, the user's umask
        save_file(params_to_hf(params, cfg), str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG_JSON).write_text(json.dumps(hf_config_of(cfg, eot), indent=2))
        tokenizer.export_gpt2_files(staging / VOCAB_JSON, staging / MERGES_TXT)
        write_tokenizer_json(
            tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, staging / TOKENIZER_JSON
        )
        (staging / "tokenizer_config.json").write_text(
            json.dumps(_tokenizer_config(tokenizer, cfg), indent=2)
        )
    return out_dir


def _tokenizer_config(tokenizer, cfg: ModelConfig) -> dict[str, Any]:
    """GPT2Tokenizer settings: our special tokens as added (never split) tokens, EOT as
    bos/eos/unk as GPT-2's own, and no prefix space (we add none)."""
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": cfg.block_size,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(idx): {
                "content": text,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for text, idx in sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
        },
    }
    if EOT in tokenizer.special_tokens:
        config.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
    return config
