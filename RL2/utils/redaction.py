"""Secrets kept out of what a run writes down: the config it logs to wandb and the command line in its
save_dir's lock. A key is secret when its name ends in `api_key` (rollout.api_key, the servers'
rollout.server_args.admin_api_key); its value is replaced by REDACTED."""

import re

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"api_key$", re.IGNORECASE)


def redact_config(value):
    """A plain config (dicts, lists, scalars) with the value of every secret key replaced."""
    if isinstance(value, dict):
        return {key: REDACTED if SECRET_NAME.search(str(key)) and item is not None else redact_config(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [redact_config(item) for item in value]
    return value


def redact_command(args: list[str]) -> list[str]:
    """Command-line arguments with the value of every `key=value` or `--key value` override of a secret key
    replaced (`rollout.api_key=...`, `++rollout.server_args.admin_api_key=...`, `--api-key ...`)."""
    redacted, hide_next = [], False
    for arg in args:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
            continue
        key, equals, _ = arg.partition("=")
        name = key.lstrip("+-~").replace("-", "_")
        if SECRET_NAME.search(name):
            if equals:
                arg = f"{key}={REDACTED}"
            elif key.startswith("--"):
                hide_next = True
        redacted.append(arg)
    return redacted
