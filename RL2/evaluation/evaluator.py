"""The evaluator: sample every test prompt with a model (and with a second one to compare) on the RL trainer's
rollout engine (`RolloutWorker`, each rank its share of the prompts), score the samples with the environment or
reward function, and report. Each sample has its own seed (docs/evaluation.md)."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from RL2.config.errors import ConfigError
from RL2.config.eval_schema import TRAINING_ONLY
from RL2.config.ppo_schema import RolloutConfig
from RL2.datasets.loading import load_table, take
from RL2.datasets.tokenize import tokenize_rows
from RL2.evaluation.report import format_table, sample_records
from RL2.native import prepare_process
from RL2.parallel import collective_timeout, init_distributed, pick_device
from RL2.rollout.loop import sample_seed
from RL2.rollout.metrics import evaluation_metrics, metrics_difference
from RL2.rollout.trajectory import Trajectory
from RL2.rollout.worker import rollout_seed
from RL2.trainer.base import quiet_third_party_progress
from RL2.trainer.rollout_setup import (
    RolloutScript,
    calls_tools,
    close_script,
    load_rollout_script,
    prompt_row_maker,
    rollout_worker,
    tools_of,
)
from RL2.utils.logging import is_rank0, log_rank0, write_atomic
from RL2.workers.fsdp import load_tokenizer


@dataclass
class EvalResult:
    """What an evaluation found (the same on every rank)."""

    metrics: dict  # {"overall": {...}, "by_source": {data_source: {...}}} of `RL2.rollout.metrics`
    compare: dict | None  # the same for `compare.model_name`
    difference: dict | None  # metrics - compare, per data source and metric
    save_dir: Path  # where samples.jsonl (every sample) and metrics.json are

    @property
    def samples_path(self) -> Path:
        return self.save_dir / "samples.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.save_dir / "metrics.json"


class Evaluator:
    """`env`: what is rolled out; default: `load_rollout_script(cfg.rollout)` (`RL2.evaluate` passes a reward)."""

    def __init__(self, cfg: DictConfig, env: RolloutScript | None = None):
        self.device = pick_device(cfg.eval.device, key="eval.device")
        # Huge pages before the environment's script can allocate; malloc tuned before any thread starts.
        prepare_process(self.device)
        quiet_third_party_progress()
        self.cfg = cfg
        # Bad input fails before any process group or engine is started.
        self.env = env if env is not None else load_rollout_script(cfg.rollout)
        self.rows = load_table(cfg.data.test.path)
        if cfg.data.max_prompts is not None:
            self.rows = take(self.rows, range(min(cfg.data.max_prompts, len(self.rows))))
        self.ks = list(cfg.eval.k) or [cfg.rollout.responses_per_prompt]
        try:  # now, not after the sampling, whose results would be lost
            Path(cfg.eval.save_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only place, or a file where a folder of the path should be
            raise ConfigError(f"eval.save_dir={cfg.eval.save_dir}: cannot create it ({e.strerror}: {e.filename}); "
                              f"give a folder this user can write") from None
        init_distributed(self.device, collective_timeout(cfg))

    def run(self) -> EvalResult:
        """Evaluate the model (and the one to compare with); write the samples and metrics; print a table."""
        try:
            return self._run()
        finally:
            close_script(self.env)

    def _run(self) -> EvalResult:
        cfg, began = self.cfg, time.perf_counter()
        models = {"model": cfg.model}
        if cfg.compare.model_name:
            models["compare"] = OmegaConf.merge(cfg.model, {"model_name": cfg.compare.model_name,
                                                            "tokenizer_name": cfg.compare.tokenizer_name})
        metrics, records, first_prompts = {}, [], None
        for role, model_cfg in models.items():
            prompts, groups = self.sample(model_cfg, role)
            if first_prompts is not None and [p["extra_info"] for p in prompts] != first_prompts:
                raise ConfigError("model.model_name and compare.model_name keep different test rows (their tokenizers "
                                  "tokenize the prompts differently and data.skip_bad_rows drops different rows); "
                                  "compare models with one tokenizer, or raise data.test.max_length")
            first_prompts = [p["extra_info"] for p in prompts]
            sources = [str(p["extra_info"].get("data_source", "default")) for p in prompts]
            metrics[role] = evaluation_metrics(groups, sources, self.ks, cfg.eval.threshold,
                                               tools=calls_tools(self.env))
            origin = {"data": cfg.data.test.path, "script": str(self.env.path)}  # where each sample's prompt is
            records += [record | origin for record in sample_records(groups, prompts, sources, role,
                                                                     model_cfg.model_name, cfg.eval.threshold)]
        difference = metrics_difference(metrics["model"], metrics["compare"]) if "compare" in metrics else None
        result = EvalResult(metrics["model"], metrics.get("compare"), difference, Path(cfg.eval.save_dir))
        if is_rank0():
            self.save(result, records)
            print(self.describe(len(first_prompts), time.perf_counter() - began), flush=True)
            print(format_table(metrics, difference), flush=True)
        return result

    def sample(self, model_cfg, role: str) -> tuple[list[dict], list[list[Trajectory]]]:
        """The test prompts as `model_cfg`'s tokenizer renders them, each with the sampling seed of its position,
        and the samples of each."""
        cfg, rollout_cfg = self.cfg, engine_config(self.cfg.rollout)
        tokenizer = load_tokenizer(model_cfg, role)  # the compared model's section is a copy of model's
        tool_use = tools_of(self.env, rollout_cfg, tokenizer)  # the prompts show them
        make_row = prompt_row_maker(self.env, tool_use, tokenizer)
        prompts, skipped = tokenize_rows(self.rows, make_row(cfg.data.test), cfg.data.test.path,
                                         cfg.data.skip_bad_rows, keep_row=True)
        if skipped:
            log_rank0(f"skipped {skipped} bad rows (data.skip_bad_rows=true)")
        for index, row in enumerate(prompts):
            row["sampling_seed"] = sample_seed(cfg.eval.seed, index)
        worker = rollout_worker(rollout_cfg, model_cfg, tokenizer, self.device, self.env, tool_use, seed=cfg.eval.seed)
        try:
            seed = rollout_seed(cfg.eval.seed, 0, dist.get_rank())  # only requests without their own seed use it
            groups = worker.rollout(prompts, cfg.rollout.sampling_params, cfg.rollout.responses_per_prompt, seed)
        finally:
            worker.shutdown()  # the second model's engine (and judge) must not share the device with this one
        return prompts, groups

    def save(self, result: EvalResult, records: list[dict]) -> None:
        """Write every sample as a JSON line, and the metrics as JSON, each atomically (a crash leaves the previous
        file or none)."""
        cfg = self.cfg
        lines = [json.dumps(record, ensure_ascii=False, default=str) + "\n" for record in records]
        write_atomic(result.samples_path, "".join(lines))
        metrics = {
            "settings": {"samples_per_prompt": cfg.rollout.responses_per_prompt, "k": self.ks,
                         "threshold": cfg.eval.threshold, "seed": cfg.eval.seed, "data": cfg.data.test.path,
                         "sampling_params": OmegaConf.to_container(cfg.rollout.sampling_params)},
            "model": {"name": cfg.model.model_name, **result.metrics},
            "compare": {"name": cfg.compare.model_name, **result.compare} if result.compare else None,
            "difference": result.difference,
        }
        write_atomic(result.metrics_path, json.dumps(metrics, indent=2, ensure_ascii=False, default=str) + "\n")

    def describe(self, n_prompts: int, seconds: float) -> str:
        cfg, params = self.cfg, self.cfg.rollout.sampling_params
        lines = [f"[RL2] evaluated {n_prompts} prompts x {cfg.rollout.responses_per_prompt} samples "
                 f"(temperature {params.temperature}, max_new_tokens {params.max_new_tokens}) in {seconds:.1f} s; "
                 f"a sample passes when its score >= {cfg.eval.threshold}",
                 f"[RL2] model: {cfg.model.model_name}"]
        if cfg.compare.model_name:
            lines.append(f"[RL2] compare: {cfg.compare.model_name}")
        lines.append(f"[RL2] samples and metrics in {cfg.eval.save_dir}")
        return "\n".join(lines)


def engine_config(rollout_cfg: DictConfig) -> DictConfig:
    """The RL trainer's rollout config that `RolloutWorker` reads: the evaluator's engine and
    environment keys over training's defaults, and no weight sync (the weights never change)."""
    shared = {key: value for key, value in rollout_cfg.items() if key in RolloutConfig.__dataclass_fields__
              and key not in TRAINING_ONLY}
    return OmegaConf.merge(OmegaConf.structured(RolloutConfig), shared, {"weight_sync": "none"})
