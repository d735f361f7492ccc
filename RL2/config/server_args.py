"""`rollout.server_args`: the flags of `python -m sglang.launch_server` that RL2 passes to launched servers."""

import re

from RL2.config.errors import require

# Chosen by RL2 for every server it launches: the weights are the actor's and the port must be free.
RESERVED_ARGS = ("model_path", "port")

# SGLang's keys: RL2 gives rollout.api_key to launched servers in a private --config file and sends it with
# every request. An admin key would make SGLang refuse that key at the weight-update endpoints.
KEY_ARGS = ("api_key", "admin_api_key")

_FLAG = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def check_server_args(server_args: dict) -> dict:
    """`rollout.server_args` with keys in SGLang's snake_case, or a ConfigError naming the bad key. Values are
    scalars (a bool is a switch: true passes `--key`, false leaves it out) or lists of scalars (`--key v1 v2`).
    Whether SGLang knows a flag is its own business: an unknown one makes the server exit at once, its log quoted."""
    if not isinstance(server_args, dict):  # a config node (only omegaconf makes one): plain containers from here
        from omegaconf import OmegaConf

        server_args = OmegaConf.to_container(server_args)
    checked = {}
    for key, value in dict(server_args).items():
        name = str(key).replace("-", "_")
        where = f"rollout.server_args.{key}"
        require(_FLAG.match(str(key)), f"config key '{where}' is not a flag name of sglang.launch_server")
        require(name not in RESERVED_ARGS,
                f"config key '{where}' is set by RL2 (the actor's weights, a free port); remove it")
        require(name not in KEY_ARGS, f"config key '{where}' is set by RL2 from rollout.api_key (a random key if "
                f"unset), which it also sends with its requests; remove it and set rollout.api_key")
        values = value if isinstance(value, (list, tuple)) else [value]
        require(value is not None and all(isinstance(v, (str, int, float, bool)) for v in values),
                f"config key '{where}' must be a string, number, bool or list of them, got {value!r}")
        require(not isinstance(value, (list, tuple)) or not any(isinstance(v, bool) for v in values),
                f"config key '{where}' is a list of bools; SGLang switches take one true/false")
        checked[name] = list(value) if isinstance(value, (list, tuple)) else value
    return checked
