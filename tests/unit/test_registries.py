"""A config key that names a registered function has exactly the registry's names as its choices, both ways;
and the config schemas import without torch (config is the bottom layer: it imports no algorithm or engine)."""

import re
import subprocess
import sys

import pytest

from RL2.algs.averaging import AVERAGING_LEVELS
from RL2.algs.kl import KL_ESTIMATORS
from RL2.algs.policy_loss import CORRECTIONS, TRAJECTORY_LEVEL_CORRECTIONS
from RL2.algs.preference import DPO_LOSSES
from RL2.api import SCHEMAS
from RL2.config.cli import all_keys
from RL2.config.ppo_schema import RolloutConfig
from RL2.engine import ENGINES
from RL2.models.precision import DTYPES
from RL2.rollout.tools.tool_calls import _PARSERS, ToolCallParser
from RL2.trainer.ppo_advantages import ESTIMATORS
from RL2.workers.actor import POLICY_LOSSES, TRAJECTORY_LEVEL_LOSSES
from tests.helpers import REPO

# The end of a key -> (its registry, the choices besides the registry's names).
REGISTRIES = {
    "adv.estimator": (ESTIMATORS, ()),
    "actor.policy_loss": (POLICY_LOSSES, ()),
    "actor.correction.type": (CORRECTIONS, ("none",)),
    "actor.kl.estimator": (KL_ESTIMATORS, ()),
    "rollout.engine": (ENGINES, ("auto",)),
    "avg_level": (AVERAGING_LEVELS, ()),
    "dtype": (DTYPES, ("auto",)),
    "actor.loss_type": (DPO_LOSSES, ()),
}
# Keys whose choices are branches of one function, not names of a registry.
PLAIN = ("scheduler.name", "device", "actor.kl", "actor.kl.type", "adv.baseline", "rollout.tool_error",
         "rollout.weight_sync")


def _ends_with(key: str, end: str) -> bool:
    return key == end or key.endswith("." + end)


def keys_with_choices():
    return sorted({(key.name, key.choices) for schema in SCHEMAS.values() for key in all_keys(schema) if key.choices})


@pytest.mark.parametrize("key, choices", keys_with_choices())
def test_choices_are_the_registry_names(key, choices):
    registries = [end for end in REGISTRIES if _ends_with(key, end)]
    if not registries:
        assert any(_ends_with(key, end) for end in PLAIN), (
            f"{key} has choices {choices}: add the registry they name to REGISTRIES, or the key to PLAIN")
        return
    registry, extra = REGISTRIES[max(registries, key=len)]
    names = set(registry) | set(extra)
    assert len(choices) == len(set(choices))
    assert set(choices) == names, (f"{key}: {sorted(set(choices) - names)} only in the config's choices, "
                                   f"{sorted(names - set(choices))} only in the registry")


def test_every_registry_backs_a_key():
    keys = [key for key, _ in keys_with_choices()]
    for end in REGISTRIES:
        assert any(_ends_with(key, end) for key in keys), f"no config key ends with {end}"


def test_whole_trajectory_variants_are_registered():
    assert set(TRAJECTORY_LEVEL_LOSSES) <= set(POLICY_LOSSES)
    assert set(TRAJECTORY_LEVEL_CORRECTIONS) <= set(CORRECTIONS)


def test_tool_parser_help_lists_the_registered_formats():
    """rollout.tool_parser also takes 'file.py:Class', so it has no choices: its help names the formats."""
    help_text = RolloutConfig.__dataclass_fields__["tool_parser"].metadata["help"]
    listed = {name for pair in re.findall(r"\| (\w+)(?: \(alias (\w+)\))?", help_text) for name in pair if name}
    built_in = {name for name, parser in _PARSERS.items() if parser.__module__ == ToolCallParser.__module__}
    assert listed == built_in


def test_the_schemas_import_without_torch():
    # With sys.modules['torch'] = None, `import torch` (anywhere below) raises ImportError.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import RL2.config.schema, RL2.config.ppo_schema, RL2.config.eval_schema, RL2.config.validation")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
