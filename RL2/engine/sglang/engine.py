"""SGLang servers as the rollout engine of every rank, launched (`SGLangEngine.launch`) or already running
(`SGLangEngine.connect`: rank 0 alone controls them); docs/gpus.md, "SGLang servers". Every control step ends with all
ranks agreeing that it worked: one rank's failure raises an `EngineError` on every rank, not a hang in a collective."""

import asyncio
import atexit
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from RL2.config.errors import ConfigError
from RL2.config.ppo_schema import COLOCATED_MARGIN_GB
from RL2.config.server_args import check_server_args
from RL2.config.validation import ORIGINAL_LOGPROB_ENV, server_urls
from RL2.engine.checkpoint_layout import CheckpointLayout, checkpoint_tensor_names
from RL2.engine.memory_plan import COLOCATED_MEM_FRACTION, GIB, ModelShape, colocated_mem_fraction
from RL2.engine.protocol import EngineError
from RL2.engine.sglang.http_client import HTTPEngineClient, control_request
from RL2.engine.sglang.server import SGLangServer, resolve_python
from RL2.engine.sglang.weight_transfer import (
    FLATTENED_BUCKET_VERSIONS,
    buckets,
    flatten_bucket,
    serialize_flat_bucket,
    write_hf_folder,
)
from RL2.parallel import all_gather_objects
from RL2.utils.logging import log_rank0

# KV cache tokens of a CPU server unless server_args say otherwise: SGLang's default reserves ~9 GB.
CPU_MAX_TOTAL_TOKENS = 16384
# SGLang's endpoint that randomizes a server's weights and reports their checksums (sglang/srt/utils/weight_checker.py).
WEIGHTS_CHECKER = "/weights_checker"
# The least KV cache (bytes per GPU) a launched server may be left with before the run stops at start.
MIN_KV_CACHE_BYTES = GIB


def resolve_engine(cfg, device: torch.device) -> str:
    """`rollout.engine` made concrete: "embedded" or "sglang" (auto: as the key's help text says)."""
    if server_urls(cfg.server_url):
        return "sglang"
    if cfg.engine != "auto":
        return cfg.engine
    return "sglang" if device.type == "cuda" and python_has_sglang(cfg.server_python) else "embedded"


def python_has_sglang(python: str | None) -> bool:
    """Whether `rollout.server_python` (None: this Python) can import sglang."""
    if not python:
        return importlib.util.find_spec("sglang") is not None
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        return subprocess.run([resolve_python(python), "-c", check], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"config key 'rollout.server_python' ({python}) cannot be run: {e}") from None


class SGLangEngine:
    """The rollout engine of one rank on SGLang servers; build it with `launch` or `connect` (collective). Generation
    goes to all of `urls`, control requests to `controlled`. This rank writes disk updates (with `model_path`'s config
    files) under `weights_dir` (None: it does not write), and the server of `controlled[i]` reads them from
    `weights_dirs[i]`. `tp_group` holds the ranks of this rank's server."""

    def __init__(self, urls: list[str], controlled: list[str], weight_sync: str, bucket_bytes: int, model_path: str,
                 weights_dir: Path | None = None, weights_dirs: list[Path] | None = None,
                 server: SGLangServer | None = None, colocated: bool = False, tp_group=None,
                 request_timeout: float = 3600.0, check_weights: bool = True, api_key: str | None = None):
        self.urls, self.controlled, self.weight_sync = urls, controlled, weight_sync
        self.bucket_bytes, self.model_path = bucket_bytes, model_path
        self.weights_dir, self.weights_dirs = weights_dir, weights_dirs or []
        self.server, self.tp_group = server, tp_group
        self.releases_memory, self.follows_policy = colocated, weight_sync != "none"
        self.check_weights, self.api_key = check_weights, api_key
        self.client = HTTPEngineClient(urls, timeout=request_timeout, api_key=api_key,
                                       vocab_size=model_vocab_size(model_path))
        self._resumed: asyncio.Event | None = None  # while paused: set by continue_generation
        self._folder: Path | None = None  # the newest weights folder written by this rank
        self._layout: CheckpointLayout | None = None  # built at the first push
        self._unchecked: set[str] = set()  # controlled servers without /weights_checker (warned once)
        atexit.register(self.shutdown)

    # ---- construction (collective) ----

    @classmethod
    def launch(cls, cfg, model_path: str, dtype: torch.dtype, device: torch.device, seed: int) -> "SGLangEngine":
        """Start one server per group of `tp_size` ranks, on their kind of device, and connect every rank to all of
        them. On GPU, call it when the trainer's state is off the GPU: a server sizes its KV cache by what is free."""
        args = check_server_args(cfg.server_args)
        _check_memory_saver(args, device)
        rank, world = dist.get_rank(), dist.get_world_size()
        tp = int(args.get("tp_size", 1))
        if tp < 1 or world % tp:
            raise ConfigError(f"rollout.server_args.tp_size={tp} must divide the number of ranks ({world}): "
                              f"each server runs on tp_size ranks' devices")
        places = all_gather_objects((socket.gethostname(), _physical_gpu(device)))
        leader = rank - rank % tp
        if any(len({host for host, _ in places[start:start + tp]}) > 1 for start in range(0, world, tp)):
            raise ConfigError(f"rollout.server_args.tp_size={tp} spans hosts; a server's ranks must share one host")
        one_host = len({host for host, _ in places}) == 1
        args = _server_defaults(device, dtype, seed + rank // tp, tp, one_host) | args
        if device.type == "cuda" and "mem_fraction_static" not in args:
            args["mem_fraction_static"] = _colocated_fraction(cfg, device, tp)
        # One key for all servers, since every rank sends requests to every one: rank 0's random one if unset.
        api_key = getattr(cfg, "api_key", None) or all_gather_objects(secrets.token_urlsafe(24))[0]
        args["api_key"] = api_key
        server, url, version, error = None, None, None, None
        if rank == leader:
            env = dict(cfg.server_env or {}) | {ORIGINAL_LOGPROB_ENV: "0"}  # whatever the trainer's environment says
            if device.type == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for _, gpu in places[leader:leader + tp])
            server = SGLangServer(cfg.server_python or sys.executable, model_path, args, env, cfg.server_log_dir)
            try:
                if device.type == "cuda":
                    _check_kv_cache_room(model_path, dtype, device, tp, float(args["mem_fraction_static"]))
                server.start().wait_ready(cfg.server_timeout)
                url = server.url
                version = server_version(url, api_key)
            except Exception as e:  # this rank's alone: every rank must reach the gather below to raise it
                error = f"rank {rank}: {e}" if isinstance(e, (EngineError, ConfigError)) else (
                    f"rank {rank}: {type(e).__name__}: {e}")
        gathered = all_gather_objects((url, version, error))
        _raise_any([err for _, _, err in gathered], cleanup=server)
        urls = [u for u, _, _ in gathered if u is not None]
        weight_sync = _launched_weight_sync(cfg.weight_sync, device, {v for _, v, _ in gathered if v is not None})
        tp_group = _tp_groups(world, tp) if weight_sync == "tensor" else None
        writes, dirs = _disk_roles(cfg, weight_sync, [host for host, _ in places], leader_ranks=range(0, world, tp))
        engine = cls(urls, [url] if url else [], weight_sync, int(cfg.weight_bucket_mb * 2**20), model_path, writes,
                     dirs, server, colocated=device.type == "cuda" and bool(args.get("enable_memory_saver")),
                     tp_group=tp_group, request_timeout=cfg.request_timeout,
                     check_weights=getattr(cfg, "check_weight_sync", True), api_key=api_key)
        log_rank0(f"rollout: {len(urls)} SGLang server(s) at {', '.join(urls)}; weight sync: {weight_sync}"
                  + (f"; logs in {server.log_path.parent}" if server else ""))
        return engine

    @classmethod
    def connect(cls, cfg, model_path: str) -> "SGLangEngine":
        """Use the servers of `rollout.server_url`; rank 0 checks they answer and controls them."""
        urls, api_key = server_urls(cfg.server_url), getattr(cfg, "api_key", None)
        weight_sync = cfg.weight_sync if cfg.weight_sync != "auto" else "disk"  # the config refuses tensor here
        error = None
        if dist.get_rank() == 0:
            for url in urls:
                try:
                    control_request(url, "/health", timeout=30.0, api_key=api_key)
                    _warn_if_logprobs_unscaled(url, cfg, api_key)
                except EngineError as e:
                    error = f"rollout.server_url: {e}"
        _raise_any(all_gather_objects(error))
        writes = _new_weights_dir(cfg) if dist.get_rank() == 0 and weight_sync == "disk" else None
        controlled = urls if dist.get_rank() == 0 else []
        return cls(urls, controlled, weight_sync, int(cfg.weight_bucket_mb * 2**20), model_path, writes,
                   [writes] * len(controlled), request_timeout=cfg.request_timeout,
                   check_weights=getattr(cfg, "check_weight_sync", True), api_key=api_key)

    # ---- generation ----

    async def generate(self, payload: dict) -> dict:
        if self._resumed is not None:
            await self._resumed.wait()
        return await self.client.generate(payload)

    async def pause_generation(self, mode: str = "abort") -> None:
        """See `Engine.pause_generation` (the servers are not paused: they serve every rank)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        if self._resumed is None:  # pausing again keeps the requests already waiting
            self._resumed = asyncio.Event()
        if mode == "abort":
            await self.client.abort_own()

    async def continue_generation(self) -> None:
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    # ---- control (collective: every rank calls these together) ----

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> None:
        """See `Engine.update_weights`: pushed in the layout of the model's checkpoint, then checked."""
        if self.weight_sync == "none":
            return
        named_tensors = self.checkpoint_layout().to_checkpoint(named_tensors)
        before = self._weight_checksums(randomize=True) if self.check_weights else None
        if self.weight_sync == "tensor":
            self._push_tensors(named_tensors, weight_version)
        else:
            self._push_folder(named_tensors, weight_version)
        if before is not None:
            self._check_written(before, self._weight_checksums(randomize=False), weight_version)

    def checkpoint_layout(self) -> CheckpointLayout:
        """How the trainer's parameters map to the checkpoint's names, built at the first push; a name the
        served checkpoint does not have is logged, as SGLang's loader would skip it."""
        if self._layout is None:
            self._layout = CheckpointLayout.from_folder(self.model_path)
            on_disk = checkpoint_tensor_names(self.model_path)
            unknown = sorted(self._layout.checkpoint_names() - on_disk) if on_disk is not None else []
            if unknown:
                log_rank0(f"WARNING: {len(unknown)} weights pushed to the SGLang servers have names that "
                          f"{self.model_path} does not have, which SGLang's loader may skip: {_listed(unknown)}")
        return self._layout

    def release_memory(self, tags: Iterable[str]) -> None:
        self._control_all("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory(self, tags: Iterable[str]) -> None:
        self._control_all("/resume_memory_occupation", {"tags": list(tags)})

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    def _push_folder(self, named_tensors, version: str) -> None:
        error = None
        folder = self.weights_dir / version if self.weights_dir is not None else None
        named_tensors = iter(named_tensors)
        try:
            if folder is not None:
                write_hf_folder(buckets(named_tensors, self.bucket_bytes), folder, self.model_path)
        except Exception as e:  # an OSError, or safetensors' own error for a full disk: this rank's alone
            error = f"rank {dist.get_rank()} could not write the weights to {folder}: {e}"
        # Every rank takes every full tensor, the writer too after a failed write: they come from
        # all-gathers that involve every rank, which must stay in step to reach the error's gather.
        try:
            for _ in named_tensors:
                pass
        except ValueError as e:  # the checkpoint layout's, at the end of the stream: every rank's alike
            error = error or f"rank {dist.get_rank()}: {e}"
        _raise_any(all_gather_objects(error))
        self._control_all("/update_weights_from_disk", lambda i: {
            "model_path": str(self.weights_dirs[i] / version), "flush_cache": True, "weight_version": version})
        if folder is not None:
            if self._folder is not None and self._folder != folder:
                shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = folder

    def _push_tensors(self, named_tensors, version: str) -> None:
        """Bucket by bucket through `/update_weights_from_tensor`, inside one weight-update session."""
        self._control_all("/begin_weight_update", {})
        for bucket in buckets(named_tensors, self.bucket_bytes):
            flat, metadata = flatten_bucket(bucket)
            # The flat copy is what the server reads: the gathered full tensors can go. `buckets` still holds
            # this list until it builds the next one, so `del bucket` would free nothing; emptying it does.
            bucket.clear()
            payload = serialize_flat_bucket(flat, metadata)
            per_rank = [payload]
            if self.tp_group is not None:  # server rank i maps the copy of tensor-parallel rank i (its own GPU)
                per_rank = all_gather_objects(payload, self.tp_group)
            self._control_all("/update_weights_from_tensor", {
                "serialized_named_tensors": per_rank, "load_format": "flattened_bucket",
                "flush_cache": False, "weight_version": version})
            del flat  # only now that every server has answered: a CUDA payload held a handle to this memory
        self._control_all("/end_weight_update", {})
        self._control_all("/flush_cache", None)

    def _weight_checksums(self, randomize: bool) -> list[dict | None]:
        """Each controlled server's checksums of its target model's parameters (not a draft model's: RL2 pushes none;
        None without `/weights_checker`), after overwriting them with random values if `randomize`: a push must then
        write every one of them for its checksum to change, even where the new value equals the old (a LoRA base)."""
        if randomize:
            self._control_all(WEIGHTS_CHECKER, {"action": "reset_tensors", "selector": "target"}, absent_ok=True)
        bodies = self._control_all(WEIGHTS_CHECKER, {"action": "checksum", "selector": "target"}, absent_ok=True)
        for url, body in zip(self.controlled, bodies):
            if body is None and url not in self._unchecked:
                self._unchecked.add(url)
                log_rank0(f"WARNING: {url} has no {WEIGHTS_CHECKER} (SGLang 0.5.23 has it): whether a weight push "
                          f"reaches every parameter of that server is not checked")
        return bodies

    def _check_written(self, before: list[dict | None], after: list[dict | None], version: str) -> None:
        """EngineError on every rank when a controlled server has a parameter the push did not write."""
        error = None
        for url, old, new in zip(self.controlled, before, after):
            unwritten = unwritten_weights(old, new) if old is not None and new is not None else []
            if unwritten:
                error = (f"rank {dist.get_rank()}: the weight push {version!r} did not write {len(unwritten)} "
                         f"parameters of the SGLang server at {url}, which now hold random values: "
                         f"{_listed(unwritten)}. Its loader skips names it does not know; RL2 sends the names of "
                         f"{self.model_path}'s checkpoint (RL2.engine.checkpoint_layout). If the server derives "
                         f"these tensors itself instead of loading them, set rollout.check_weight_sync=false.")
                break
        _raise_any(all_gather_objects(error))

    def _control_all(self, endpoint: str, payload, absent_ok: bool = False) -> list[dict | None]:
        """POST to every server this rank controls, then agree with all ranks that it worked. Returns each
        one's answer; with `absent_ok`, None for a server that does not have `endpoint`."""
        error, answers = None, []
        for i, url in enumerate(self.controlled):
            body = payload(i) if callable(payload) else payload
            try:
                answers.append(control_request(url, endpoint, body, absent_ok=absent_ok, api_key=self.api_key))
            except EngineError as e:
                error = f"rank {dist.get_rank()}: {e}" + (f"\n{self.server.describe()}" if self.server else "")
                break
        _raise_any(all_gather_objects(error))
        return answers


def unwritten_weights(before: dict, after: dict) -> list[str]:
    """The parameters whose checksum a weight push left unchanged, from two answers of `/weights_checker` (before
    the push, the weights randomized; after it). Each lists every GPU of the server under `ranks`, whose
    `parallelism_info` has one entry per model role, the target model's first."""
    old_ranks = {_rank_info(rank)[0]: rank["checksums"] for rank in before.get("ranks") or []}
    unwritten = set()
    for rank in after.get("ranks") or []:
        key, info = _rank_info(rank)
        for name, checksum in rank["checksums"].items():
            if old_ranks.get(key, {}).get(name) == checksum:
                unwritten.add(name if info.get("tp_size", 1) == 1 else f"{name} (tp rank {info['tp_rank']})")
    return sorted(unwritten)


def _rank_info(rank: dict) -> tuple[tuple, dict]:
    """(what names one GPU of the server in either answer, its target model's parallelism info)."""
    info = rank["parallelism_info"]
    info = info[0] if isinstance(info, list) else info
    return tuple(info.get(key) for key in ("rank", "tp_rank", "dp_rank", "pp_rank")), info


def _listed(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def server_version(url: str, api_key: str | None = None) -> str | None:
    """The SGLang version a server reports (`/server_info`, `/get_server_info` before it), or None."""
    for endpoint in ("/server_info", "/get_server_info"):
        try:
            version = control_request(url, endpoint, timeout=30.0, api_key=api_key).get("version")
        except EngineError:
            continue
        if version:
            return str(version)
    return None


def model_vocab_size(model_path: str) -> int | None:
    """The vocabulary size in a model folder's config.json (its text model's, for a multimodal one), or None."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def _launched_weight_sync(requested: str, device: torch.device, versions: set[str]) -> str:
    """`rollout.weight_sync` for launched servers: tensor needs a server version whose payload format
    `RL2.engine.sglang.weight_transfer` writes; auto is tensor on GPU when the servers have one, else disk."""
    unsupported = sorted(v for v in versions if v not in FLATTENED_BUCKET_VERSIONS) or ([] if versions else ["unknown"])
    if requested == "tensor" and unsupported:
        raise ConfigError(
            f"rollout.weight_sync=tensor: the SGLang servers run version {', '.join(unsupported)}, but RL2 writes the "
            f"tensor-bucket format of sglang {', '.join(FLATTENED_BUCKET_VERSIONS)}; install one of those in the "
            f"servers' environment (rollout.server_python) or use rollout.weight_sync=disk")
    if requested != "auto":
        return requested
    if device.type == "cuda" and not unsupported:
        return "tensor"
    if device.type == "cuda":
        log_rank0(f"rollout.weight_sync=auto: RL2 writes the tensor-bucket format of sglang "
                  f"{', '.join(FLATTENED_BUCKET_VERSIONS)}, the servers run {', '.join(unsupported)}: "
                  f"syncing weights through disk")
    return "disk"


def _server_defaults(device: torch.device, dtype: torch.dtype, seed: int, tp: int, one_host: bool) -> dict:
    """What RL2 passes to every launched server unless `rollout.server_args` says otherwise."""
    defaults = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "tp_size": tp, "random_seed": seed,
                # Ranks on other hosts must reach the server; on one host it stays private.
                "host": "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname()),
                # An idle scheduler otherwise polls at full speed, taking a core from training.
                "sleep_on_idle": True}
    if device.type == "cuda":
        defaults["enable_memory_saver"] = True  # and `_colocated_fraction`'s mem_fraction_static
    else:
        defaults["max_total_tokens"] = CPU_MAX_TOTAL_TOKENS
    return defaults


def _colocated_fraction(cfg, device: torch.device, tp: int) -> float:
    """`mem_fraction_static` of this rank's server, from the least memory free on its GPUs. Collective."""
    margin = float(getattr(cfg, "gpu_memory_margin_gb", COLOCATED_MARGIN_GB)) * GIB
    free = all_gather_objects(torch.cuda.mem_get_info(device)[0])
    fractions = [colocated_mem_fraction(min(free[start:start + tp]), margin) for start in range(0, len(free), tp)]
    if min(fractions) <= 0:  # the same on every rank: all raise
        raise ConfigError(f"rollout.gpu_memory_margin_gb={margin / GIB:g} leaves the SGLang servers nothing: a GPU has "
                          f"{min(free) / GIB:.1f} GiB free, of which they would take {COLOCATED_MEM_FRACTION} less the "
                          f"margin; lower the margin or free the GPU")
    return int(fractions[dist.get_rank() // tp] * 1000) / 1000


def _check_memory_saver(server_args: dict, device: torch.device) -> None:
    """Refuse a GPU server that would keep RL2's share of the GPU (sized for a server that releases it)
    while the trainer trains beside it, unless the user sized that share (`mem_fraction_static`)."""
    if device.type != "cuda" or server_args.get("enable_memory_saver", True) or "mem_fraction_static" in server_args:
        return
    raise ConfigError(
        f"rollout.server_args.enable_memory_saver=false: the SGLang server would keep mem_fraction_static="
        f"{COLOCATED_MEM_FRACTION} of the free GPU memory while the trainer's models come back to the same GPU to "
        f"train. Drop enable_memory_saver=false (the server then releases its memory while the trainer trains), "
        f"or also set rollout.server_args.mem_fraction_static to the share of the free memory the server may keep "
        f"for good (training needs the rest; see the memory plan in docs/gpus.md)")


def _check_kv_cache_room(model_path: str, dtype: torch.dtype, device: torch.device, tp: int, fraction: float) -> None:
    """Fail at start, with the figures, when a server's share of this GPU (SGLang gives weights plus KV cache
    `mem_fraction_static` of the memory free at its start) cannot hold its weights and a KV cache."""
    try:
        model = ModelShape.from_config(AutoConfig.from_pretrained(model_path))
    except (ValueError, AttributeError):  # a model class transformers does not know, or a config that
        return  # nests its sizes (Gemma 3's text_config): SGLang alone sizes it
    free, total = torch.cuda.mem_get_info(device)
    weights = model.n_params * dtype.itemsize // tp
    kv_cache = int(fraction * free) - weights
    if kv_cache < MIN_KV_CACHE_BYTES:
        raise ConfigError(
            f"the SGLang server on {device} would get {fraction:.2f} x {free / GIB:.1f} GiB free "
            f"(of {total / GIB:.1f} GiB) for its weights ({weights / GIB:.1f} GiB per GPU at tp_size={tp}) and KV "
            f"cache, leaving {kv_cache / GIB:.1f} GiB for the KV cache; raise rollout.server_args.tp_size or "
            f"rollout.server_args.mem_fraction_static, or free the GPU (see the memory plan in docs/gpus.md)")


def returns_original_logprobs(url: str, temperature: float, api_key: str | None = None) -> bool | None:
    """Whether a server's log-probabilities at `temperature` are of the untempered distribution (True), of the
    tempered one (False), or cannot be told apart (None): from the gap between the two likeliest tokens of one-token
    requests at temperature 1 and at `temperature`, which tempered log-probabilities stretch by 1 / temperature."""
    gaps = []
    for t in (1.0, temperature):
        body = control_request(url, "/generate", {
            "input_ids": list(range(1, 17)), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 1, "temperature": t}}, timeout=60.0, api_key=api_key)
        first, second = body["meta_info"]["output_top_logprobs"][0][:2]
        gaps.append(first[0] - second[0])
    if gaps[0] < 1e-4:
        return None
    ratio = gaps[1] / gaps[0]
    return abs(ratio - 1) < abs(ratio - 1 / temperature)


def _warn_if_logprobs_unscaled(url: str, cfg, api_key: str | None) -> None:
    temperature = float(getattr(getattr(cfg, "train_sampling_params", None), "temperature", 1.0))
    if temperature == 1.0:
        return
    original = returns_original_logprobs(url, temperature, api_key)
    if original is True:
        log_rank0(f"WARNING: {url} returns log-probabilities at temperature 1, the trainer those of the policy it "
                  f"trains, the distribution at temperature {temperature} that the rollouts sample from: "
                  f"actor/engine_mismatch and actor.tis_coef are biased. Restart the server without "
                  f"{ORIGINAL_LOGPROB_ENV}=1 in its environment.")
    elif original is None:
        log_rank0(f"WARNING: could not tell whether {url} returns log-probabilities at the sampling temperature; if it "
                  f"runs with {ORIGINAL_LOGPROB_ENV}=1, actor/engine_mismatch and actor.tis_coef are biased at "
                  f"temperature {temperature}")


def _disk_roles(cfg, weight_sync: str, hosts: list[str], leader_ranks) -> tuple[Path | None, list[Path]]:
    """(folder this rank writes or None, folder each of its servers reads): the lowest rank of each
    host writes, and every server reads its own host's copy."""
    if weight_sync != "disk":
        return None, []
    rank = dist.get_rank()
    writer = hosts.index(hosts[rank])
    mine = _new_weights_dir(cfg) if rank == writer else None
    dirs = all_gather_objects(mine)
    return mine, [dirs[writer]] if rank in leader_ranks else []


def _new_weights_dir(cfg) -> Path:
    root = cfg.weights_dir or tempfile.gettempdir()
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="rl2-weights-", dir=root))


def _tp_groups(world: int, tp: int):
    """This rank's group among consecutive blocks of `tp` ranks (every rank creates every group)."""
    groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
    return groups[dist.get_rank() // tp]


def _physical_gpu(device: torch.device) -> str:
    """The GPU's id as the whole machine numbers it (what a server's CUDA_VISIBLE_DEVICES needs)."""
    if device.type != "cuda":
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index or 0
    return visible.split(",")[index].strip() if visible else str(index)


def _raise_any(errors: list, cleanup: SGLangServer | None = None) -> None:
    errors = [e for e in errors if e]
    if errors:
        if cleanup is not None:
            cleanup.shutdown()
        raise EngineError("\n".join(errors))
