"""Run configurations: TOML files in this folder, loaded into typed dataclasses (schema.py);
the command line's flags and key=value pairs as config settings (command_line.py)."""

from configs.schema import Config, load_config

__all__ = ["Config", "load_config"]
