"""What a run rolls out, and the rollout worker over it, for the PPO trainer and the evaluator alike. The script
is loaded before any process group or engine starts, so that bad input fails first; its tools are built once, for
the prompt rows and the rollout alike."""

from collections.abc import Sequence

import torch

from RL2.agents.agent import Agent, AgentRollout, load_agent
from RL2.agents.endpoint import OpenAIEndpoint
from RL2.datasets.prompts import prompt_row_tokenizer
from RL2.engine import context_length, start_engine
from RL2.models.default_model import resolve_model_path
from RL2.models.precision import compute_dtype
from RL2.rollout.env import Env, EnvError, load_env
from RL2.rollout.judge_engine import run_judge
from RL2.rollout.loop import EnvRollout
from RL2.rollout.reward_env import load_reward_env
from RL2.rollout.tools.declared import template_renders_tools
from RL2.rollout.tools.tool_calls import tool_call_parser
from RL2.rollout.tools.tool_use import ToolUse, tool_use_of
from RL2.rollout.worker import RolloutWorker
from RL2.sandbox import run_sandbox

RolloutScript = Env | Agent


def load_rollout_script(rollout_cfg) -> RolloutScript:
    """`rollout.reward_fn` as a one-turn environment, else the agent or environment script; an error names the key."""
    if rollout_cfg.reward_fn:
        return load_reward_env(rollout_cfg.reward_fn)
    agent = rollout_cfg.get("agent_path")
    key, path = ("rollout.agent_path", agent) if agent else ("rollout.env_path", rollout_cfg.env_path)
    if not path:  # no default: a run must say what scores it
        raise EnvError("rollout.env_path is not set; give the environment script that scores the actions, e.g. "
                       "rollout.env_path=envs/arithmetic.py (or rollout.reward_fn=FILE:NAME, rollout.agent_path=FILE)")
    try:
        return load_agent(path, rollout_cfg.tool_timeout, rollout_cfg.tool_error) if agent else load_env(path)
    except EnvError as e:
        raise EnvError(f"{key}={path}: {e}") from None


def close_script(script: RolloutScript) -> None:
    """At the end of a run: close the connections to the script's MCP servers (a stdio server exits), if any."""
    if getattr(script, "mcp", None) is not None:
        script.mcp.close()


def calls_tools(script: RolloutScript) -> bool:
    """Whether the policy may call tools (an environment's TOOLS, an agent): the tool metrics mean something."""
    return isinstance(script, Agent) or bool(script.tool_specs)


def makes_prompts(script: RolloutScript) -> bool:
    """Whether the script makes a row's first state itself (an environment's `reset`): rows may leave the prompt out."""
    return not isinstance(script, Agent) and script.reset_fn is not None


def tools_of(script: RolloutScript, rollout_cfg, tokenizer) -> ToolUse | None:
    """The tools the rollout runs for an environment that declares TOOLS; an agent runs its own."""
    return None if isinstance(script, Agent) else tool_use_of(script, rollout_cfg, tokenizer)


def prompt_row_maker(script: RolloutScript, tool_use: ToolUse | None, tokenizer):
    """`prompt_row_tokenizer` for `script`: rows may leave the prompt out when an environment resets, show the
    environment's tools (`tool_use`, from `tools_of`), and keep their chat messages for an agent, which gets them."""
    return prompt_row_tokenizer(tokenizer, env_resets=makes_prompts(script), keep_messages=isinstance(script, Agent),
                                tool_use=tool_use)


def rollout_worker(rollout_cfg, model_cfg, tokenizer, device: torch.device, script: RolloutScript,
                   tool_use: ToolUse | None, policy=None, colocated: Sequence = (), seed: int = 0) -> RolloutWorker:
    """This rank's engine (collective for SGLang), the driver of `script` on it, and the worker over both.
    `model_cfg` is the `actor` config (the weights and compute dtype of the engine's copy)."""
    dtype = compute_dtype(model_cfg.dtype, device)
    model_path = resolve_model_path(model_cfg.model_name)
    engine = start_engine(rollout_cfg, model_path, dtype, device, tokenizer, colocated, seed)
    # Unset, a sequence may grow to the model's context: a request past it is refused (by SGLang and
    # the embedded engine alike), which would fail the rollout, where the budget ends one trajectory.
    max_total_tokens = rollout_cfg.max_total_tokens or context_length(model_path, rollout_cfg.server_args)
    if isinstance(script, Agent):  # its calls reach this rank's engine through an OpenAI endpoint
        endpoint = OpenAIEndpoint(engine, tokenizer, tool_call_parser(rollout_cfg.tool_parser, tokenizer),
                                  template_renders_tools(tokenizer), {}, max_total_tokens, rollout_cfg.tool_call_stop,
                                  max_calls=rollout_cfg.agent_max_calls, max_tokens=rollout_cfg.agent_max_tokens)
        driver = AgentRollout(endpoint, script, rollout_cfg.agent_timeout, rollout_cfg.max_consecutive_timeouts)
    else:
        driver = EnvRollout(engine, script, tokenizer, rollout_cfg.max_turns, max_total_tokens,
                            rollout_cfg.env_timeout, tool_use, rollout_cfg.max_consecutive_timeouts)
    # The sandbox of the script's code rewards (made at its first use), entered for each rollout.
    sandbox = run_sandbox(bool(rollout_cfg.get("code_sandbox_unisolated", False)))
    # The judge of its judge_reward calls (rollout.judge): a served one is loaded here, once per rank.
    judge = run_judge(rollout_cfg.judge, dtype, device) if "judge" in rollout_cfg else None
    return RolloutWorker(engine, driver, device, dtype, policy, colocated, sandbox, judge)
