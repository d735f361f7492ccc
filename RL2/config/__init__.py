"""Typed configs (`*schema.py`: dataclasses holding every default), the key=value command line (`cli.py`, which
needs omegaconf: imported on first use, so that the schemas work without it) and its checks (`validation.py`)."""

from RL2.config.errors import ConfigError

__all__ = ["ConfigError", "parse_config"]


def __getattr__(name: str):
    if name == "parse_config":
        from RL2.config.cli import parse_config

        return parse_config
    raise AttributeError(f"module 'RL2.config' has no attribute {name!r}")
