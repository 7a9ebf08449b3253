"""Hugging Face checkpoints in and out, by architecture family: GPT-2, Llama, Qwen3.

families.py      which family holds a ModelConfig: an allowlist per family, over every field
hf_format.py     what every family's directory shares: files, config.json, tensors <-> params
gpt2_layout.py   GPT2Config and GPT-2's tensor names
llama_layout.py  LlamaConfig / Qwen3Config and their tensor names (q, k, v split; GQA)
config_values.py numbers and flags read from a config.json, checked
hf_import.py     a checkpoint directory or hub id -> tokenizer, config, weights (--init-from)
hf_export.py     a trained run -> a checkpoint directory of its family (scripts/export_hf.py)
"""
