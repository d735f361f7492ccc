"""Every check of config values alone, run once by `parse_config` before anything is loaded; checks that need
what only a run knows (the data, the model, the world size) stay where that is known."""

from collections.abc import Callable
from functools import partial

from RL2.config.errors import require
from RL2.config.eval_schema import EvalConfig, check_eval_config
from RL2.config.ppo_schema import PPOConfig, check_ppo_config
from RL2.config.schema import (
    REQUEST_TIMEOUT_MARGIN,
    DistillConfig,
    DPOConfig,
    ORPOConfig,
    RMConfig,
    SFTConfig,
    check_model_sections,
    check_run_sections,
)
from RL2.config.server_args import check_server_args

# SGLang's switch to return log-probabilities of the untempered distribution (sglang/srt/layers/sampler.py).
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def check_config(cfg, schema: type) -> None:
    """Fail on a value, or a combination of values, that cannot run, naming the key: the checks every trainer
    shares, then those of `schema` (the merged config's dataclass, or a subclass of one) in `SCHEMA_CHECKS`."""
    own = next((SCHEMA_CHECKS[cls] for cls in schema.__mro__ if cls in SCHEMA_CHECKS), ())
    for check in (check_model_sections, check_run_sections, check_collective_timeout, *own):
        check(cfg)


def check_collective_timeout(cfg) -> None:
    """`trainer.collective_timeout`, where set: positive, and with a rollout longer than one generation request
    plus `REQUEST_TIMEOUT_MARGIN` (`RL2.parallel.collective_timeout` says why)."""
    chosen = (cfg.get("trainer") or {}).get("collective_timeout")  # the evaluator's config has no trainer
    if chosen is None:
        return
    require(chosen > 0, f"trainer.collective_timeout={chosen}; give the seconds a collective may wait (null: the "
                        f"default)")
    request = (cfg.get("rollout") or {}).get("request_timeout")
    if request is not None:
        least = request + REQUEST_TIMEOUT_MARGIN
        require(chosen >= least, f"trainer.collective_timeout={chosen} s is shorter than rollout.request_timeout="
                f"{request} s plus {REQUEST_TIMEOUT_MARGIN:.0f} s: ranks waiting for another rank's rollout would be "
                f"stopped before its request times out. Raise trainer.collective_timeout to at least {least:.0f}, or "
                f"lower rollout.request_timeout")


def check_token_averaging(cfg) -> None:
    require(cfg.actor.avg_level != "constant", "actor.avg_level=constant divides by the generation budget, which "
                                               "only RL has; use token or sequence")


def check_pair_averaging(cfg, section: str) -> None:
    level = cfg[section].avg_level
    require(level == "token", f"{section}.avg_level={level}: a preference loss is one number per pair, averaged over "
                              f"the batch's pairs, so the key has no effect here; leave it out")


def check_dpo(cfg) -> None:
    actor = cfg.actor
    # 0: no gradient (sigmoid) or a target margin of 1 / 0 (ipo); below 0: prefers rejected
    require(actor.beta > 0, f"actor.beta={actor.beta}; DPO needs a positive beta, the strength of the KL to the "
                            f"reference (e.g. 0.1)")
    require(0 <= actor.label_smoothing < 0.5, f"actor.label_smoothing={actor.label_smoothing}; it is the assumed "
                                              f"share of flipped labels: set it in [0, 0.5) (0: plain DPO)")


def check_distill(cfg) -> None:
    require(cfg.actor.temperature > 0, f"actor.temperature={cfg.actor.temperature}; it softens both distributions "
                                       f"before the KL: set a positive temperature (1: the models' own)")


def server_urls(value) -> list[str]:
    """`rollout.server_url` as a list: one URL, a comma-separated string or a list."""
    if value is None:
        return []
    urls = value.split(",") if isinstance(value, str) else list(value)
    urls = [str(url).strip().rstrip("/") for url in urls if str(url).strip()]
    for url in urls:
        require(url.startswith(("http://", "https://")),
                f"config key 'rollout.server_url' has {url!r}; give URLs like http://host:30000")
    return urls


def check_engine(cfg) -> None:
    """The rollout engine's keys: launched servers' flags and environment, external servers, the weight sync."""
    rollout = cfg.rollout
    external = server_urls(rollout.server_url)
    require(not external or rollout.engine != "embedded",
            "rollout.server_url is set but rollout.engine=embedded; unset one of them")
    # The launched servers' own keys: ignored where no server is launched, as a GPU config run on CPU is.
    if not external and rollout.engine != "embedded":
        check_server_args(rollout.server_args)
        original = str((rollout.server_env or {}).get(ORIGINAL_LOGPROB_ENV, "0")).lower() in ("1", "true")
        require(not original, f"rollout.server_env.{ORIGINAL_LOGPROB_ENV} would make the servers return "
                f"log-probabilities at temperature 1, but the trained policy is the distribution at the sampling "
                f"temperature, whose log-probabilities SGLang returns by default; remove it")
    require(not external or rollout.get("weight_sync") != "tensor", "rollout.weight_sync=tensor needs servers "
            "launched by RL2; with rollout.server_url use disk (the servers must read this machine's files) or none")
    require(rollout.get("weight_bucket_mb", 1) > 0,
            f"config key 'rollout.weight_bucket_mb' must be positive, got {rollout.get('weight_bucket_mb')}")


# schema -> the checks of its own keys, after the shared ones.
SCHEMA_CHECKS: dict[type, tuple[Callable, ...]] = {
    SFTConfig: (check_token_averaging,),
    DistillConfig: (check_token_averaging, check_distill),
    DPOConfig: (partial(check_pair_averaging, section="actor"), check_dpo),
    ORPOConfig: (partial(check_pair_averaging, section="actor"),),
    RMConfig: (partial(check_pair_averaging, section="critic"),),
    PPOConfig: (check_ppo_config, check_engine),
    EvalConfig: (check_eval_config, check_engine),
}
