"""An in-process inference engine speaking SGLang's `/generate` (`RL2.engine.protocol`) as an async API (docs/cpu.md).
One scheduler task per event loop admits waiting requests (one batched prefill), then decodes all running ones a token
per step; requests join and leave between steps. Request state is touched by one step or by the loop between steps,
never both, whether the forwards run on the loop or in a one-thread executor (`threads_fit_in_cores`)."""

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from RL2.engine.embedded.model_runner import ModelRunner
from RL2.engine.embedded.sampling import (
    SamplingParams,
    finish_reason,
    output_text,
    sample_next_tokens,
    stop_tokens_to_ban,
)
from RL2.models.attention import sliding_window_of
from RL2.native.allocator import keep_freed_memory

# Padded prompt tokens in one prefill forward: bounds its latency and its attention mask.
MAX_PREFILL_TOKENS = 8192
# With `arrival_quiet`, how often and at most how long a batch's first step looks for more requests (seconds).
ARRIVAL_POLL, MAX_ARRIVAL_WAIT = 0.001, 1.0


@dataclass(eq=False)
class _Request:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: asyncio.Future
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: dict | None = None
    row: int = -1  # KV cache row while running

    @property
    def cached_len(self) -> int:  # the newest sampled token is not in the cache yet
        return len(self.input_ids) + len(self.output_ids) - 1

    @property
    def reserved_tokens(self) -> int:
        return len(self.input_ids) + self.params.max_new_tokens


class EmbeddedEngine:
    """In-process continuous-batching engine over an HF causal LM in eval mode, without sliding windows. The running
    requests' prompt + max_new_tokens must fit in `max_total_tokens` if set; the rest wait. With `owns_model` it may
    keep linear layers' weights only packed for its CPU kernels (`runner.state_dict()` reads them)."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_running_requests: int = 64,
                 max_total_tokens: int | None = None, owns_model: bool = False):
        # Rows of the input embedding: the valid token ids. Read now, as released weights are empty.
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        # Positions the model was trained for: SGLang refuses a request that could run past them.
        self.context_len = getattr(model.config, "max_position_embeddings", None)
        # The engine's attention has no window: past a sliding-window model's, it would not sample the model.
        window = sliding_window_of(model.config)
        if window is not None:
            self.context_len = min(self.context_len or window, window)
        self.runner = ModelRunner(model, max_running_requests, owns_model=owns_model)
        if self.runner.device.type == "cpu":
            keep_freed_memory()  # each step allocates logits and sampling rows of the same sizes
        # On CPU the engine's memory is RAM the trainer's update needs; on a GPU releasing would also move the trainer's
        # state to the CPU around every rollout, which pays only for SGLang.
        self.releases_memory = self.runner.device.type == "cpu"
        self.tokenizer, self.max_total_tokens = tokenizer, max_total_tokens
        self.max_running_requests = max_running_requests
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # an int or a list
        self.eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.weight_version = "default"
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # running[i] owns cache row i
        self._paused = False
        self._error: RuntimeError | None = None
        self._executor = None if threads_fit_in_cores() else ThreadPoolExecutor(1, thread_name_prefix="rl2-engine")
        self._step_lock = threading.Lock()  # update_weights must not run during a step
        self._inflight: Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        # Seconds without a new request a batch's first step waits for (`_gather_arrivals`); 0: the first step waits
        # one turn of the loop only, and batches depend on no clock (the agent endpoint sets it for HTTP callers).
        self.arrival_quiet = 0.0

    follows_policy = True

    def release_memory(self, tags: Iterable[str]) -> None:
        """See `Engine.release_memory`: "weights", and "kv_cache" unless a request runs."""
        tags = set(tags)
        with self._step_lock:
            if "weights" in tags:
                self.runner.release_weights()
            if "kv_cache" in tags and not self._running:
                self.runner.cache.clear()

    def resume_memory(self, tags: Iterable[str]) -> None:
        """Nothing to do: released weights come back with `update_weights`, the cache as requests run."""

    @property
    def running_lengths(self) -> list[int]:
        """Tokens generated so far by each running request (for monitoring)."""
        return [len(request.output_ids) for request in self._running]

    @property
    def steps_on_loop(self) -> bool:
        """Whether the forwards run on the event loop (else in the engine's worker thread)."""
        return self._executor is None

    async def generate(self, payload: dict) -> dict:
        """See `Engine.generate`; `meta_info` has "finish_reason", "prompt_tokens", "completion_tokens",
        "cached_tokens", "weight_version" and, if asked, "output_token_logprobs"."""
        if self._error is not None:
            raise self._error
        if self.runner.unwritten:
            missing = self.runner.missing_weights
            raise RuntimeError(f"the engine's weights were released and {len(missing)} were not loaded again "
                               f"(e.g. {missing[0]}): push them all with update_weights before generating")
        request = self._new_request(payload)
        if request.params.max_new_tokens == 0:
            self._resolve(request, {"type": "length", "length": 0})
            return request.future.result()
        self._ensure_scheduler()
        self._waiting.append(request)
        self._wakeup.set()
        return await request.future

    async def pause_generation(self, mode: str = "abort") -> None:
        """See `Engine.pause_generation`; "retract" frees the requests' cache rows and prefills them again
        (prompt + output so far) after `continue_generation`."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        self._paused = True
        await self._wait_for_step()
        if mode == "abort":
            for request in [*self._running, *self._waiting]:
                self._resolve(request, {"type": "abort", "message": "aborted by pause_generation"})
            self._running, self._waiting = [], deque()
        elif mode == "retract":
            self._waiting.extendleft(reversed(self._running))
            self._running = []

    async def continue_generation(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None):
        """See `Engine.update_weights`: copied in place, names as in `model.state_dict()`; without a
        `weight_version` the engine keeps its current one."""
        with self._step_lock:
            self.runner.load_weights(named_tensors)
        if weight_version is not None:
            self.weight_version = weight_version

    def shutdown(self) -> None:
        """Fail whatever is still queued and stop the worker thread."""
        self._fail(RuntimeError("EmbeddedEngine was shut down"))
        if self._scheduler is not None and not self._scheduler.get_loop().is_closed():
            self._scheduler.cancel()
        if not self.steps_on_loop:
            self._executor.shutdown(wait=True)
        self.runner.cache.clear()

    # ---- scheduling (event loop thread) ----

    def _new_request(self, payload: dict) -> _Request:
        if "input_ids" not in payload:
            raise ValueError("the embedded engine needs token ids: pass payload['input_ids']")
        params = SamplingParams.from_dict(payload.get("sampling_params"), self.tokenizer)
        generator = None if params.sampling_seed is None else torch.Generator().manual_seed(params.sampling_seed)
        request = _Request(list(payload["input_ids"]), params, bool(payload.get("return_logprob", False)),
                           asyncio.get_running_loop().create_future(), generator)
        if not request.input_ids:
            raise ValueError("input_ids is empty")
        # Checked here, where only this request fails: inside a step it would fail the batch and the engine with it.
        for token in (min(request.input_ids), max(request.input_ids)):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"input_ids holds {token}, not a token id: the model's vocabulary has "
                                 f"{self.vocab_size} tokens (ids 0 to {self.vocab_size - 1})")
        if self.context_len is not None and (request.reserved_tokens > self.context_len
                                             or len(request.input_ids) >= self.context_len):
            raise ValueError(
                f"prompt ({len(request.input_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's context length of {self.context_len} tokens (max_position_embeddings, or the sliding "
                f"window that this engine does not apply), which SGLang refuses too; shorten the prompt or lower "
                f"max_new_tokens (rollout.max_total_tokens caps both)")
        if self.max_total_tokens is not None and request.reserved_tokens > self.max_total_tokens:
            raise ValueError(f"prompt ({len(request.input_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds max_total_tokens={self.max_total_tokens}")
        return request

    def _ensure_scheduler(self) -> None:
        """Start the scheduler on the running loop (again, after an earlier loop has ended): callers of `asyncio.run`
        per rollout get a fresh scheduler each time, and requests left behind by a finished loop are dropped."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._scheduler is not None and not self._scheduler.done():
            return
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._scheduler = loop.create_task(self._schedule())

    async def _schedule(self) -> None:
        try:
            await self._wait_for_step()  # a step started by an earlier event loop may still run
            await self._gather_arrivals()
            while True:
                self._drop_abandoned()
                if not (self._paused or self._waiting or self._running):
                    # Idle: the scheduler ends, and the next request starts another. One left waiting
                    # would outlive the engine on the run's event loop (and be destroyed pending).
                    return
                if self._paused:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if self.steps_on_loop:
                    finished = self._step(self._admit())
                else:
                    self._inflight = self._executor.submit(self._step, self._admit())
                    finished = await asyncio.wrap_future(self._inflight)
                for request in finished:
                    self._resolve(request, request.reason)
                if self.steps_on_loop:
                    await asyncio.sleep(0)  # the loop's other coroutines run between steps
        except Exception as exc:
            self._fail(RuntimeError(f"EmbeddedEngine decode loop failed: {exc!r}"), exc)

    async def _gather_arrivals(self) -> None:
        """Before a batch's first step, one turn of the loop (requests made together on it are all waiting then); with
        `arrival_quiet`, until the process was idle that long with no request arriving (docs/agents.md). Only idle time
        counts: a poll that returns late found the loop or another thread busy, likely making calls."""
        await asyncio.sleep(0)
        waiting, quiet = len(self._waiting), 0.0
        deadline = time.perf_counter() + MAX_ARRIVAL_WAIT
        while quiet < self.arrival_quiet and time.perf_counter() < deadline:
            polled = time.perf_counter()
            await asyncio.sleep(ARRIVAL_POLL)
            slept = time.perf_counter() - polled
            if len(self._waiting) != waiting:
                waiting, quiet = len(self._waiting), 0.0
            elif slept < 2 * ARRIVAL_POLL:
                quiet += slept

    async def _wait_for_step(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([asyncio.wrap_future(self._inflight)])

    def _admit(self) -> list[_Request]:
        """Move waiting requests into the batch while rows, token budget and prefill size allow."""
        admitted: list[_Request] = []
        reserved = sum(r.reserved_tokens for r in self._running)
        width = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_running_requests:
            request = self._waiting[0]
            if self.max_total_tokens is not None and reserved + request.reserved_tokens > self.max_total_tokens:
                break
            new_width = max(width, len(request.input_ids) + len(request.output_ids))
            if admitted and new_width * (len(admitted) + 1) > MAX_PREFILL_TOKENS:
                break
            admitted.append(self._waiting.popleft())
            reserved += request.reserved_tokens
            width = new_width
        return admitted

    def _drop_abandoned(self) -> None:
        """Forget requests whose caller went away (cancelled task, finished event loop)."""

        def abandoned(request: _Request) -> bool:
            return request.future.done() or request.future.get_loop() is not self._loop

        self._waiting = deque(r for r in self._waiting if not abandoned(r))
        gone = [r for r in self._running if abandoned(r)]
        for request in gone:
            request.reason = {"type": "abort", "message": "abandoned by the caller"}
        if gone:
            self._compact()

    def _resolve(self, request: _Request, reason: dict) -> None:
        if request.future.done() or request.future.get_loop().is_closed():
            return
        meta = {"finish_reason": reason, "prompt_tokens": len(request.input_ids),
                "completion_tokens": len(request.output_ids), "cached_tokens": 0, "weight_version": self.weight_version}
        if request.return_logprob:
            meta["output_token_logprobs"] = [[logprob, token, None]
                                             for logprob, token in zip(request.logprobs, request.output_ids)]
        text = output_text(request.output_ids, reason, request.params, self.tokenizer)
        request.future.set_result({"text": text, "output_ids": list(request.output_ids), "meta_info": meta})

    def _fail(self, error: RuntimeError, cause: BaseException | None = None) -> None:
        """Fail every pending request now and every future one with `error`."""
        error.__cause__ = cause
        self._error = error
        for request in [*self._running, *self._waiting]:
            if not request.future.done() and not request.future.get_loop().is_closed():
                request.future.set_exception(error)
        self._running, self._waiting = [], deque()

    # ---- one step (on the loop, or in the worker thread) ----

    def _step(self, admitted: list[_Request]) -> list[_Request]:
        """Prefill the admitted requests, or else decode every running one; returns the finished."""
        with self._step_lock:
            if admitted:
                first_row = len(self._running)
                for i, request in enumerate(admitted):
                    request.row = first_row + i
                self._running.extend(admitted)
                self.runner.cache.expected_rows = len(self._running) + len(self._waiting)
                logits = self.runner.prefill(first_row, [r.input_ids + r.output_ids for r in admitted])
                batch = admitted
            else:
                batch = self._running
                logits = self.runner.decode([r.output_ids[-1] for r in batch], [r.cached_len for r in batch])
            banned = [stop_tokens_to_ban(len(r.output_ids), r.params, self.eos_ids) for r in batch]
            tokens, logprobs = sample_next_tokens(logits, [r.params for r in batch], banned,
                                                  [r.generator for r in batch], kernels=self.runner.sampling_kernels)
            for request, token, logprob in zip(batch, tokens.tolist(), logprobs.tolist()):
                request.output_ids.append(token)
                request.logprobs.append(logprob)
                request.reason = finish_reason(request.output_ids, request.params, self.eos_ids, self.tokenizer)
            finished = [r for r in batch if r.reason is not None]
            if finished:
                self._compact()
            return finished

    def _compact(self) -> None:
        """Drop finished requests and move the last rows into the holes they leave."""
        alive = [r for r in self._running if r.reason is None]
        holes = sorted(r.row for r in self._running if r.reason is not None and r.row < len(alive))
        movers = [r for r in alive if r.row >= len(alive)]
        for request, row in zip(movers, holes):
            self.runner.cache.copy_rows([request.row], row, request.cached_len)
            request.row = row
        self._running = sorted(alive, key=lambda r: r.row)


def threads_fit_in_cores() -> bool:
    """Whether every torch thread of every rank on this machine has a core of its own: then the forwards run on the
    event loop, whose OpenMP pool stays hot (each thread that runs torch ops gets its own pool, and libgomp stops
    spin-waiting once a process holds more threads than cores); else in a worker thread (torch frees the GIL)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return torch.get_num_threads() * ranks_here <= cores
