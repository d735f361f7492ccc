"""A model trained with FSDP2: loading, sharding, mixed precision, optimizer, scheduler, clipping, and the
offload of its state while a colocated rollout engine samples (`RL2.rollout.worker`). LoRA: docs/lora.md."""

import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

import RL2.models.attention  # noqa: F401  (registers the varlen attention)
from RL2.batch import MicroBatch
from RL2.config.errors import ConfigError
from RL2.models import lora
from RL2.models.attention import ATTN_NAME, sliding_window_of, softcap_of, varlen_backend
from RL2.models.checkpointing import enable_activation_checkpointing
from RL2.models.default_model import resolve_model_path
from RL2.models.logps import ModelLayout
from RL2.models.precision import compute_dtype
from RL2.models.tensor_parallel import apply_tensor_parallel, check_tp_degree
from RL2.native import (
    PinnedHostCopies,
    SharedMemoryGather,
    check_fits_host,
    pinned_offload,
    share_fsdp_buffers,
    shared_weight_gather,
    state_to_host,
    tune_model,
)
from RL2.parallel import ParallelDims, shard_of
from RL2.utils.logging import log_rank0

# (micro-batch on the device) -> (its loss, already weighted for the global batch; metric partial sums)
LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


def load_tokenizer(model_cfg, section: str | None = None):
    """The tokenizer of a model section (its `tokenizer_name`, else its `model_name`); `section` names it in errors."""
    field = "tokenizer_name" if model_cfg.tokenizer_name else "model_name"
    name = model_cfg[field]
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    except OSError as e:
        raise model_not_found(f"{section}.{field}={name}" if section else name, name, e) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_not_found(what: str, name: str, error: OSError) -> ConfigError:
    """The error for a model name that loads nothing. transformers reads a folder that is not there as a
    malformed hub id ('Repo id must be in the form ...'), which sends the user the wrong way."""
    reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    if not Path(name).expanduser().exists():
        reason = f"no such folder, nor a model of that name in the local Hugging Face cache ({reason})"
    return ConfigError(f"{what}: cannot load it: {reason}; give a Hugging Face model folder (e.g. a run's "
                       f"<save_dir>/final/actor), the name of a model in the local cache, or smollm2-135m-instruct")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks, found by the class names HF lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules)")
    return layers


def lr_lambda(step: int, total_steps: int, warmup_ratio: float, name: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate: linear warmup, then constant or cosine down to a floor."""
    # Whole steps, rounded down as verl and RL2's original do; 100 * 0.29 is 28.999999999999996 in
    # floating point, so the product is first rounded to where such error lives.
    warmup = int(round(total_steps * warmup_ratio, 6))
    if step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class FSDPWorker(Stateful):
    """One sharded model of `model_cfg` (the config section `section` names in errors) with its optimizer and
    schedule over `total_steps`; `train=False`: a frozen model (reference, teacher), no optimizer. `model_name`
    loads other weights (a teacher's); `config_overrides` change the HF config (`num_labels=1`). `base_changes`:
    PPO's reference resets will merge LoRA's adapters into the base, then kept in float32 (docs/lora.md)."""

    def __init__(self, model_cfg, dims: ParallelDims, device: torch.device, total_steps: int = 0,
                 model_cls=AutoModelForCausalLM, train: bool = True, model_name: str | None = None,
                 base_changes: bool = False, section: str | None = None, **config_overrides):
        self.cfg, self.dims, self.device = model_cfg, dims, device
        self.key_prefix = f"{section}." if section else ""  # of this model's config keys, as the user writes them
        self.model_name = model_name or model_cfg.model_name
        self.dtype = compute_dtype(self.cfg.dtype, self.device)
        lora_cfg = getattr(model_cfg, "lora", None)
        self.lora = lora_cfg if train and lora_cfg is not None and lora_cfg.rank > 0 else None
        # Else checkpoints hold the base too, and no adapter of the loaded model expresses the trained one.
        self.base_is_loaded = not base_changes
        self.model = self._build_model(model_cls, train, **config_overrides)
        self.optimizer = self.scheduler = None
        if train:
            opt, sched = model_cfg.optimizer, model_cfg.scheduler
            # Fused: one pass per tensor instead of a dozen elementwise ops; not with the float16 scaler, whose
            # found-inf flag, a plain tensor, does not mix with the sharded (DTensor) parameters.
            trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters (and a head)
            self.optimizer = torch.optim.AdamW(trained, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                               weight_decay=opt.weight_decay, fused=self.dtype != torch.float16)
            min_ratio = sched.min_lr / opt.lr if opt.lr > 0 else 0.0
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_lambda(
                step, total_steps, sched.warmup_ratio, sched.name, min_ratio))
        # float16 underflows small gradients. The sharded scaler checks overflow over every rank; torch.amp's over
        # the mesh of the first gradient, which under LoRA with tp (lora_A replicated over tp) leaves out tp ranks.
        self.scaler = ShardedGradScaler(device.type) if train and self.dtype == torch.float16 else None
        self.updates = 0  # times the weights changed (optimizer steps, checkpoint loads): the policy's version
        self.offloaded = False
        # Page-locked offload buffers: made at the first offload on CUDA; on the CPU only a test's (`offload_into`).
        self.host_copies: PinnedHostCopies | None = None
        self._shared_gather: SharedMemoryGather | bool | None = None  # None: not tried yet; False: not here

    def _build_model(self, model_cls, train: bool, **config_overrides) -> torch.nn.Module:
        """Load on rank 0's CPU, build sharded on every rank (from the meta device), and fill the shards from
        rank 0 one full tensor at a time: a 70B model needs one CPU copy per node rather than one per rank."""
        path = resolve_model_path(self.model_name)
        # Trained weights are float32 masters (FSDP's mixed precision computes in cfg.dtype); frozen ones and a LoRA
        # base that no reset changes are stored in the compute dtype, what mixed precision computes with anyway.
        self.param_dtype = torch.float32 if train and (self.lora is None or not self.base_is_loaded) else self.dtype
        kwargs = dict(dtype=self.param_dtype, attn_implementation=ATTN_NAME)
        try:
            config = AutoConfig.from_pretrained(path)
        except OSError as e:
            raise model_not_found(self._config_name(), self.model_name, e) from None
        for key, value in config_overrides.items():  # set directly: from_pretrained drops unknown keys
            setattr(config, key, value)
        self._check_layout(config)
        with torch.device("meta"):
            model = model_cls.from_config(config, **kwargs)
        check_fits_host(model, self.device, self._config_name(), train and self.lora is None, self.param_dtype,
                        dist.get_world_size() // self.dims.ddp)
        loaded = None
        if dist.get_rank() == 0:
            # The checkpoint in CPU memory. What is random here (LoRA's adapters, a scalar head) is drawn on a fork
            # of the CPU generator: tensor-parallel ranks must draw the same dropout masks from one random stream.
            with torch.random.fork_rng(devices=[]):
                loaded = model_cls.from_pretrained(path, config=config, **kwargs)
                if self.lora is not None:
                    self._add_adapters(loaded)
        # Training never reuses a KV cache; the exported config gets the model's own setting back.
        self.exported_use_cache = getattr(model.config, "use_cache", True)
        model.config.use_cache = False
        # A trained, plain (not DTensor) tied embedding may take sparse gradients.
        tune_model(model, self.device, sparse_tied_embedding=train and self.lora is None and self.dims.tp == 1)
        model.parallel_layout = self._parallelize(model, train)
        # rank 0's weights into the shards, and its buffers, which the state dict leaves out (rotary frequencies).
        model.to_empty(device=self.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, loaded.state_dict() if loaded is not None else {}, options=options)
        rank0_buffers = dict(loaded.named_buffers()) if loaded is not None else {}
        del loaded
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in rank0_buffers:
                    buffer.copy_(rank0_buffers[name])
                dist.broadcast(buffer, src=0)
        model.train(train)
        if not train:
            model.requires_grad_(False)
        return model

    def _config_name(self) -> str:
        """How the config names this model: `actor.model_name=...`, or `the model <name>`."""
        if self.model_name == self.cfg.model_name:
            return f"{self.key_prefix}model_name={self.model_name}"
        return f"the model {self.model_name}"

    def _check_layout(self, config) -> None:
        degrees = {"tp_size": self.dims.tp, "cp_size": self.dims.cp, "ddp_size": self.dims.ddp}
        differ = {k: getattr(self.cfg, k) for k, v in degrees.items() if getattr(self.cfg, k) != v}
        if differ:
            raise ConfigError(f"every model of a run shares one parallel layout ({self.dims.describe()}), but this "
                              f"model's config sets {', '.join(f'{k}={v}' for k, v in differ.items())}; set the same "
                              "tp_size, cp_size and ddp_size in every model section (e.g. actor.* and critic.*)")
        if self.dims.tp > 1:
            check_tp_degree(config, self.dims.tp)
        if self.dims.cp > 1 and softcap_of(config):
            raise ConfigError(f"{self._config_name()} caps its attention scores "
                              f"(attn_logit_softcapping={softcap_of(config)}), which RL2's context-parallel attention "
                              "does not apply; set cp_size=1 in every model section")

    def _parallelize(self, model: torch.nn.Module, train: bool) -> ModelLayout:
        """TP, activation checkpointing, then FSDP2 per decoder layer and on the root (tied embeddings stay one)."""
        layers = decoder_layers(model)
        layout = ModelLayout()
        if self.dims.tp > 1:
            layout.vocab = apply_tensor_parallel(model, layers, self.dims.tp_mesh)
        if self.lora is not None:
            self._add_adapters(model)  # after tensor parallelism: the adapters are split like their layer
        if self.dims.cp > 1:
            layout.cp_group = self.dims.cp_mesh.get_group()
        # A shared prefix needs SDPA attention (the flash kernels keep the packed row), whole sequences (a
        # context-parallel split cuts them apart) and uncapped scores (only the whole-row kernels cap them).
        layout.share_prefixes = (getattr(self.cfg, "share_prefixes", False) and self.dims.cp == 1
                                 and not softcap_of(model.config) and varlen_backend(self.device, self.dtype) == "sdpa")
        layout.sliding_window = sliding_window_of(model.config)
        if train and self.cfg.enable_gradient_checkpointing:
            enable_activation_checkpointing(model, self.cfg.checkpoint_every_n_layers)
        policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        mesh = self.dims.fsdp_mesh
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        sum_gradients_over_ranks(model)
        share_fsdp_buffers(model, mesh, self.device)  # ranks on one CPU host trade shards through memory
        return layout

    def _add_adapters(self, model: torch.nn.Module) -> None:
        cfg = self.lora
        lora.add_adapters(model, decoder_layers(model), cfg.rank, cfg.alpha, cfg.dropout, list(cfg.target_modules))

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, through the gradient scaler when computing in float16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def run_micro_batches(self, micro_batches: list[MicroBatch], loss_fn: LossFn,
                          train: bool = True) -> dict[str, float]:
        """Forward (and if training, backward) this rank's micro-batches; metrics summed over all. Collective."""
        totals: dict[str, torch.Tensor] = {}
        for mb in micro_batches:
            mb = mb.to(self.device)
            with torch.set_grad_enabled(train):
                loss, metrics = loss_fn(mb)
            if train:
                self.backward(loss)
            # Summed on the device: reading each back would wait for the GPU once per metric and micro-batch.
            for key, value in metrics.items():
                value = torch.as_tensor(value).detach().to(self.device, torch.float64)
                totals[key] = totals[key] + value if key in totals else value
        summed = dict(zip(totals, torch.stack(list(totals.values())).tolist())) if totals else {}
        return self.dims.sum_over_data(summed, self.device)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step (skipped where the gradients are not finite), advance the schedule; returns grad_norm, lr."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        if self.scaler is not None:
            with warnings.catch_warnings():  # the sharded scaler's overflow flag is a [1] tensor, not a scalar
                warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
                self.scaler.unscale_(self.optimizer)  # clip the true gradients
        grad_norm = clip_grad_norm(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        if self.cfg.offload_optimizer and self.moves_state:
            self.move_state(self.device, params=False)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step when unscale_ found an inf or nan
            self.scaler.update()
        elif torch.isfinite(grad_norm):
            self.optimizer.step()
        else:  # in float16 a skipped step is routine (the scaler's search); elsewhere it is a fault to see
            log_rank0(f"skipped optimizer step {self.updates + 1}: the gradient norm is {grad_norm.item()}, "
                      f"not finite (a loss or an input gave inf or nan)")
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # A skipped step advances the schedule too; torch warns as of a mistake when the first is skipped.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        self.updates += 1
        if self.cfg.offload_optimizer and self.moves_state:
            self.offload_state(params=False)
        return {"grad_norm": grad_norm.item(), "lr": lr}

    # ---- colocation: the device's memory goes to the rollout engine while it samples ----

    def offload(self, keep_params: bool = False) -> None:
        """Move parameters, gradients and optimizer state to the CPU and free the GPU memory for a colocated
        engine. `keep_params`: move only the optimizer state (the parameters are about to be read by a sync)."""
        if not self.moves_state or self.offloaded:
            return
        self.offload_state(params=not keep_params)
        self.offloaded = not keep_params
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back what `offload` moved (but the optimizer state under `offload_optimizer`)."""
        if not self.moves_state:
            return
        self.move_state(self.device, optimizer=not self.cfg.offload_optimizer)
        self.offloaded = False

    @torch.no_grad()
    def offload_state(self, params: bool = True, optimizer: bool = True) -> None:
        """`move_state` to the host: from CUDA into page-locked buffers made at the first move, else pageable."""
        host = torch.device("cpu")
        if self.host_copies is None and pinned_offload(self.device, host):
            self.host_copies = PinnedHostCopies()
        if self.host_copies is None:
            self.move_state(host, params, optimizer)
        else:
            state_to_host(self.host_copies, self.model if params else None, self.optimizer if optimizer else None)

    @torch.no_grad()
    def move_state(self, device: torch.device, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters with their gradients and/or the optimizer state to `device` (keeping their identity)."""
        if params:
            self.model.to(device)
        if optimizer and self.optimizer is not None:  # the moments and step counts
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device)

    @property
    def moves_state(self) -> bool:
        """Whether offload and onload move anything: on CUDA, or on the CPU into `offload_into`'s buffers."""
        return self.device.type == "cuda" or self.host_copies is not None

    def offload_into(self, copies: PinnedHostCopies) -> None:
        """Offload into `copies` from now on (on the CPU: the CUDA path's moves, for a test)."""
        self.host_copies = copies

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state, by the device type holding them."""
        tensors = [*self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        totals = Counter()
        for local in map(shard_of, tensors):
            totals[local.device.type] += local.numel() * local.element_size()
        return dict(totals)

    @property
    def only_adapters_change(self) -> bool:
        """LoRA on a base that stays the loaded weights: checkpoints and exports need only the adapters."""
        return self.lora is not None and self.base_is_loaded

    # Stateful: what torch.distributed.checkpoint saves and restores (each rank its shards).
    def state_dict(self) -> dict:
        if self.optimizer is None:  # a frozen model that still changes (PPO's reference after a reset)
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.only_adapters_change:  # frozen weights load again; by name: ignore_frozen_params keeps tied ones
            trained = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trained}
        state = {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.updates += 1
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=not self.only_adapters_change))
        configured = list(self.scheduler.base_lrs)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scheduler.base_lrs != configured:  # as in HF's Trainer, the run goes on as it was saved
            log_rank0(f"resuming with the checkpoint's learning rates {self.scheduler.base_lrs}, not "
                      f"{configured} from {self.key_prefix}optimizer.lr "
                      f"(the checkpoint's optimizer and schedule go on as saved; start a new run to change them)")
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights (float32; a LoRA base in the compute dtype) on CPU, on rank 0 only (empty elsewhere)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def save_hf(self, path: str, tokenizer=None) -> None:
        """Write a folder `from_pretrained` loads: safetensors, config, tokenizer. Collective. With LoRA: the
        merged weights under the base model's names, and, while the base is the loaded model, `<path>/adapter`."""
        from RL2.utils.checkpoint import atomic_dir

        state, adapter = self.full_state_dict(), None
        if self.lora is not None and dist.get_rank() == 0:
            state, adapter = lora.split_for_export(state, self.lora.alpha / self.lora.rank)
        if getattr(self.model.config, "tie_word_embeddings", False):
            # Gathered shards no longer share storage; drop the tied copies so the folder has one.
            for tied_key in getattr(self.model, "_tied_weights_keys", None) or []:
                state.pop(tied_key, None)
        if dist.get_rank() == 0:
            with atomic_dir(path) as tmp:
                self.model.config.use_cache = self.exported_use_cache
                try:
                    self.model.save_pretrained(tmp, state_dict=state)
                finally:
                    self.model.config.use_cache = False
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if adapter is not None and self.base_is_loaded:
                    task = "TOKEN_CLS" if hasattr(self.model, "score") else "CAUSAL_LM"
                    lora.save_adapter(tmp / "adapter", adapter, self.lora.rank, self.lora.alpha, self.lora.dropout,
                                      task, resolve_model_path(self.model_name))
                elif adapter is not None:
                    log_rank0(f"{path}: reference resets merged the adapters into the base weights, so no "
                              f"adapter of {self.model_name} expresses the model: saved merged weights only")
        dist.barrier()

    def full_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """`full_tensors` of the model; between ranks on one CPU host through shared memory. Collective."""
        if self._shared_gather is None:  # not on GPUs, where a LoRA policy's shards wait on the CPU during a sync
            self._shared_gather = shared_weight_gather(self.model, dtype, self.device) or False
        return self._shared_gather.full_tensors() if self._shared_gather else full_tensors(self.model, dtype)

    def engine_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Full tensors as an inference engine takes them: with LoRA, merged under the base model's names."""
        if self.lora is None:
            return named_tensors
        return lora.merge_adapters(named_tensors, self.lora.alpha / self.lora.rank)


def full_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of an FSDP2 model, one at a time (no rank holds more than one beyond
    its shards), cast before the gather (a bf16 engine moves half the bytes of float32 weights). Collective."""
    for name, param in model.named_parameters():
        tensor = param.detach().to(dtype)
        if isinstance(tensor, DTensor) and tensor.device.type != tensor.device_mesh.device_type:
            # A shard waiting on the CPU (a LoRA policy's frozen base during a sync) is gathered on the mesh's device.
            tensor = DTensor.from_local(tensor.to_local().to(tensor.device_mesh.device_type), tensor.device_mesh,
                                        tensor.placements, shape=tensor.shape, stride=tensor.stride())
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sum_gradients_over_ranks(model: torch.nn.Module) -> None:
    """Make FSDP sum the ranks' gradients instead of averaging them: every loss is already weighted for the
    whole global batch (`RL2.algs.averaging`). Sums only: gloo has no pre-scaled reduction."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def scalar_head_worker(model_cfg, dims: ParallelDims, device: torch.device, total_steps: int = 0,
                       train: bool = True, model_name: str | None = None, section: str | None = None) -> FSDPWorker:
    """A causal LM with a scalar head on every token (the reward model and PPO's critic), without dropout
    before the head: rewards and values must be deterministic functions of the text."""
    return FSDPWorker(model_cfg, dims, device, total_steps, model_cls=AutoModelForTokenClassification,
                      train=train, model_name=model_name, section=section, num_labels=1, classifier_dropout=0.0)


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Clip gradients by their global L2 norm; returns it. Under tp, gradients on the (fsdp, tp) mesh and replicated
    ones on the fsdp mesh alone, which `clip_grad_norm_` cannot combine: each mesh's norm is completed first."""
    by_mesh: dict = {}  # torch's foreach kernels cannot mix DTensors of different meshes either
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
