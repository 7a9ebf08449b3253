"""Run configurations: TOML files in this folder, loaded into typed dataclasses (schema.py)."""

from configs.schema import Config, load_config

__all__ = ["Config", "load_config"]
