"""The error every bad config value raises."""


class ConfigError(ValueError):
    """A bad config value; the message names the key and says what to do."""
