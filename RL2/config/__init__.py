from RL2.config.cli import ConfigError, parse_config

__all__ = ["ConfigError", "parse_config"]
