"""Which chat templates extend the tokens sampled so far when RL2 re-renders a conversation for the next turn:
the table of docs/agents.md ("Token in, token out"), checked by tests/unit/test_chat_template_fidelity.py.

Each template renders two conversations the way the rollout does (`RL2.rollout.loop.render_state`): one with
tools (two tool calls, then the answer), one of chat turns (the user says "Go on."), each action opening with
reasoning in <think> tags. After every action but the last, `RL2.rollout.loop.continuation` decides whether the
next prompt extends the prompt and the action (one sequence goes on), or not (the trajectory splits into a new
sequence, counted as `rollout/split_turns`); "raises" where the template refuses RL2's messages (the trajectory
ends as a fault). The bundled tokenizer stands in for each model's, with the template's special tokens added.

    python benchmarks/chat_template_fidelity.py
"""

import copy
from pathlib import Path

from RL2.rollout.env import load_env
from RL2.rollout.loop import continuation, render_state
from RL2.rollout.tools.declared import build_tools, template_renders_tools
from RL2.rollout.tools.tool_calls import HermesParser
from RL2.rollout.tools.tool_use import ToolUse

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "tests" / "data" / "chat_templates"
ENVS = REPO / "tests" / "envs"

# Each model's bos, eos and other special tokens, and the token that ends its assistant turns (None: the
# bundled tokenizer's own, whose template is SmolLM2's).
SPECIAL = {
    "smollm2": None,
    "qwen2.5": {"end": "<|im_end|>"},
    "qwen3": {"end": "<|im_end|>"},
    "llama3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "end": "<|eot_id|>",
                 "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]},
    "mistral-nemo": {"bos_token": "<s>", "eos_token": "</s>", "end": "</s>",
                     "additional_special_tokens": ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]},
    "deepseek-r1-distill": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                            "end": "<｜end▁of▁sentence｜>",
                            "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>",
                                                          "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                                                          "<｜tool▁outputs▁end｜>"]},
}
THINK = "<think>\n"
SYSTEM = {"role": "system", "content": "Be brief."}
QUESTION = "How many characters have 'abc' and 'hello'?"


def call(text: str) -> str:
    return f'<tool_call>\n{{"name": "count_chars", "arguments": {{"text": "{text}"}}}}\n</tool_call>'


# Per conversation: (the row's extra_info, the prompt's messages, the actions in turn: (text, whether the
# end-of-turn token ends it, else the stop string </tool_call> does)).
SCENARIOS = {
    "tools": ({}, [SYSTEM, {"role": "user", "content": QUESTION}], [
        (f"{THINK}Count the first.\n</think>\n\n{call('abc')}", False),
        (f"{THINK}Now the second.\n</think>\n\n{call('hello')}", False),
        (f"{THINK}Both counted.\n</think>\n\n3 and 5.", True),
    ]),
    # tests/envs/chat.py: "Go on." after each answer, to the conversation it keeps in extra_info; the first answer
    # ends with a newline.
    "chat": ({"messages": [SYSTEM, {"role": "user", "content": "Say hello."}], "turns": 3},
             [SYSTEM, {"role": "user", "content": "Say hello."}], [
        (f"{THINK}A greeting.\n</think>\n\nHello!\n", True),
        (f"{THINK}Go on.\n</think>\n\nGoing on.", True),
        (f"{THINK}Once more.\n</think>\n\nDone.", True),
    ]),
}


def template_names() -> list[str]:
    return list(SPECIAL)


def template_tokenizer(tok, name: str):
    """A copy of the bundled tokenizer `tok` with template `name` and its model's special tokens."""
    tokenizer = copy.deepcopy(tok)
    special = dict(SPECIAL[name] or {})
    special.pop("end", None)
    if special:
        tokenizer.add_special_tokens(special)
    if SPECIAL[name] is not None:
        tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def end_token(tokenizer, name: str) -> str:
    """The text of the token that ends an assistant turn of template `name`."""
    return (SPECIAL[name] or {}).get("end") or tokenizer.eos_token


def sampled(prompt: str, text: str) -> str:
    """What the policy writes for `text` after `prompt`: a prompt that opens the reasoning already (DeepSeek-R1's
    ends with "<think>\\n") is followed by the rest of it."""
    return text[len(THINK):] if prompt.endswith(THINK) and text.startswith(THINK) else text


def tool_use_for(tokenizer, scenario: str) -> ToolUse | None:
    """The rollout's tools of a scenario (tests/envs/tools.py's), as the policy's template shows them."""
    if scenario != "tools":
        return None
    env = load_env(ENVS / "tools.py")
    return ToolUse(build_tools(env.tool_specs, env.path), None, HermesParser(), template_renders_tools(tokenizer))


def env_path(scenario: str) -> Path:
    return ENVS / ("tools.py" if scenario == "tools" else "chat.py")


def outcomes(tokenizer, name: str, scenario: str) -> list[str]:
    """After each action but the last of `scenario`: "extends", "splits" or "raises" (see the module's doc)."""
    _, messages, actions = SCENARIOS[scenario]
    tool_use, end = tool_use_for(tokenizer, scenario), end_token(tokenizer, name)
    results = []
    for i, (text, ends_turn) in enumerate(actions[:-1]):
        # The next messages as the rollout makes them: the action as sampled, then the tool's result
        # (`tool_result_messages`, call ids "call_0", ...) or envs/chat.py's next user turn.
        try:
            state, _ = render_state(messages, tokenizer, tool_use)
            action = sampled(state, text)
            reply = ({"role": "tool", "content": str(len(("abc", "hello")[i])), "tool_call_id": "call_0",
                      "name": "count_chars"} if tool_use else {"role": "user", "content": "Go on."})
            messages = [*messages, {"role": "assistant", "content": action}, reply]
            next_state, _ = render_state(messages, tokenizer, tool_use)
        except Exception:  # the template refuses the conversation: the rollout ends the trajectory as a fault
            return results + ["raises"] * (len(actions) - 1 - i)
        results.append("extends" if continuation(state, action, next_state, end if ends_turn else "") is not None
                       else "splits")
    return results


def table(tok) -> str:
    """The markdown table of every template's outcomes, one column per action of each scenario."""
    n_tools, n_chat = len(SCENARIOS["tools"][2]) - 1, len(SCENARIOS["chat"][2]) - 1
    header = ([f"after tool call {i + 1}" for i in range(n_tools)] + ["after answer 1 (ends with a newline)"]
              + [f"after answer {i + 1}" for i in range(1, n_chat)])
    lines = ["| template | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for name in template_names():
        tokenizer = template_tokenizer(tok, name)
        cells = outcomes(tokenizer, name, "tools") + outcomes(tokenizer, name, "chat")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from tests.helpers.tiny import tokenizer

    print(table(tokenizer()))


if __name__ == "__main__":
    main()
