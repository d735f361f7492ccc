"""The error every bad config value raises."""


class ConfigError(ValueError):
    """A bad config value; the message names the key and says what to do."""


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError with `message` unless `condition` holds."""
    if not condition:
        raise ConfigError(message)
