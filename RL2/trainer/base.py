"""What every trainer shares: process group, parallel layout, seeding, metrics, checkpoints, the step loop."""

import os
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from RL2.config import ConfigError, parse_config
from RL2.datasets.loading import DataError
from RL2.datasets.splits import EpochSampler, load_splits
from RL2.native import prepare_process
from RL2.parallel import ParallelDims, close_process_groups, collective_timeout, init_distributed, pick_device
from RL2.rollout.env import EnvError
from RL2.utils.checkpoint import latest_checkpoint, load_checkpoint, resolve_checkpoint, save_checkpoint
from RL2.utils.logging import MetricsSink, is_rank0, log_rank0
from RL2.utils.plot import CurvePanel, plot_learning_curve
from RL2.utils.save_dir_lock import claim_save_dir
from RL2.utils.startup_gc import command_ends, imports_done


class Trainer:
    """Base class: subclasses load their data (`load_data`), build their workers and implement `train_step` and
    `evaluate`. `model_cfg`: the config section whose parallel layout the run uses."""

    # The metrics of `<save_dir>/learning_curve.png`, one panel each; subclasses choose their own.
    learning_curve: tuple[CurvePanel, ...] = (CurvePanel("loss", ("train/loss", "test/loss")),)

    def __init__(self, cfg, model_cfg):
        self.device = pick_device(cfg.trainer.device)
        # First: huge pages before torch's first CPU allocation, whatever allocates it, and malloc keeping
        # freed memory before any thread starts.
        prepare_process(self.device)
        self.cfg = cfg
        # Before any model is built: a resume with nothing (complete) to resume from fails in seconds.
        self.resume_from = None
        if cfg.trainer.load_ckpt_from:
            try:
                self.resume_from = resolve_checkpoint(cfg.trainer.load_ckpt_from, cfg.trainer.save_dir)
            except FileNotFoundError as e:
                raise ConfigError(f"trainer.load_ckpt_from={cfg.trainer.load_ckpt_from}: {e}; to start afresh, leave "
                                  f"trainer.load_ckpt_from unset") from None
        quiet_third_party_progress()
        init_distributed(self.device, collective_timeout(cfg))
        # Before anything is written there: a second run with this save_dir stops here, naming the first.
        self.release_save_dir = claim_save_dir(cfg.trainer.save_dir)
        earlier = latest_checkpoint(cfg.trainer.save_dir)
        if self.resume_from is None and earlier is not None:  # a fresh run where a resume is usually meant
            log_rank0(f"warning: trainer.save_dir={cfg.trainer.save_dir} holds the checkpoints of an earlier run (the "
                      f"latest is {earlier.name}) and this run starts afresh: its checkpoints replace those of the "
                      f"same steps, its metrics follow the earlier run's, and latest.txt will name its own. To go on "
                      f"with the earlier run set trainer.load_ckpt_from=latest; to keep both, give this run another "
                      f"trainer.save_dir (or trainer.experiment_name)")
        torch.manual_seed(cfg.trainer.seed)
        self.dims = ParallelDims.from_config(model_cfg, self.device)
        self.dims.build_mesh()
        self.sink = MetricsSink(cfg.trainer.save_dir, cfg.trainer.use_wandb, cfg.trainer.project,
                                cfg.trainer.experiment_name, cfg, use_tensorboard=cfg.trainer.use_tensorboard)
        log_rank0(f"{self.dims.describe()} on {self.device.type}")

    # --- to implement -------------------------------------------------------------------------
    def workers(self) -> dict:
        """Name -> Stateful worker: what checkpoints hold."""
        raise NotImplementedError

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (1-based `step`); returns metrics."""
        raise NotImplementedError

    def reclaim_devices(self) -> None:
        """Bring every model's state back to its device (from a colocated engine) before a checkpoint or export."""

    def evaluate(self) -> dict[str, float]:
        return {}

    def save_final(self) -> None:
        """Export every trained worker (not PPO's reference) as a Hugging Face folder `<save_dir>/final/<name>`."""
        for name, worker in self.workers().items():
            if name != "ref":
                worker.save_hf(f"{self.cfg.trainer.save_dir}/final/{name}", getattr(self, "tokenizer", None))

    def save_learning_curve(self) -> None:
        """Plot `learning_curve`'s metrics from metrics.jsonl into `<save_dir>/learning_curve.png` (rank 0)."""
        if is_rank0() and self.cfg.trainer.plot_learning_curve:
            name = type(self).__name__.removesuffix("Trainer")
            plot_learning_curve(self.cfg.trainer.save_dir, self.learning_curve,
                                title=f"{name}: {self.cfg.trainer.experiment_name}")

    def trainer_state(self) -> dict:
        """Extra state to carry across a resume (beyond the step and the workers)."""
        return {}

    def load_trainer_state(self, state: dict) -> None:
        pass

    # --- shared loop ---------------------------------------------------------------------------
    def load_data(self, make_row: Callable, blank_rows: dict | None = None, keep_row: bool = False) -> None:
        """The tokenized splits (`train_data`, `test_data`), the training order (`sampler`) and `n_steps`."""
        cfg = self.cfg
        self.train_data, self.test_data = load_splits(cfg.data, make_row, cfg.trainer.seed, blank_rows, keep_row)
        self.sampler = EpochSampler(len(self.train_data), cfg.data.train.batch_size, cfg.data.shuffle, cfg.trainer.seed)
        self.n_steps = cfg.trainer.total_steps or cfg.trainer.n_epochs * self.sampler.steps_per_epoch

    def train(self) -> None:
        self.run(self.n_steps)

    def resume(self, n_steps: int) -> int:
        """Restore the checkpoint named by trainer.load_ckpt_from; returns the step to continue after."""
        path = self.resume_from
        if path is None:
            return 0
        state = load_checkpoint(path, self.workers(), rng_group=self.dims.tp_mesh.get_group())
        if state["step"] > n_steps and not self.cfg.trainer.eval_only:
            raise ConfigError(f"trainer.load_ckpt_from: {path} is step {state['step']}, past this run's {n_steps} "
                              f"steps (another run's checkpoint in trainer.save_dir?); raise trainer.total_steps "
                              f"or name the checkpoint to resume from")
        self.load_trainer_state(state)
        if not self.cfg.trainer.eval_only:  # an evaluation adds to the history; a resume redoes its end
            self.truncate_outputs_after(state["step"])
        log_rank0(f"resumed from {path} at step {state['step']}")
        return state["step"]

    def truncate_outputs_after(self, step: int) -> None:
        """Drop what the steps after `step` wrote, which the resumed run writes again."""
        self.sink.truncate_after(step)

    def run(self, n_steps: int) -> None:
        """The loop: train, log, evaluate, save; then export the final models. Releases trainer.save_dir."""
        try:
            self._run(n_steps)
        finally:
            self.release_save_dir()

    def _run(self, n_steps: int) -> None:
        trainer = self.cfg.trainer
        start = self.resume(n_steps)
        if trainer.eval_only:
            metrics = self.evaluate()
            if not metrics:
                log_rank0("trainer.eval_only: nothing to evaluate; give a test split (data.test.path)")
            self.sink.log(metrics, start)
            log_rank0(f"evaluation at step {start}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
            self.sink.close()
            return
        if trainer.test_freq and start == 0:
            self.sink.log(self.evaluate(), 0)  # the "before" figure
        progress = tqdm(range(start + 1, n_steps + 1), initial=start, total=n_steps, disable=not is_rank0())
        for step in progress:
            began = time.perf_counter()
            metrics = self.train_step(step)
            metrics["perf/step_s"] = time.perf_counter() - began
            # The last step is evaluated too, before its checkpoint: a resume from it has nothing to redo.
            if trainer.test_freq and (step % trainer.test_freq == 0 or step == n_steps):
                metrics.update(self.evaluate())
            self.sink.log(metrics, step)
            progress.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in metrics.items() if k.endswith("loss")})
            if trainer.save_freq and step % trainer.save_freq == 0:
                self.reclaim_devices()
                save_checkpoint(trainer.save_dir, step, self.workers(), self.trainer_state(), trainer.keep_last_n)
                self.save_learning_curve()  # a long run shows its curve so far
        self.reclaim_devices()
        self.save_final()
        self.save_learning_curve()
        self.sink.close()


def quiet_third_party_progress() -> None:
    """Our own tqdm shows progress; silence the per-file bars of datasets and transformers. `datasets` reads its
    switch when imported, which only some data sources need; a program may have imported it already."""
    import transformers

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def launch(trainer_cls: Callable, schema: type, name: str, argv: list[str] | None = None) -> None:
    """Entry point of `python -m RL2.trainer.<name>`."""
    run_command(f"RL2 {name}", schema, name, lambda cfg: trainer_cls(cfg).train(), argv)


def run_command(label: str, schema: type, section: str, run: Callable, argv: list[str] | None = None) -> None:
    """An RL2 command's life (a trainer's, the evaluator's): `run` of the config parsed from `argv`; bad config, data
    or scripts end with a message after `label`, no traceback; the process groups closed at the end."""
    imports_done()
    finished = False
    try:
        run(parse_config(schema, section, argv))
        finished = True
    except (ConfigError, DataError, EnvError) as e:
        sys.exit(f"{label}: {e}")
    finally:
        close_process_groups(finished)
        command_ends()
