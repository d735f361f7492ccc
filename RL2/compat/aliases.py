"""RL2's original config keys, accepted as aliases of the current ones.

Command lines written for RL2's original releases keep working: each original key given on the
command line is rewritten to its current key (one printed line per alias, naming the current key),
an original key for something RL2 does not have fails with what to use instead, and any other
unknown key still fails with a suggestion (`RL2.config.cli`). The keys are in the table of
`RL2.compat.keys`; what a line written for the original means beyond them, in `RL2.compat.command_lines`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from RL2.compat.command_lines import Translation, as_text, parse_value
from RL2.compat.keys import ALIASES, BACKENDS, ORIGINAL_LORA_RANK, Dropped, Ignored, KLEstimator, LoRASwitch
from RL2.config.errors import ConfigError


@dataclass(frozen=True)
class SchemaKeys:
    """The keys of a trainer's config: `leaves`, plus any key under a dict-valued field (`open`,
    e.g. `rollout.server_args`)."""

    leaves: frozenset[str]
    open: frozenset[str] = frozenset()

    def __contains__(self, key: str) -> bool:
        return key in self.leaves or any(key.startswith(prefix + ".") for prefix in self.open)

    def has_section(self, prefix: str) -> bool:
        """Whether any key starts with `prefix` (which ends in ".")."""
        return any(k.startswith(prefix) for k in self.leaves) or any((k + ".").startswith(prefix) for k in self.open)


def translate_original(argv: list[str], keys: SchemaKeys) -> Translation:
    """Rewrite the original keys of `key=value` arguments to current keys; once the result's `argv` is
    merged into the trainer's config, its `apply` does the rest.

    Args:
        argv: `key=value` arguments.
        keys: the trainer's config keys; an alias applies only when its current keys exist there
            (otherwise the original key is left to fail as unknown, with a suggestion).
    """
    result, origin = Translation(), {}  # origin: current key -> (the argument that set it, through an alias)
    for arg in argv:
        key, _, raw = arg.partition("=")
        key = _hydra_key(key, result)
        found = resolve(key, keys)
        if found is None and key not in keys and ("." not in key or keys.has_section(key + ".")):
            _section_value(key, raw, keys, result)  # a value for a whole section
        elif found is None:
            _claim(origin, key, arg, alias=False)
            result.explicit.add(key)
            result.argv.append(f"{key}={raw}")
        elif isinstance(found, Dropped):
            raise ConfigError(f"config key '{key}' is from RL2's original releases and has no counterpart here: "
                              f"{found.instead}")
        elif isinstance(found, Ignored):
            result.original.append(key)
            result.lines.append(f"config key '{key}={raw}' (RL2's original name) is ignored: {found.why}")
        elif isinstance(found, KLEstimator):
            _claim(origin, f"actor.kl.{found.place}_estimator", arg, alias=True)
            result.kl_estimators[found.place] = (key, raw)
        elif isinstance(found, LoRASwitch):
            _claim(origin, key, arg, alias=True)
            result.lora_switches[found.model] = (key, raw)
        else:
            new_keys, value_map = found
            new_raw = raw if value_map is None else _mapped(value_map, raw, key)
            for new_key in new_keys:
                _claim(origin, new_key, arg, alias=True)
                result.argv.append(f"{new_key}={new_raw}")
            if new_keys != (key,):
                result.original.append(key)
            if new_keys != (key,) or new_raw != raw:
                result.lines.append(_alias_line(key, raw, new_keys, new_raw))
    result.given = set(origin)
    return result


def _hydra_key(key: str, result: Translation) -> str:
    """A key without Hydra's prefixes: `+key` and `++key` (which add a key the original's config lacked) are
    set as `key`; `~key` (which deletes one) has no meaning in a typed config and fails."""
    if key.startswith("~"):
        raise ConfigError(f"config key '{key}': Hydra's '~' deletes a key of the original's config; RL2's typed "
                          f"config keeps every key, so leave it out (its default stays) or set {key[1:]}=VALUE")
    if key.startswith("+"):
        bare = key.lstrip("+")
        result.original.append(key)
        result.lines.append(f"config key '{key}' (Hydra's '{key[:len(key) - len(bare)]}', which adds a key to the "
                            f"original's config) is set as '{bare}'")
        return bare
    return key


def _section_value(key: str, raw: str, keys: SchemaKeys, result: Translation) -> None:
    """A value for a section, or a top-level key that is none: the original's choice of a model's backend
    (`actor=fsdp`, a config group of its Hydra config) is accepted when it is RL2's own (FSDP) and fails
    saying why otherwise; anything else fails naming the key."""
    is_model = key in ("actor", "critic", "ref_actor")
    if not keys.has_section(key + ".") and not (key == "ref_actor" and raw in BACKENDS):
        raise ConfigError(f"unknown config key '{key}' from the command line; run with --help to list the keys")
    if not (is_model and raw in BACKENDS):
        raise ConfigError(f"config key '{key}={raw}' gives a value to a whole section; set its keys instead, e.g. "
                          f"{key}.<key>=... (run with --help to list them)")
    if BACKENDS[raw] is not None:
        raise ConfigError(f"config key '{key}={raw}' is from RL2's original releases and has no counterpart here: "
                          f"{BACKENDS[raw]}")
    result.original.append(key)
    result.lines.append(f"config key '{key}={raw}' (the original's backend choice) is what RL2 does: FSDP2 is its "
                        f"one backend")


def resolve(key: str, keys: SchemaKeys):
    """What an original key means here: `(current keys, value map or None)`, a `Dropped`, a
    `KLEstimator`, or None when `key` is no original key (or its current keys are not in `keys`)."""
    current, value_map, section_exists = (key,), None, False
    for _ in range(4):  # a prefix rename may lead to another alias (`kl.x` -> `actor.kl.x` -> ...)
        entry, rest = _lookup(current[0]) if len(current) == 1 else (None, "")
        if entry is None:
            break
        if isinstance(entry, (Dropped, Ignored)):
            return entry
        if isinstance(entry, KLEstimator):
            return entry if "actor.kl.estimator" in keys else None
        if isinstance(entry, LoRASwitch):
            return entry if f"{entry.model}.lora.rank" in keys else None
        current, value_map = tuple(new + rest for new in entry.new), entry.value or value_map
        # A section renamed as a whole: an unknown key under it is reported under its current name,
        # with the suggestions of that section (`kl.coeff` -> did you mean actor.kl.coef?).
        section_exists |= bool(rest) and all(keys.has_section(new) for new in entry.new)
        if entry.new == (entry.old,):  # a value alias of a current key: nothing further to follow
            break
    if (value_map is None and current == (key,)) or not (section_exists or all(k in keys for k in current)):
        return None
    return current, value_map


def _lookup(key: str):
    """The table entry for `key`: an exact match, else the longest prefix entry; and the rest of the key."""
    best = None
    for entry in ALIASES:
        if entry.old == key:
            return entry, ""
        if entry.old.endswith(".") and key.startswith(entry.old) and (best is None or len(entry.old) > len(best.old)):
            best = entry
    return (best, key[len(best.old):]) if best else (None, "")


def _alias_line(key: str, raw: str, new_keys: tuple[str, ...], new_raw: str) -> str:
    def shown(k: str, v: str) -> str:
        return f"'{k}={v}'" if new_raw != raw else f"'{k}'"

    return (f"config key {shown(key, raw)} (RL2's original name) is now "
            + " and ".join(shown(k, new_raw) for k in new_keys))


def _claim(origin: dict, key: str, arg: str, alias: bool) -> None:
    """Refuse two arguments for one current key when one of them is an original name."""
    if key in origin and alias and origin[key][0].split("=")[0] == arg.split("=")[0]:
        raise ConfigError(f"config key '{arg.split('=')[0]}' is given twice ('{origin[key][0]}' and '{arg}'), which "
                          f"both set '{key}'; keep one")
    if key in origin and (alias or origin[key][1]):
        raise ConfigError(f"'{origin[key][0]}' and '{arg}' both set config key '{key}' (one under RL2's original "
                          f"name); keep one")
    origin[key] = (arg, alias)


def _mapped(value_map: Callable[[Any], Any], raw: str, key: str) -> str:
    """The current value, as command-line text, of the original value `raw` of `key`."""
    try:
        return as_text(value_map(parse_value(raw, key)))
    except ValueError as e:
        raise ConfigError(f"config key '{key}': {e}") from None


def describe_aliases(keys: SchemaKeys) -> str:
    """The `--help` section: the original keys this trainer accepts, and those that fail."""
    renamed, dropped, ignored = [], [], []
    for entry in ALIASES:
        star = "*" if entry.old.endswith(".") else ""
        if isinstance(entry, Dropped):
            dropped.append(entry.old + star)
        elif isinstance(entry, Ignored):
            ignored.append(entry.old + star)
        elif isinstance(entry, KLEstimator):
            if "actor.kl.estimator" in keys:
                renamed.append(f"  {entry.old} -> actor.kl.estimator, when actor.kl.type={entry.place}")
        elif isinstance(entry, LoRASwitch):
            if f"{entry.model}.lora.rank" in keys:
                renamed.append(f"  {entry.old} -> {entry.model}.lora.rank (false: 0; true: the rank given, else "
                               f"{ORIGINAL_LORA_RANK})")
        elif entry.new != (entry.old,) and all(keys.has_section(n) if star else n in keys for n in entry.new):
            renamed.append(f"  {entry.old}{star} -> {', '.join(n + star for n in entry.new)}")
    return ("RL2's original key names (accepted; each one used is printed with its current key):\n"
            + "\n".join(renamed)
            + "\nOriginal memory and speed switches RL2 has no use for (accepted, and said to be ignored):\n  "
            + ", ".join(ignored)
            + "\nOriginal keys with no counterpart here (they fail at start, saying what to use instead):\n  "
            + ", ".join(dropped))
