"""Tools in the environment loop: a script that declares `TOOLS` gets the model's calls run for it, and is asked to
`step` only on an action that calls none (the answer). See docs/agents.md, "An environment with tools"."""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from RL2.rollout.env import StepResult
from RL2.rollout.event_loop import Escaped, on_env_loop
from RL2.rollout.tools.declared import (
    Tool,
    ToolResult,
    build_tools,
    render_conversation,
    run_tool,
    template_renders_tools,
    tool_result_messages,
)
from RL2.rollout.tools.tool_calls import ToolCall, ToolCallParser, tool_call_parser

BLOCKED_GRACE_S = 1.0  # seconds past rollout.tool_timeout after which a tool blocking its loop is given up


@dataclass
class ToolUse:
    """The tools of an environment, and how the policy sees and calls them."""

    tools: dict[str, Tool]  # by name (`build_tools`)
    call_tool: Callable | None  # the environment's runner of schema-only tools, if any
    parser: ToolCallParser  # the policy's tool-call format
    native: bool  # the chat template renders tools itself; otherwise RL2's default format is written in the messages
    timeout: float | None = None  # seconds one call may take (None: no limit)
    on_error: str = "observe"  # "observe" (the error is the call's result) or "end" (the trajectory ends as a fault)
    stop_after_call: bool = True  # end an action at the format's end of a call (`sampling_params`)

    def render(self, messages: list[dict], tokenizer) -> str:
        """Chat messages as the policy sees them, with the tools."""
        schemas = [tool.schema for tool in self.tools.values()]
        return render_conversation(tokenizer, messages, schemas, self.parser, self.native)

    def sampling_params(self, params: dict) -> dict:
        """`params` with the format's end of a call among the stop strings (`stop_after_call`)."""
        return self.parser.stop_at_call_end(params) if self.stop_after_call else params

    async def respond(self, trajectory, action: str) -> StepResult | str | None:
        """Run the calls of `action`, which answers the trajectory's `messages` (None: the state was text), counted
        in its `tool_calls`, `parse_errors`, `tool_errors` and `tool_seconds`. Returns None when the action calls
        no tool (the environment's step answers it); else the conversation with the action and the results as the
        next state, with no reward; or, where the trajectory must end, the reason."""
        parsed = self.parser.parse(action)
        if not parsed.calls and not parsed.errors:
            return None
        trajectory.tool_calls += len(parsed.calls)
        trajectory.parse_errors += len(parsed.errors)
        if trajectory.messages is None:
            return "the model called a tool, but the state is text: an environment with tools needs chat messages"
        if parsed.errors and self.on_error == "end":
            return f"a tool call could not be parsed ({parsed.errors[0]}) and rollout.tool_error=end"
        began = time.perf_counter()
        results = await self._run(parsed.calls, trajectory.env_info)
        trajectory.tool_seconds += time.perf_counter() - began
        failed = [result for result in results if result.error]
        trajectory.tool_errors += len(failed)
        if failed and self.on_error == "end":
            return f"a tool call failed ({failed[0].content}) and rollout.tool_error=end"
        unparsed = [{"role": "tool", "name": "", "tool_call_id": f"unparsed_{i}",
                     "content": f"Error: the tool call could not be parsed: {error}"}
                    for i, error in enumerate(parsed.errors)]
        # The assistant's message is the text it sampled, so that the template's rendering of it is what the
        # model wrote and the conversation stays one token sequence.
        assistant = {"role": "assistant", "content": action}
        messages = [*trajectory.messages, assistant, *tool_result_messages(results), *unparsed]
        return StepResult(messages, 0.0, 0.0, False, trajectory.env_info)

    async def _run(self, calls: list[ToolCall], extra_info: dict) -> list[ToolResult]:
        """The calls' results, run on the environments' loop. A tool that blocks that loop itself (sync code in an
        async tool) is timed out here, and one that raises what `run_tool` does not catch fails every call."""
        async def run_all() -> list[ToolResult]:  # gathered on the environments' loop
            return await asyncio.gather(*(run_tool(self.tools, call, extra_info, self.timeout, self.call_tool)
                                          for call in calls))

        try:
            return await on_env_loop(run_all(), None if self.timeout is None else self.timeout + BLOCKED_GRACE_S)
        except TimeoutError:
            return [ToolResult(call, f"Error: {call.name} did not return within {self.timeout} s", "timeout",
                               self.timeout) for call in calls]
        except Escaped as e:
            return [ToolResult(call, f"Error: a tool raised {e}", "raised", 0.0) for call in calls]


class ToolFault(Exception):
    """A call of a `ToolBox` failed under rollout.tool_error=end: the run ends as a fault."""


@dataclass
class ToolBox:
    """Tools that a script's own code calls (an agent's MCP servers), for one run: their OpenAI schemas for
    `tools=`, and `call`, which runs a call as the rollout runs a model's and counts its failure."""

    tools: dict[str, Tool]  # by name
    timeout: float | None  # rollout.tool_timeout
    on_error: str  # rollout.tool_error
    counts: object  # the run's trajectory: `tool_errors` grows by each call that fails
    extra_info: dict  # the run's, for tools that take it
    fault: str | None = None  # set when a failure ends the run (rollout.tool_error=end)

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]

    async def call(self, name: str, arguments: str | dict) -> str:
        """The result of tool `name` on `arguments` (an object, or its JSON text), "Error: ..." when the call fails;
        under rollout.tool_error=end a failure raises `ToolFault`: a fault ending the run, whatever the script does."""
        try:
            arguments = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
            problem = None if isinstance(arguments, dict) else f"{arguments!r:.200} is not a JSON object"
        except json.JSONDecodeError as e:
            problem = f"not JSON ({e.msg})"
        if problem is None:
            result = await run_tool(self.tools, ToolCall(name, arguments, ""), self.extra_info, self.timeout)
            content, failed = result.content, result.error is not None
        else:  # what the model wrote
            content, failed = f"Error: bad arguments for {name}: {problem}", True
        if failed:
            self.counts.tool_errors += 1
            if self.on_error == "end":
                self.fault = f"a tool call failed ({content}) and rollout.tool_error=end"
                raise ToolFault(self.fault)
        return content


def tool_use_of(env, rollout_cfg, tokenizer) -> ToolUse | None:
    """The `ToolUse` of an environment whose script declares `TOOLS`, else None, under the `rollout` config's
    tool_parser, tool_timeout, tool_error and tool_call_stop; the tokenizer's chat template decides the format."""
    if not env.tool_specs:
        return None
    tools = build_tools(env.tool_specs, env.path, env.call_tool)
    try:
        parser = tool_call_parser(rollout_cfg.tool_parser, tokenizer)
    except ValueError as e:
        raise ValueError(f"rollout.tool_parser: {e}") from None
    return ToolUse(tools, env.call_tool, parser, template_renders_tools(tokenizer), rollout_cfg.tool_timeout,
                   rollout_cfg.tool_error, rollout_cfg.tool_call_stop)
