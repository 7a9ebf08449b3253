"""A trained run out, as a Hugging Face checkpoint directory of the family its layers fit
(GPT-2, Llama or Qwen3: model/interop/families.py) that `transformers` loads. The mappings are
model/interop/hf_format.py and its layouts; scripts/export_hf.py is its command.

    >>> export_run("runs/shakespeare", "hf/shakespeare")              # doctest: +SKIP
    (PosixPath('hf/shakespeare'), 'GPT-2')
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flax import nnx

from model.interop.families import GPT2, Family, family_for
from model.interop.hf_format import (
    CONFIG_JSON,
    EOT,
    GENERATION_CONFIG,
    MERGES_TXT,
    TOKENIZER_JSON,
    VOCAB_JSON,
    WEIGHTS,
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


def export_run(run_dir: Path, out_dir: Path) -> tuple[Path, Family]:
    """Write a trained run (float or quantized, dequantized) as a checkpoint directory of the
    family that holds it: config.json, model.safetensors, generation_config.json, the
    tokenizer as tokenizer.json (what transformers 5 reads) and tokenizer_config.json, plus
    vocab.json + merges.txt where the family's hub repositories carry them and the run splits
    text with GPT-2's regex (the legacy GPT-2 tokenizer's own). UsageError for what no family
    can hold, found from the run's config and tokenizer before any weights are read."""
    from safetensors.numpy import save_file

    run, out_dir = open_trained_run(run_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir} already exists: pick another --out or delete it")
    saved = run.saved_config()
    if not isinstance(run.tokenizer, BPETokenizer):
        kind = saved.get("tokenizer", {}).get("kind")
        raise UsageError(
            f"no Hugging Face family can hold tokenizer.kind={kind!r} (they have byte-level "
            "BPE tokenizers): this run cannot be exported"
        )
    family = family_for(model_config_of(saved))
    tokenizer, model, _ = run.load()
    cfg = model.cfg
    params = nnx.state(model, nnx.Param)
    eot = tokenizer.special_tokens.get(EOT)
    legacy = family.legacy_tokenizer_files and tokenizer.pattern == PATTERNS["gpt2"]
    with staged_directory(out_dir) as staging:  # never half written, the user's umask
        tensors = params_to_hf(params, cfg, family)
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        _write_json(staging / CONFIG_JSON, hf_config_of(cfg, family, eot))
        _write_json(staging / GENERATION_CONFIG, _generation_config(eot))
        write_tokenizer_json(
            tokenizer.vocab,
            tokenizer.merges,
            tokenizer.special_tokens,
            staging / TOKENIZER_JSON,
            tokenizer.pattern,
            tokenizer.normalizer,
        )
        if legacy:
            tokenizer.export_gpt2_files(staging / VOCAB_JSON, staging / MERGES_TXT)
        config = _tokenizer_config(tokenizer, cfg, family is GPT2 and legacy)
        _write_json(staging / "tokenizer_config.json", config)
    return out_dir, family


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False))


def _generation_config(eot: int | None) -> dict[str, Any]:
    """What `generate` stops at: the end-of-text token, when the tokenizer has one."""
    config: dict[str, Any] = {"_from_model_config": True}
    if eot is not None:
        config.update(bos_token_id=eot, eos_token_id=eot)
    return config


def _tokenizer_config(tokenizer, cfg: ModelConfig, gpt2_class: bool) -> dict[str, Any]:
    """Our special tokens as added (never split) tokens, EOT as bos/eos/unk, no prefix space
    (we add none). GPT2Tokenizer where GPT-2's files and regex hold the tokenizer; otherwise
    the generic fast tokenizer, which reads tokenizer.json (its pattern) as it is: the
    family's own class would split with the family's regex, not the run's."""
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer" if gpt2_class else "PreTrainedTokenizerFast",
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
