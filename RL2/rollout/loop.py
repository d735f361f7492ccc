"""The multi-turn rollout loop, the batch driver and dynamic filtering (metrics: `RL2.rollout.metrics`).

A trajectory alternates the policy and the environment until `done`, `max_turns` or the token budget. How turns
become token sequences, which failures end one trajectory and which stop the rollout: docs/rl.md, "Environments".
"""

import asyncio
import copy
import time
from dataclasses import dataclass

from RL2.engine.protocol import Engine, EngineError
from RL2.rollout.env import Env, EnvError, EnvFault, State, StepResult, TooManyTimeouts, not_text
from RL2.rollout.event_loop import Escaped, on_env_loop
from RL2.rollout.tools.tool_use import ToolUse
from RL2.rollout.trajectory import Trajectory, Turn, weight_version_number
from RL2.sandbox import SandboxError
from RL2.utils.tokens import Spans, encode, longest_token_chars, render_plain, spans_after

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, for a request that gives none
MAX_IDLE_RESUMES = 3  # aborts in a row, each before a token, after which a request is taken to be refused


def engine_sampling_params(params) -> dict:
    """A sampling config (`rollout.*_sampling_params`, or a plain dict) as the engines' `/generate` params, stop
    strings as a list. `no_stop_trim` is left out: it only trims the engines' text, and the rollout decodes the
    sampled tokens itself (an action keeps its stop string)."""
    params = dict(params.items())  # a config section holds lists as its own list type: made plain below
    params.pop("no_stop_trim", None)
    stop, stop_token_ids = params.pop("stop", None), params.pop("stop_token_ids", None)
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else [str(s) for s in stop]
    if stop_token_ids:
        params["stop_token_ids"] = [int(token) for token in stop_token_ids]
    return params


@dataclass(frozen=True)
class EnvRollout:
    """What every trajectory of an environment's rollout shares; the worker calls its `batch` and `partial_batch`."""

    engine: Engine  # serves SGLang `/generate` payloads
    env: Env
    tokenizer: object  # the policy's (decodes actions, tokenises observations)
    max_turns: int = 1  # the most actions, at least 1 (`rollout.max_turns`, checked when the config is parsed)
    max_total_tokens: int | None = None  # the most tokens of one sequence (prompt, actions, observations)
    env_timeout: float | None = None  # seconds one `step` (or `reset`) may take once it has started; None: no limit
    tool_use: ToolUse | None = None  # the environment's tools: only an action that calls none is stepped
    max_timeouts: int | None = None  # `rollout.max_consecutive_timeouts`: timeouts of `env` in a row that stop it

    def batch(self, prompts: list[dict], responses_per_prompt: int, sampling_params):
        """`rollout_batch` under a sampling config (`rollout.*_sampling_params`, or a plain dict)."""
        return rollout_batch(self, prompts, responses_per_prompt, self._engine_params(sampling_params))

    def partial_batch(self, carried: list[list[Trajectory]], prompts: list[dict], n_needed: int,
                      responses_per_prompt: int, sampling_params):
        """`partial_rollout_batch` under a sampling config."""
        return partial_rollout_batch(self, carried, prompts, n_needed, responses_per_prompt,
                                     self._engine_params(sampling_params))

    def _engine_params(self, sampling_params) -> dict:
        params = engine_sampling_params(sampling_params)
        return self.tool_use.sampling_params(params) if self.tool_use else params


async def run_trajectory(rollout: EnvRollout, state: State | None, extra_info: dict, sampling_params: dict,
                         prompt_ids: list[int] | None = None, resume: Trajectory | None = None,
                         stop: asyncio.Event | None = None) -> Trajectory:
    """Roll out one trajectory from `state` (the prompt text or chat messages, tokenised unless `prompt_ids` are
    given; None asks the environment's `reset`) and the row's `extra_info` (not copied here). `resume`: a trajectory
    that ended with stop_reason "abort" instead, its last action sampled on from where it stopped. `stop`: once set,
    no new action is requested: the trajectory ends "abort" with an empty action, to be resumed later."""
    trajectory = resume if resume is not None else await _start(rollout, state, extra_info, prompt_ids)
    if trajectory.fault is not None:  # its reset failed
        return trajectory
    while True:
        if stop is not None and stop.is_set() and not trajectory.unfinished:
            trajectory.add_turn(Turn([], [], "", "abort"))
            trajectory.stop_reason = "abort"
            return trajectory
        params = _seeded(sampling_params, sampling_params.get("sampling_seed"), trajectory.n_turns)
        engine, tokenizer, ids = rollout.engine, rollout.tokenizer, trajectory.current_ids
        room = None if rollout.max_total_tokens is None else rollout.max_total_tokens - len(ids)
        if trajectory.unfinished:  # the rest of an action a pause cut short (`ids` end with its tokens)
            turn = trajectory.turns[-1]
            _, seconds = await sample_rest(engine, tokenizer, ids, turn, params, room)
        else:
            turn, _, seconds = await sample_action(engine, tokenizer, ids, params, room)
            trajectory.add_turn(turn)
        trajectory.generate_seconds += seconds
        if turn.finish_reason == "abort":  # the engine was paused: a partial action, no reward yet
            trajectory.stop_reason = "abort"
            return trajectory
        trajectory.stop_reason = ""  # a resumed action is whole again: from here on it runs as any other
        result = await _answer(rollout, trajectory, turn.action_text)
        if isinstance(result, str):
            return trajectory.fail(result)
        turn.reward, turn.score, trajectory.env_info = result.reward, result.score, result.extra_info
        turn.reward_parts = result.reward_parts
        if result.done or trajectory.n_turns == rollout.max_turns:
            trajectory.stop_reason = "done" if result.done else "max_turns"
            return trajectory
        try:
            next_state, plain = render_state(result.next_state, rollout.tokenizer, rollout.tool_use)
        except Exception as e:  # messages of the environment's making that the chat template rejects
            return trajectory.fail(f"malformed next_state: the chat template raised {type(e).__name__}: {e}")
        if (bad := not_text(next_state)) is not None:  # the tokenizer would raise TypeError
            return trajectory.fail(f"malformed next_state: it {bad}")
        if not _observe(rollout, trajectory, turn, next_state, plain):
            trajectory.stop_reason = "budget"
            return trajectory
        trajectory.state = next_state
        trajectory.messages = result.next_state if isinstance(result.next_state, list) else None


async def rollout_batch(rollout: EnvRollout, prompts: list[dict], responses_per_prompt: int,
                        sampling_params: dict) -> list[list[Trajectory]]:
    """Roll out every prompt `responses_per_prompt` times (a GRPO group) concurrently: one group per prompt, in order.
    `prompts` are rows with `prompt` (text or chat messages; leave it out to call the env's `reset`), optionally
    `prompt_ids` (the prompt tokenised), `extra_info` (each trajectory gets a copy) and `sampling_seed`:
    trajectory j samples with `sample_seed(seed, j)` (each turn with one of its own), so what it samples depends
    neither on the ranks nor on the other requests of the batch (evaluation sets it)."""
    tasks = [[asyncio.create_task(_row_trajectory(rollout, row, _seeded(sampling_params, row.get("sampling_seed"), j)))
              for j in range(responses_per_prompt)] for row in prompts]
    await gather_or_cancel([task for group in tasks for task in group])
    return [[task.result() for task in group] for group in tasks]


async def partial_rollout_batch(rollout: EnvRollout, carried: list[list[Trajectory]], prompts: list[dict],
                                n_needed: int, responses_per_prompt: int,
                                sampling_params: dict) -> tuple[list, list, list]:
    """Partial rollout (docs/async.md): stop as soon as `n_needed` groups are finished, pausing the engine with
    abort; the rest carry on next time. The groups `carried` from the previous call (unfinished trajectories resume
    where they stopped) go first, then one new group per prompt. Returns (finished groups, unfinished groups, newly
    finished groups: what this call's metrics report), carried ones first, then in prompt order; the finished
    include carried ones finished already (beyond an earlier batch)."""
    already = {id(g[0]) for g in carried if not any(t.unfinished for t in g)}  # they come back as they went in
    stop = asyncio.Event()
    done_groups = asyncio.Event()
    finished_count = 0
    def trajectory(row: dict, resume: Trajectory | None = None):
        return _row_trajectory(rollout, row, sampling_params, resume, stop)

    async def group(members: list) -> list[Trajectory]:
        nonlocal finished_count
        results = list(await asyncio.gather(*members))
        if not any(t.unfinished for t in results):
            finished_count += 1
            if finished_count >= n_needed:
                done_groups.set()
        return results

    # A finished carried trajectory joins its group as it is (`asyncio.sleep(0, t)` only hands it back).
    tasks = [asyncio.create_task(group([trajectory({}, t) if t.unfinished else asyncio.sleep(0, t) for t in g]))
             for g in carried]
    tasks += [asyncio.create_task(group([trajectory(row) for _ in range(responses_per_prompt)])) for row in prompts]
    all_done = asyncio.ensure_future(gather_or_cancel(tasks))
    enough = asyncio.create_task(done_groups.wait())
    await asyncio.wait([all_done, enough], return_when=asyncio.FIRST_COMPLETED)
    enough.cancel()
    if not all_done.done():
        stop.set()
        # Pause until every in-flight request has come back aborted (a request may reach an HTTP
        # server just after a pause; the stop flag keeps new ones from being sent).
        try:
            while not all_done.done():
                await rollout.engine.pause_generation("abort")
                await asyncio.wait([all_done], timeout=1.0)
        finally:  # a pause that failed must not leave the engine paused for the next rollout
            await rollout.engine.continue_generation()
    await all_done  # raises the first error of any trajectory
    groups = [task.result() for task in tasks]
    finished = [g for g in groups if not any(t.unfinished for t in g)]
    newly = [g for g in finished if id(g[0]) not in already]
    return finished, [g for g in groups if any(t.unfinished for t in g)], newly


async def _row_trajectory(rollout: EnvRollout, row: dict, sampling_params: dict, resume: Trajectory | None = None,
                          stop: asyncio.Event | None = None) -> Trajectory:
    """A trajectory of `row`, or `resume` carried on. Another client of a shared server may pause it: the cut
    action carries on until it is whole (or `stop` is set). A request aborted again and again before it samples a
    token is refused, not paused: that raises, where resuming would loop for ever."""
    # A row keeps its conversation where its prompt is the conversation's rendering (environments with tools).
    state = row.get("messages") or row.get("prompt")

    def attempt(resume: Trajectory | None):
        return run_trajectory(rollout, state, copy.deepcopy(row.get("extra_info") or {}), sampling_params,
                              prompt_ids=row.get("prompt_ids"), resume=resume, stop=stop)

    trajectory, idle = resume if resume is not None else await attempt(None), 0
    trajectory.row = row.get("row", trajectory.row)
    while trajectory.unfinished and not (stop is not None and stop.is_set()):
        sampled = trajectory.response_length
        trajectory = await attempt(trajectory)
        idle = idle + 1 if trajectory.response_length == sampled else 0
        if idle == MAX_IDLE_RESUMES:
            raise EngineError(f"the engine aborted a request {idle} times in a row before it sampled a token")
    return trajectory


def drop_stale_groups(groups: list[list[Trajectory]], version: int,
                      max_staleness: int) -> tuple[list[list[Trajectory]], int]:
    """Drop the carried groups whose oldest sampled token is more than `max_staleness` versions behind `version`,
    the weights the next update trains (AReaL's `max_head_offpolicyness`), whole; a group without a token of known
    version is kept. Returns (the groups kept, in order; how many were dropped)."""
    kept = [group for group in groups if version - min((v for t in group for v in t.versions), default=version)
            <= max_staleness]
    return kept, len(groups) - len(kept)


def filter_groups(groups: list[list[Trajectory]], train_on_faults: bool = False) -> list[list[Trajectory]]:
    """Drop groups whose trained rewards (faults' only with `train_on_faults`) are all equal (DAPO's dynamic
    sampling): their group-normalised advantages are all 0, so they cost compute and teach nothing."""
    return [group for group in groups if len({t.reward for t in group if train_on_faults or t.fault is None}) > 1]


def sample_seed(seed: int, index: int) -> int:
    """The seed of item `index` (a trajectory of a prompt, a turn of a trajectory) under `seed`."""
    return (seed * 1_000_003 + index) % 2**63


def _seeded(sampling_params: dict, seed: int | None, index: int) -> dict:
    """`sampling_params` of item `index` under `seed` (None: unseeded): each item draws from a seed of its own."""
    return sampling_params if seed is None else {**sampling_params, "sampling_seed": sample_seed(seed, index)}


def render_state(state: State, tokenizer, tool_use=None) -> tuple[str, list[tuple[int, int]]]:
    """A state as text (chat messages through the chat template, with the tools if any), and the spans where the
    messages' content wrote special tokens' text, which `encode` keeps as text (`RL2.utils.tokens.render_plain`)."""
    if isinstance(state, str):
        return state, []
    if tool_use is not None:
        return render_plain(tokenizer, lambda messages: tool_use.render(messages, tokenizer), state)
    return render_plain(tokenizer, lambda messages: tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), state)


def continuation(state: str, action: str, next_state: str, end_text: str = "") -> str | None:
    """The text `next_state` adds after `state + action`, or None when it does not extend them. `end_text`: the text
    of the special token that ended the action, if any, which `action` skips and a chat template re-rendering the
    conversation writes: it is dropped here rather than appended twice."""
    prefix = state + action
    if not next_state.startswith(prefix):
        return None
    added = next_state[len(prefix) :]
    if end_text and added.startswith(end_text):
        added = added[len(end_text) :]
    return added


async def _start(rollout: EnvRollout, state: State | None, extra_info: dict,
                 prompt_ids: list[int] | None) -> Trajectory:
    """A new trajectory holding just its prompt (from the row, or from the environment's `reset`); a
    trajectory ended by a fault, without a sequence, when `reset` fails or its state is no text."""
    trajectory = Trajectory(extra_info=extra_info, env_info=extra_info)
    if state is None:
        try:
            state = await call_script(rollout.env, rollout.env.reset(extra_info), rollout.env_timeout,
                                      rollout.max_timeouts, "rollout.env_timeout")
        except TooManyTimeouts:
            raise
        except TimeoutError:
            return trajectory.fail(f"reset failed: {rollout.env.path}: reset did not return within "
                                   f"env_timeout={rollout.env_timeout} s")
        except Exception as e:  # the script's reset: whatever it raises ends this trajectory only
            raised = str(e) if isinstance(e, Escaped) else f"{type(e).__name__}: {e}"
            return trajectory.fail(f"reset failed: {e}" if isinstance(e, EnvError) else f"reset raised {raised}")
    messages = state if isinstance(state, list) else None
    try:
        state, plain = render_state(state, rollout.tokenizer, rollout.tool_use)
    except Exception as e:  # messages (the row's or `reset`'s) that the chat template rejects
        return trajectory.fail(f"malformed state: the chat template raised {type(e).__name__}: {e}")
    if prompt_ids is None and (bad := not_text(state)) is not None:  # the tokenizer would raise TypeError
        return trajectory.fail(f"malformed state: it {bad}")
    ids = encode(rollout.tokenizer, state, plain) if prompt_ids is None else list(prompt_ids)
    if rollout.max_total_tokens is not None and len(ids) >= rollout.max_total_tokens:  # no room for one token
        raise ValueError(f"a prompt of {len(ids)} tokens leaves no room to generate within max_total_tokens="
                         f"{rollout.max_total_tokens}; raise it or shorten the prompts")
    trajectory.state, trajectory.messages = state, messages
    trajectory.start_sequence(state, ids)
    return trajectory


async def call_script(script, coroutine, timeout: float | None, max_timeouts: int | None, timeout_key: str):
    """`on_env_loop(coroutine, timeout)` for a call of `script` (an `Env` or an agent script); its `max_timeouts`-th
    call in a row to time out raises `TooManyTimeouts` (None: never), as a script that hangs on every call would
    otherwise fault every trajectory of every step. `timeout_key` is the config key of `timeout`, for the error."""
    try:
        value = await on_env_loop(coroutine, timeout)
    except TimeoutError:
        script.timeouts_in_a_row += 1
        if max_timeouts is None or script.timeouts_in_a_row < max_timeouts:
            raise
        script.timeouts_in_a_row = 0
        raise TooManyTimeouts(
            f"{max_timeouts} calls of {script.path} in a row ran out of time ({timeout_key}={timeout} s), none "
            f"ending otherwise in between: it seems stuck (a dead server, a lock never released, an endless loop); "
            f"fix it, or raise rollout.max_consecutive_timeouts (null: never stop)") from None
    except Exception:  # it ended on its own, if with an error: not stuck
        script.timeouts_in_a_row = 0
        raise
    script.timeouts_in_a_row = 0
    return value


async def sample_action(engine: Engine, tokenizer, input_ids: list[int], sampling_params: dict,
                        room: int | None) -> tuple[Turn, str | int | None, float]:
    """Sample one action after `input_ids`, with at most `room` new tokens; also returns the stop string
    or token that ended it (None when none did) and the seconds the engine took."""
    params = dict(sampling_params)
    if room is not None:
        requested = params.get("max_new_tokens")
        params["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS if requested is None else requested, room)
    began = time.perf_counter()
    response = await engine.generate({"input_ids": input_ids, "sampling_params": params, "return_logprob": True})
    seconds = time.perf_counter() - began
    meta = response.get("meta_info") or {}
    if "output_token_logprobs" not in meta or "finish_reason" not in meta:
        raise EngineError("the engine's response has no meta_info.output_token_logprobs or finish_reason; it must "
                          "answer as SGLang's /generate does with return_logprob")
    ids = [int(token) for _, token, _ in meta["output_token_logprobs"]]
    logps = [float(logp) for logp, _, _ in meta["output_token_logprobs"]]
    reason = meta["finish_reason"]
    matched = reason.get("matched")
    # One request samples all its tokens with one set of weights: pushes happen between rollouts, while
    # no request runs. An engine that does not name them leaves the tokens to the worker's version.
    version = weight_version_number(meta.get("weight_version"))
    versions = [] if version is None else [version] * len(ids)
    turn = Turn(ids, logps, action_text(tokenizer, ids, matched), reason["type"], action_versions=versions)
    return turn, matched, seconds


async def sample_rest(engine: Engine, tokenizer, input_ids: list[int], turn: Turn, sampling_params: dict,
                      room: int | None) -> tuple[str | int | None, float]:
    """Sample into `turn` the rest of an action a pause cut short, after `input_ids`, which end with its tokens;
    returns the stop string or token that ended it and the engine's seconds."""
    params = dict(sampling_params)
    requested = params.get("max_new_tokens")
    params["max_new_tokens"] = (DEFAULT_MAX_NEW_TOKENS if requested is None else requested) - len(turn.action_ids)
    if params["max_new_tokens"] < 1 or (room is not None and room < 1):  # it was cut at its very last token
        turn.finish_reason = "length"
        return None, 0.0
    rest, matched, seconds = await sample_action(engine, tokenizer, input_ids, params, room)
    turn.extend(rest)
    turn.action_text = action_text(tokenizer, turn.action_ids, matched)
    return matched, seconds


def action_text(tokenizer, ids: list[int], matched: str | int | None = None) -> str:
    """The text of sampled tokens as the environment gets it: every token's (the text matches the tokens trained
    on), a matched stop string kept, and what the token that completed it wrote after it cut, as in SGLang's text."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[: pos + len(matched)]
    return text


async def _answer(rollout: EnvRollout, trajectory: Trajectory, action: str) -> StepResult | str:
    """What follows an action: its tool calls' results, else the environment's step; or why the trajectory fails."""
    if rollout.tool_use is not None and (reply := await rollout.tool_use.respond(trajectory, action)) is not None:
        return reply
    try:
        return await call_script(rollout.env, rollout.env.step(trajectory.state, action, trajectory.env_info),
                                 rollout.env_timeout, rollout.max_timeouts, "rollout.env_timeout")
    except (TooManyTimeouts, SandboxError):  # the run cannot go on (a sandbox that cannot isolate fails every step)
        raise
    except TimeoutError:
        return f"step timed out after {rollout.env_timeout} s"
    except EnvFault as e:
        return f"malformed step result: {e}"
    except Escaped as e:
        return f"step raised {e}"
    except Exception as e:  # the script runs on untrusted model output: whatever it raises ends this trajectory only
        return f"step raised {type(e).__name__}: {e}"


def _observe(rollout: EnvRollout, trajectory: Trajectory, turn: Turn, next_state: str, plain: Spans = ()) -> bool:
    """Add the next state (`plain`: see `render_state`); False when it leaves no room for another action."""
    tokenizer, budget = rollout.tokenizer, rollout.max_total_tokens
    added = continuation(trajectory.state, turn.action_text, next_state, end_text(tokenizer, turn.action_ids))
    text = next_state if added is None else added
    before = 0 if added is None else len(trajectory.current_ids)  # the tokens `text` comes after
    # A text with more characters than the room left could hold in tokens is refused without tokenising
    # it (tens of MB would take minutes and GBs, all to be cut).
    if budget is not None and len(text) >= (budget - before) * longest_token_chars(tokenizer):
        return False
    ids = encode(tokenizer, text, spans_after(plain, len(next_state) - len(text)))
    if budget is not None and before + len(ids) >= budget:  # no room left for one sampled token
        return False
    if added is None:
        trajectory.split_turns += 1
        trajectory.start_sequence(next_state, ids)
    else:
        trajectory.continue_sequence(added, ids)
    return True


def end_text(tokenizer, action_ids: list[int]) -> str:
    """The text of the special token that ended an action (its decoded text skips it), or ""."""
    last = action_ids[-1:]
    return tokenizer.decode(last) if last and last[0] in tokenizer.all_special_ids else ""


async def gather_or_cancel(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; on the first error cancel the rest and raise that error."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
