"""RL2's original config keys and switches: each maps to the current key and value, says so in one
printed line, and keys RL2 lacks (or never had) fail at start. The default algorithm is Dr. GRPO."""

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from RL2.compat.keys import ALIASES, Dropped, Ignored, KLEstimator, LoRASwitch, Renamed
from RL2.config import ConfigError, parse_config
from RL2.config.cli import all_keys, schema_keys
from RL2.config.eval_schema import EvalConfig
from RL2.config.ppo_schema import PPOConfig
from RL2.config.schema import DistillConfig, DPOConfig, ORPOConfig, RMConfig, SFTConfig
from RL2.config.server_args import RESERVED_ARGS
from tests.helpers import REPO

SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "orpo": ORPOConfig, "rm": RMConfig, "distill": DistillConfig,
           "ppo": PPOConfig, "eval": EvalConfig}
EXAMPLES = REPO / "examples"

# The original README's two switch lines, verbatim.
OPENAI_PPO = "To use OpenAI PPO, set `kl.type=reward`, `kl.reward_estimator=k1`, and `adv.estimator=gae`"
DEEPSEEK_GRPO = ("To use DeepSeek GRPO, set `actor.avg_level=sequence`, `kl.type=loss`, `kl.loss_estimator=k3`, "
                 "and `adv.norm_var=true`")


def switches(sentence: str, prefix: str = "") -> list[str]:
    """The `key=value` settings of a README sentence, with `prefix` put before the `kl.*` ones."""
    return [prefix + s if s.startswith("kl.") else s for s in re.findall(r"`([^`]+=[^`]+)`", sentence)]


def value(cfg, key):
    return OmegaConf.select(cfg, key)


# (trainer, original key=value, {current key: value}) -- the values as the original meant them
CASES = [
    ("ppo", "train_data.path=rl.jsonl", {"data.train.path": "rl.jsonl"}),
    ("ppo", "train_data.prompts_per_rollout=16", {"data.train.batch_size": 16}),
    ("ppo", "train_data.responses_per_prompt=8", {"rollout.responses_per_prompt": 8}),
    ("ppo", "test_data.path=test.jsonl", {"data.test.path": "test.jsonl"}),
    ("ppo", "test_data.responses_per_prompt=4", {"rollout.test_responses_per_prompt": 4}),
    ("ppo", "test_data.prompts_per_rollout=8", {"rollout.test_prompts_per_rollout": 8}),
    ("ppo", "rollout.test.prompts_per_rollout=32", {"rollout.test_prompts_per_rollout": 32}),
    ("ppo", "actor.lr=2e-6", {"actor.optimizer.lr": 2e-6}),
    ("ppo", "critic.lr=3e-6", {"critic.optimizer.lr": 3e-6}),
    ("ppo", "actor.sp_size=2", {"actor.cp_size": 2}),
    ("ppo", "actor.gradient_checkpointing=true", {"actor.enable_gradient_checkpointing": True}),
    ("ppo", "actor.scheduler=cosine", {"actor.scheduler.name": "cosine"}),
    ("ppo", "actor.scheduler=cosine_with_min_lr", {"actor.scheduler.name": "cosine"}),
    ("ppo", "actor.scheduler.name=constant_with_warmup", {"actor.scheduler.name": "constant"}),
    ("ppo", "actor.warmup_ratio=0.05", {"actor.scheduler.warmup_ratio": 0.05}),
    ("ppo", "actor.weight_decay=0.01", {"actor.optimizer.weight_decay": 0.01}),
    ("ppo", "actor.agg_mode=seq_mean", {"actor.avg_level": "sequence"}),
    ("ppo", "actor.save_freq=10", {"trainer.save_freq": 10}),
    ("ppo", "actor.tis_coef=0.0", {"actor.tis_coef": None}),
    ("ppo", "actor.tis_coef=2.0", {"actor.tis_coef": 2.0}),
    ("ppo", "critic.clip=0.3", {"critic.value_clip": 0.3}),
    ("ppo", "kl.coef=0.01", {"actor.kl.coef": 0.01}),
    ("ppo", "data.train_data_path=rl.jsonl", {"data.train.path": "rl.jsonl"}),
    ("ppo", "data.prompts_per_rollout=32", {"data.train.batch_size": 32}),
    ("ppo", "data.responses_per_prompt=2", {"rollout.responses_per_prompt": 2}),
    ("ppo", "rollout.train.path=rl.jsonl", {"data.train.path": "rl.jsonl"}),
    ("ppo", "rollout.train.sampling_params.max_new_tokens=64", {"rollout.train_sampling_params.max_new_tokens": 64}),
    ("ppo", "train_data.sampling_params.temperature=0.7", {"rollout.train_sampling_params.temperature": 0.7}),
    ("ppo", "train_data.max_new_tokens=32", {"rollout.train_sampling_params.max_new_tokens": 32}),
    ("ppo", "rollout.train_prompts_per_rollout=8", {"data.train.batch_size": 8}),
    ("ppo", "rollout.apply_chat_template=false",
     {"data.train.apply_chat_template": False, "data.test.apply_chat_template": False}),
    ("ppo", "actor.rollout.env_path=envs/countdown.py", {"rollout.env_path": "envs/countdown.py"}),
    ("ppo", "actor.rollout.max_response_length=100",
     {"rollout.train_sampling_params.max_new_tokens": 100, "rollout.test_sampling_params.max_new_tokens": 100}),
    ("ppo", "actor.rollout.train_sampling_params.max_new_tokens=48",
     {"rollout.train_sampling_params.max_new_tokens": 48}),
    ("ppo", "actor.rollout.n_turns=3", {"rollout.max_turns": 3}),
    ("ppo", "actor.rollout.tp_size=2", {"rollout.server_args.tp_size": 2}),
    ("ppo", "rollout.gpu_memory_utilization=0.4", {"rollout.server_args.mem_fraction_static": 0.4}),
    ("ppo", "rollout.bucket_size=256", {"rollout.weight_bucket_mb": 256}),
    ("ppo", "trainer.disable_wandb=true", {"trainer.use_wandb": False}),
    ("ppo", "trainer.disable_wandb=false", {"trainer.use_wandb": True}),
    ("ppo", "trainer.load_ckpt_from_dir=ckpts/x/step4", {"trainer.load_ckpt_from": "ckpts/x/step4"}),
    ("sft", "data.path=sft.jsonl", {"data.train.path": "sft.jsonl"}),
    ("sft", "data.max_length=512", {"data.train.max_length": 512, "data.test.max_length": 512}),
    ("sft", "data.batch_size=64", {"data.train.batch_size": 64}),
    ("sft", "data.messages_key=conversation",
     {"data.train.messages_key": "conversation", "data.test.messages_key": "conversation"}),
    ("sft", "actor.lr=1e-4", {"actor.optimizer.lr": 1e-4}),
    ("dpo", "trainer.beta=0.2", {"actor.beta": 0.2}),
    ("dpo", "data.chosen_key=good", {"data.train.chosen_key": "good", "data.test.chosen_key": "good"}),
    ("rm", "critic.lr=5e-6", {"critic.optimizer.lr": 5e-6}),
    ("rm", "critic.sp_size=2", {"critic.cp_size": 2}),
    ("distill", "actor.warmup_ratio=0.1", {"actor.scheduler.warmup_ratio": 0.1}),
    ("ppo", "actor.lora.r=8", {"actor.lora.rank": 8}),
    ("ppo", "actor.lora.lora_alpha=16", {"actor.lora.alpha": 16.0}),
    ("sft", "actor.lora.lora_dropout=0.05", {"actor.lora.dropout": 0.05}),
    ("ppo", "actor.use_lora=true", {"actor.lora.rank": 16}),  # the original's default lora.r
    ("ppo", "actor.lora.target_modules=all-linear", {"actor.lora.target_modules": ["all-linear"]}),  # peft's string
    ("ppo", "actor.agg_mode=all_token_mean", {"actor.avg_level": "token"}),
    ("sft", "actor.agg_mode=seq_mean_seq_token_mean", {"actor.avg_level": "sequence"}),
    ("ppo", "train_data.experience.max_new_tokens=64", {"rollout.train_sampling_params.max_new_tokens": 64}),
    ("ppo", "rollout.server_args.model_path=m", {"actor.model_name": "m"}),
    ("rm", "critic.use_lora=false", {"critic.lora.rank": 0}),
]


@pytest.mark.parametrize("trainer, arg, expected", CASES, ids=[c[1] for c in CASES])
def test_original_key_maps_to_current_key_and_value(trainer, arg, expected, capsys):
    cfg = parse_config(SCHEMAS[trainer], trainer, [arg])
    for key, want in expected.items():
        got = value(cfg, key)
        assert got == (pytest.approx(want) if isinstance(want, float) else want), key
    old_key = arg.split("=")[0]
    lines = [line for line in capsys.readouterr().out.splitlines() if f"'{old_key}" in line]
    if expected.keys() != {old_key}:  # a renamed key: one line naming every current key
        assert len(lines) == 1 and "RL2's original name" in lines[0]
        assert all(f"'{key}" in lines[0] for key in expected)


def test_original_lora_switch_takes_the_rank_given(capsys):
    cfg = parse_config(PPOConfig, "ppo", ["actor.use_lora=true", "actor.lora.r=64", "critic.use_lora=false",
                                          "critic.lora.r=8"])
    assert (cfg.actor.lora.rank, cfg.critic.lora.rank) == (64, 0)  # the original ignores lora.r without use_lora
    assert "'actor.use_lora=true' (RL2's original name) is now 'actor.lora.rank=64'" in capsys.readouterr().out


def test_original_ppo_command_line_of_the_issue(capsys):
    argv = ["train_data.path=rl.jsonl", "train_data.prompts_per_rollout=16", "train_data.responses_per_prompt=8",
            "test_data.path=test.jsonl", "actor.lr=1e-6", "actor.sp_size=2", "actor.kl.coef=0.01",
            "actor.kl.type=reward", "actor.kl.reward_estimator=k1", "actor.kl.loss_estimator=k2",
            "actor.gradient_checkpointing=true", "actor.scheduler=cosine", "actor.warmup_ratio=0.1"]
    cfg = parse_config(PPOConfig, "ppo", argv)
    assert (cfg.data.train.path, cfg.data.train.batch_size, cfg.rollout.responses_per_prompt) == ("rl.jsonl", 16, 8)
    assert (cfg.data.test.path, cfg.actor.optimizer.lr, cfg.actor.cp_size) == ("test.jsonl", 1e-6, 2)
    assert (cfg.actor.kl.type, cfg.actor.kl.estimator, cfg.actor.kl.coef) == ("reward", "k1", 0.01)
    assert cfg.actor.enable_gradient_checkpointing and cfg.actor.scheduler.name == "cosine"
    assert cfg.actor.scheduler.warmup_ratio == 0.1
    *lines, critic, defaults = capsys.readouterr().out.splitlines()
    # the original's critic section took the actor's values (critic.sp_size: ${actor.sp_size}, ...)
    assert critic == ("[RL2] the critic follows the actor's settings, as in the original: critic.cp_size=2, "
                      "critic.enable_gradient_checkpointing=true, critic.scheduler.name=cosine, "
                      "critic.scheduler.warmup_ratio=0.1")
    assert defaults.startswith("[RL2] RL2's defaults differ from the original's for keys this command line leaves out")
    assert lines == [
        "[RL2] config key 'train_data.path' (RL2's original name) is now 'data.train.path'",
        "[RL2] config key 'train_data.prompts_per_rollout' (RL2's original name) is now 'data.train.batch_size'",
        "[RL2] config key 'train_data.responses_per_prompt' (RL2's original name) is now "
        "'rollout.responses_per_prompt'",
        "[RL2] config key 'test_data.path' (RL2's original name) is now 'data.test.path'",
        "[RL2] config key 'actor.lr' (RL2's original name) is now 'actor.optimizer.lr'",
        "[RL2] config key 'actor.sp_size' (RL2's original name) is now 'actor.cp_size'",
        "[RL2] config key 'actor.gradient_checkpointing' (RL2's original name) is now "
        "'actor.enable_gradient_checkpointing'",
        "[RL2] config key 'actor.scheduler' (RL2's original name) is now 'actor.scheduler.name'",
        "[RL2] config key 'actor.warmup_ratio' (RL2's original name) is now 'actor.scheduler.warmup_ratio'",
        "[RL2] config key 'actor.kl.loss_estimator=k2' (RL2's original name) is not used: actor.kl.type=reward puts "
        "the KL in the reward, whose estimator is actor.kl.estimator",
        "[RL2] config key 'actor.kl.reward_estimator=k1' (RL2's original name) is now 'actor.kl.estimator=k1': "
        "actor.kl.type=reward puts the KL in the reward",
    ]


@pytest.mark.parametrize("prefix", ["", "actor."])
def test_documented_switch_lines_parse_verbatim(prefix, capsys):
    ppo = parse_config(PPOConfig, "ppo", switches(OPENAI_PPO, prefix))
    assert (ppo.actor.kl.type, ppo.actor.kl.estimator, ppo.adv.estimator) == ("reward", "k1", "gae")
    grpo = parse_config(PPOConfig, "ppo", switches(DEEPSEEK_GRPO, prefix))
    assert (grpo.actor.avg_level, grpo.actor.kl.type, grpo.actor.kl.estimator, grpo.adv.norm_var) == (
        "sequence", "loss", "k3", True)
    out = capsys.readouterr().out
    assert f"config key '{prefix}kl.reward_estimator=k1' (RL2's original name) is now 'actor.kl.estimator=k1'" in out
    assert f"config key '{prefix}kl.loss_estimator=k3' (RL2's original name) is now 'actor.kl.estimator=k3'" in out
    assert parse_config(PPOConfig, "ppo", []).actor.kl.estimator != "k1"  # so k1 came from the switch line


def test_estimator_of_the_other_place_is_not_used(capsys):
    cfg = parse_config(PPOConfig, "ppo", ["kl.type=reward", "kl.loss_estimator=k1"])
    assert cfg.actor.kl.estimator == parse_config(PPOConfig, "ppo", []).actor.kl.estimator == "k3"
    assert "'kl.loss_estimator=k1' (RL2's original name) is not used: actor.kl.type=reward" in capsys.readouterr().out
    # With no type given, the place is the default one (the loss).
    assert parse_config(PPOConfig, "ppo", ["kl.loss_estimator=k2"]).actor.kl.estimator == "k2"


def test_alias_lines_are_printed_by_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    cfg = parse_config(PPOConfig, "ppo", ["actor.lr=3e-6"])
    assert cfg.actor.optimizer.lr == 3e-6 and capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    parse_config(PPOConfig, "ppo", ["actor.lr=3e-6"])
    assert capsys.readouterr().out.startswith(
        "[RL2] config key 'actor.lr' (RL2's original name) is now 'actor.optimizer.lr'\n")


def test_current_keys_print_nothing(capsys):
    parse_config(PPOConfig, "ppo", ["actor.optimizer.lr=3e-6", "actor.scheduler.name=cosine", "actor.tis_coef=2"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "trainer, arg, message",
    [
        ("ppo", "actor.lora.use_rslora=true", r"'actor.lora.use_rslora'.*actor.lora.alpha to alpha x sqrt\(rank\)"),
        ("ppo", "ref_actor.model_name=x", "'ref_actor.model_name'.*the actor's initial weights"),
        ("ppo", "actor.rollout.reward_fn_path=r.py", r"becomes rollout.reward_fn=FILE:NAME with def NAME\(response"),
        ("ppo", "actor.rollout.env_url=http://x", "rollout.env_path=FILE"),
        ("ppo", "actor=megatron", "'actor=megatron'.*RL2 trains with FSDP2 only.*actor.tp_size"),
        ("ppo", "critic=megatron", "'critic=megatron'.*FSDP2 only"),
        ("ppo", "actor.tf_config.tensor_model_parallel_size=2", "FSDP2 only"),
        ("ppo", "actor=foo", "'actor=foo' gives a value to a whole section; set its keys"),
        ("ppo", "actor.kl=3", "'actor.kl=3' gives a value to a whole section"),
        ("sft", "critic=fsdp", "unknown config key 'critic'"),
        ("ppo", "~actor.lr", "'~actor.lr': Hydra's '~' deletes a key.*set actor.lr=VALUE"),
        ("ppo", "~actor.lr=1e-6", "'~actor.lr': Hydra's '~'"),
    ],
)
def test_original_keys_without_counterpart_fail_saying_what_to_do(trainer, arg, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SCHEMAS[trainer], trainer, [arg])


@pytest.mark.parametrize("trainer, arg, why", [
    ("sft", "actor.use_liger_kernel=true", "RL2 has no Liger kernels"),
    ("ppo", "actor.use_liger_kernel=false", "RL2 has no Liger kernels"),
    ("ppo", "actor.offload_model=true", "keeps the model on its device"),
    ("rm", "critic.max_inference_length_per_device=4096", "critic.max_length_per_device"),
    ("ppo", "ref_actor.sp_size=2", "follows actor.*"),
    ("dpo", "data.batch_size_per_device=2", "packs micro-batches by tokens"),
    ("ppo", "rollout.base_port=30000", "picks free ports"),
    ("ppo", "actor.rollout.multi_thread_scoring=false", "run concurrently"),
])
def test_original_memory_and_speed_switches_are_ignored_with_a_line(trainer, arg, why, capsys):
    default = parse_config(SCHEMAS[trainer], trainer, [])
    capsys.readouterr()
    cfg = parse_config(SCHEMAS[trainer], trainer, [arg])
    lines = capsys.readouterr().out.splitlines()
    assert f"config key '{arg}' (RL2's original name) is ignored: " in lines[0] and why in lines[0]
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(default)  # nothing that is trained changes


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_hydra_plus_sets_the_key(prefix, capsys):
    cfg = parse_config(PPOConfig, "ppo", [f"{prefix}rollout.train_sampling_params.stop=['</search>']"])
    assert list(cfg.rollout.train_sampling_params.stop) == ["</search>"]
    assert f"config key '{prefix}rollout.train_sampling_params.stop' (Hydra's '{prefix}'" in capsys.readouterr().out


def test_original_backend_choice_fsdp_is_accepted(capsys):
    cfg = parse_config(PPOConfig, "ppo", ["actor=fsdp", "critic=fsdp", "ref_actor=fsdp"])
    assert cfg.actor.model_name == parse_config(PPOConfig, "ppo", []).actor.model_name
    assert "config key 'actor=fsdp' (the original's backend choice) is what RL2 does" in capsys.readouterr().out


@pytest.mark.parametrize(
    "trainer, arg, message",
    [
        ("sft", "actor.optimzer.lr=1", r"unknown config key 'actor.optimzer'.*did you mean actor.optimizer.lr"),
        ("ppo", "trainer.save_frq=3", r"unknown config key 'trainer.save_frq'.*did you mean trainer.save_freq"),
        ("ppo", "adv.norm_vars=true", r"unknown config key 'adv.norm_vars'.*did you mean adv.norm_var"),
        ("ppo", "kl.coeff=0.1", r"unknown config key 'actor.kl.coeff'.*did you mean actor.kl.coef"),
        # an original key of another trainer's section is unknown here, not silently ignored
        ("sft", "train_data.responses_per_prompt=8", r"unknown config key 'train_data'"),
        ("sft", "kl.type=loss", r"unknown config key 'kl'"),
        ("rm", "actor.lr=1e-5", r"unknown config key 'actor'.*"),
    ],
)
def test_unknown_keys_still_fail_with_a_suggestion(trainer, arg, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(SCHEMAS[trainer], trainer, [arg])


@pytest.mark.parametrize(
    "trainer, argv, message",
    [
        ("sft", ["data.path=a.jsonl", "data.train.path=b.jsonl"],
         "'data.path=a.jsonl' and 'data.train.path=b.jsonl' both set config key 'data.train.path'"),
        ("ppo", ["train_data.responses_per_prompt=4", "rollout.responses_per_prompt=8"],
         "both set config key 'rollout.responses_per_prompt'"),
        ("ppo", ["kl.loss_estimator=k1", "actor.kl.loss_estimator=k2"],
         "both set config key 'actor.kl.loss_estimator'"),
        ("ppo", ["kl.loss_estimator=k1", "actor.kl.estimator=k2"],
         "'kl.loss_estimator=k1' and 'actor.kl.estimator=k2' disagree"),
        ("ppo", ["trainer.disable_wandb=maybe"], "config key 'trainer.disable_wandb': expected true or false"),
        ("ppo", ["actor.use_lora=true", "actor.lora.rank=0"], "'actor.use_lora=true' and 'actor.lora.rank=0' disagree"),
        ("sft", ["actor.lora.r=8", "actor.lora.rank=4"], "both set config key 'actor.lora.rank'"),
        ("ppo", ["rollout.train.path=a.jsonl", "rollout.train.path=b.jsonl"],
         "config key 'rollout.train.path' is given twice "
         "('rollout.train.path=a.jsonl' and 'rollout.train.path=b.jsonl')"),
    ],
)
def test_contradicting_original_and_current_keys_fail(trainer, argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(SCHEMAS[trainer], trainer, argv)


def test_help_lists_the_original_keys(capsys):
    with pytest.raises(SystemExit):
        parse_config(PPOConfig, "ppo", ["--help"])
    text = capsys.readouterr().out
    assert "RL2's original key names" in text
    for line in ("train_data.path -> data.train.path", "actor.lr -> actor.optimizer.lr", "kl.* -> actor.kl.*",
                 "actor.kl.reward_estimator -> actor.kl.estimator, when actor.kl.type=reward"):
        assert line in text
    ignored, dropped = text.split("has no use for")[1].split("no counterpart here")
    assert "actor.use_liger_kernel" in ignored and "ref_actor.*" in ignored
    assert "actor.lora.use_rslora" in dropped and "actor.tf_config.*" in dropped


def test_alias_table_never_shadows_a_current_key():
    """An original key that is also a current key would change what a current command line means;
    only value aliases (same key, e.g. actor.tis_coef=0) may name one. Every target exists somewhere."""
    keys = [schema_keys(schema) for schema in SCHEMAS.values()]
    # Server flags RL2 sets itself are refused under their own name (rollout.server_args.model_path).
    refused = {f"rollout.server_args.{name}" for name in RESERVED_ARGS}
    for entry in ALIASES:
        if isinstance(entry, Renamed) and entry.new == (entry.old,):
            assert any(entry.old in k for k in keys), entry
            continue
        if entry.old in refused:
            continue
        prefix = entry.old.endswith(".")
        assert not any(k.has_section(entry.old) if prefix else entry.old in k for k in keys), entry
        if isinstance(entry, Renamed):  # to current keys, or to another original section (train_data.experience.)
            for new in entry.new:
                assert any(k.has_section(new) if prefix else new in k for k in keys) or any(
                    other.old.startswith(new) for other in ALIASES), (entry, new)
        else:
            assert isinstance(entry, (Dropped, Ignored, KLEstimator, LoRASwitch))


def test_default_algorithm_is_dr_grpo():
    """Dr. GRPO (arXiv 2503.20783): group-mean baseline, no division by the group std, token-level average."""
    for cfg in (OmegaConf.structured(PPOConfig), parse_config(PPOConfig, "ppo", [])):
        assert (cfg.adv.estimator, cfg.adv.norm_var, cfg.actor.avg_level) == ("grpo", False, "token")
    help_text = {key.name: key.help for key in all_keys(PPOConfig)}["adv.norm_var"]
    assert "Dr. GRPO" in help_text


def example_argv(script: Path) -> tuple[str, list[str]]:
    """The trainer ("eval" for the evaluator) and key=value arguments of an examples/*.sh script."""
    text = script.read_text().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if "-m RL2.trainer." in line or "-m RL2.evaluate" in line)
    words = shlex.split(command)
    module = next(w for w in words if w.startswith(("RL2.trainer.", "RL2.evaluate")))
    trainer = "eval" if module == "RL2.evaluate" else module.rsplit(".", 1)[1]
    return trainer, [w for w in words if "=" in w and not w.startswith("--") and "$" not in w]


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*.sh")), ids=lambda p: p.name)
def test_examples_parse_and_grpo_example_is_grpo(script, capsys):
    trainer, argv = example_argv(script)
    cfg = parse_config(SCHEMAS[trainer], trainer, argv)
    assert capsys.readouterr().out == ""  # the examples use current keys only
    if script.name == "grpo_smollm2.sh":  # GRPO divides by the group std; it must say so now that it is not the default
        assert (cfg.adv.estimator, cfg.adv.norm_var) == ("grpo", True)
