"""--plan: what a config costs before anything compiles.

>>> from configs.schema import load_config, resolve_config_path   # doctest: +SKIP
>>> planned_config(load_config(resolve_config_path("gpt2_124m"))).model.vocab_size
50257
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

GPT2_VOCAB = 50257  # r50k: 256 bytes + 50,000 merges + <|endoftext|>
CHAR_VOCAB = 256  # a character-level vocabulary is the corpus's: at most this for text we plan


def planned_config(cfg, run_dir: Path | None = None):
    """`cfg` with the model's vocabulary filled in: the run directory's tokenizer when there
    is one, else what the [tokenizer] section implies (GPT-2's 50,257; a BPE's vocab_size; 256
    for characters, an upper bound)."""
    vocab = cfg.model.vocab_size or _vocab_of(cfg, run_dir)
    model = dataclasses.replace(cfg.model, vocab_size=vocab).validate()
    return dataclasses.replace(cfg, model=model)


def _vocab_of(cfg, run_dir: Path | None) -> int:
    from model.rundir.layout import TOKENIZER_FILE

    if run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file():
        from tokenizer import load_tokenizer

        return load_tokenizer(Path(run_dir) / TOKENIZER_FILE).vocab_size
    if cfg.init_from:
        from model.interop.hf_import import hf_model_config

        return hf_model_config(cfg.init_from, cfg.model).vocab_size
    return {"gpt2": GPT2_VOCAB, "char": CHAR_VOCAB}.get(
        cfg.tokenizer.kind, cfg.tokenizer.vocab_size
    )
