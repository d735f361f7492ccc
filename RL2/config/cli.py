"""Command line -> typed config: `python -m RL2.trainer.sft data.train.path=x.jsonl actor.optimizer.lr=1e-5`."""

import dataclasses
import difflib
import functools
import operator
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from RL2.compat.aliases import SchemaKeys, describe_aliases, translate_original
from RL2.config.errors import ConfigError, require
from RL2.config.validation import check_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "trainer" / "config"

def parse_config(schema: type, trainer: str, argv: list[str] | None = None) -> DictConfig:
    """Merge the schema's defaults, `RL2/trainer/config/<trainer>.yaml` and `key=value` arguments (`argv`, default
    `sys.argv[1:]`; the original RL2's mean what they meant there, `RL2.compat`), then check the values once."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(describe(schema, trainer))
        sys.exit(0)
    bad = [arg for arg in argv if "=" not in arg and not arg.startswith("~")]  # Hydra's ~key: refused by name
    require(not bad, f"arguments must look like key=value, got {bad}; see --help for the keys")
    translation = translate_original(argv, schema_keys(schema))
    base = _merged(trainer_defaults(schema, trainer), OmegaConf.from_dotlist(translation.argv), schema,
                   "the command line")
    apply_value_aliases(base, schema)
    translation.apply(base, trainer)
    OmegaConf.resolve(base)
    check_choices(base, schema)
    check_config(base, schema)
    if os.environ.get("RANK", "0") == "0":  # every rank parses the same command line: say it once
        for line in translation.lines:
            print(f"[RL2] {line}", flush=True)
    return base


@functools.cache
def trainer_defaults(schema: type, trainer: str) -> DictConfig:
    """The schema's defaults merged with `<trainer>.yaml`, if the trainer has one, built once per process (a
    command line is merged onto a copy: building a structured config is the slow part of parsing one)."""
    path = CONFIG_DIR / f"{trainer}.yaml"
    if not path.exists():
        return OmegaConf.structured(schema)
    return _merged(OmegaConf.structured(schema), OmegaConf.load(path), schema, path.name)


def _merged(base: DictConfig, layer: DictConfig, schema: type, source: str) -> DictConfig:
    """`base` updated with `layer` (a new config); an unknown key or a bad value fails naming the key."""
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as e:
        close = difflib.get_close_matches(e.full_key, [key.name for key in all_keys(schema)], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; run with --help to list the keys"
        raise ConfigError(f"unknown config key '{e.full_key}' from {source}{hint}") from None
    except ValidationError as e:
        reason = str(e.msg).splitlines()[0]
        raise ConfigError(f"config key '{e.full_key}' from {source}: {reason}") from None


def apply_value_aliases(cfg: DictConfig, schema: type) -> None:
    """Replace another spelling of a choice (a field's `aliases`, e.g. adv.estimator=reinforce) with the choice."""
    for key in all_keys(schema):
        if key.aliases and (value := OmegaConf.select(cfg, key.name)) in key.aliases:
            OmegaConf.update(cfg, key.name, key.aliases[value])


def check_choices(cfg: DictConfig, schema: type) -> None:
    """Fail on a value outside its field's `choices` (declared with `opt`), naming the full key."""
    for key in all_keys(schema):
        if key.choices and (value := OmegaConf.select(cfg, key.name)) not in key.choices:
            raise ConfigError(f"config key '{key.name}' is {value!r}; choose one of {', '.join(key.choices)}")


class Key(NamedTuple):
    """One leaf of a config dataclass."""

    name: str  # the full dotted key
    default: Any
    help: str
    choices: tuple | None
    aliases: dict[str, str] | None


def all_keys(schema: type, prefix: str = "") -> list[Key]:
    """Every leaf of a config dataclass, with its default, help text and choices."""
    rows = []
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += all_keys(type(default), f"{prefix}{f.name}.")
        else:
            rows.append(Key(prefix + f.name, default, f.metadata.get("help", ""), f.metadata.get("choices"),
                            f.metadata.get("aliases")))
    return rows


def schema_keys(schema: type) -> SchemaKeys:
    """Every key of a config dataclass; any key under a dict-valued field (`rollout.server_args`) too."""
    rows = all_keys(schema)
    return SchemaKeys(frozenset(key.name for key in rows),
                      frozenset(key.name for key in rows if isinstance(key.default, dict)))


def describe(schema: type, trainer: str) -> str:
    """`--help`: every key with its help text and this trainer's default."""
    keys = all_keys(schema)
    # Unresolved: a key that follows another shows it (`${actor.dtype}`).
    defaults = OmegaConf.to_container(trainer_defaults(schema, trainer), resolve=False)
    width = max(len(key.name) for key in keys)
    lines = [f"{key.name:<{width}}  {key.help} (default: "
             f"{functools.reduce(operator.getitem, key.name.split('.'), defaults)})" for key in keys]
    return "Config keys (set as key=value):\n" + "\n".join(lines) + "\n\n" + describe_aliases(schema_keys(schema))
