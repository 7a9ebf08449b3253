"""Hugging Face GPT-2 checkpoints in and out.

hf_format.py  config.json and safetensors names <-> ModelConfig and our parameters
hf_import.py  a GPT-2 directory or hub id -> tokenizer, config, weights (--init-from)
hf_export.py  a trained run -> a GPT-2 directory (scripts/export_hf.py)
"""
