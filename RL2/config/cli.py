"""Command line -> typed config: `python -m RL2.trainer.sft data.train.path=x.jsonl actor.optimizer.lr=1e-5`."""

import dataclasses
import difflib
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from RL2.config.aliases import SchemaKeys, apply_kl_estimators, apply_lora_switches, describe_aliases, translate
from RL2.config.errors import ConfigError
from RL2.config.schema import check_lora

CONFIG_DIR = Path(__file__).resolve().parent.parent / "trainer" / "config"

# Values a field may take, checked once at start: the error names the key and the choices.
CHOICES = {
    "dtype": ("auto", "bfloat16", "float16", "float32"),
    "avg_level": ("token", "sequence", "constant"),
    "scheduler.name": ("constant", "cosine"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "loss_type": ("sigmoid", "ipo"),
    "kl": ("forward", "reverse"),
}


def parse_config(schema: type, trainer: str, argv: list[str] | None = None) -> DictConfig:
    """Merge the schema's defaults, `RL2/trainer/config/<trainer>.yaml` and `key=value` arguments.

    Args:
        schema: the trainer's config dataclass (e.g. `SFTConfig`).
        trainer: name of the YAML file holding the trainer's defaults.
        argv: `key=value` overrides; `sys.argv[1:]` when None. `--help` prints every key. RL2's
            original key names are accepted (`RL2.config.aliases`); each one used is printed with
            its current key.
    """
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(describe(schema))
        sys.exit(0)
    bad = [arg for arg in argv if "=" not in arg]
    if bad:
        raise ConfigError(f"arguments must look like key=value, got {bad}; see --help for the keys")
    translation = translate(argv, schema_keys(schema))
    base = OmegaConf.structured(schema)
    layers = [OmegaConf.load(CONFIG_DIR / f"{trainer}.yaml"), OmegaConf.from_dotlist(translation.argv)]
    for layer, source in zip(layers, (f"{trainer}.yaml", "the command line")):
        try:
            base = OmegaConf.merge(base, layer)
        except ConfigKeyError as e:
            raise ConfigError(_unknown_key_message(e, schema, source)) from None
        except ValidationError as e:
            reason = str(e.msg).splitlines()[0]
            raise ConfigError(f"config key '{e.full_key}' from {source}: {reason}") from None
    apply_kl_estimators(base, translation)
    apply_lora_switches(base, translation)
    OmegaConf.resolve(base)
    check_choices(base)
    check_lora(base)
    if os.environ.get("RANK", "0") == "0":  # every rank parses the same command line: say it once
        for line in translation.lines:
            print(f"[RL2] {line}", flush=True)
    return base


def check_choices(cfg: DictConfig, prefix: str = "") -> None:
    """Fail on values outside CHOICES, naming the full key."""
    for key, value in cfg.items():
        full = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            check_choices(value, full + ".")
            continue
        for suffix, choices in CHOICES.items():
            if (full == suffix or full.endswith("." + suffix)) and value not in choices:
                raise ConfigError(f"config key '{full}' is {value!r}; choose one of {', '.join(choices)}")


def all_keys(schema: type, prefix: str = "") -> list[tuple[str, object, str]]:
    """(full key, default, help) for every leaf of a config dataclass."""
    rows = []
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += all_keys(type(default), f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, default, f.metadata.get("help", "")))
    return rows


def schema_keys(schema: type) -> SchemaKeys:
    """Every key of a config dataclass; any key under a dict-valued field (`rollout.server_args`) too."""
    rows = all_keys(schema)
    return SchemaKeys(frozenset(key for key, _, _ in rows),
                      frozenset(key for key, default, _ in rows if isinstance(default, dict)))


def describe(schema: type) -> str:
    width = max(len(key) for key, _, _ in all_keys(schema))
    lines = [f"{key:<{width}}  {help_text} (default: {default})" for key, default, help_text in all_keys(schema)]
    return "Config keys (set as key=value):\n" + "\n".join(lines) + "\n\n" + describe_aliases(schema_keys(schema))


def _unknown_key_message(error: ConfigKeyError, schema: type, source: str) -> str:
    key = error.full_key
    known = [k for k, _, _ in all_keys(schema)]
    close = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; run with --help to list the keys"
    return f"unknown config key '{key}' from {source}{hint}"
