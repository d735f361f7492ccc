"""Token fidelity across turns under real chat templates (tests/data/chat_templates, the bundled SmolLM2 one):
whether re-rendering a conversation extends the tokens sampled so far, and that the rollout splits into a new
sequence exactly where it does not (benchmarks/chat_template_fidelity.py has the conversations).

The tiny model never writes <think> blocks or tool calls, so the policy here is scripted: it answers each request
with the conversation's next action (tokenised by the template's tokenizer), in SGLang's /generate shape.
Everything after sampling (rendering, the continuation check, tokenising, tools, the environment) is RL2's.
"""

import asyncio

import pytest

from RL2.rollout.env import load_env
from RL2.rollout.loop import EnvRollout, run_trajectory
from RL2.rollout.metrics import rollout_metrics, split_summary
from tests.unit.test_benchmark_scripts import REPO, benchmark_module

fidelity = benchmark_module("chat_template_fidelity")

# After each action but the last: tools (tool call 1, tool call 2), then chat (answer 1, answer 2). Decided from
# what each template visibly does with RL2's messages (an assistant message is the text it sampled):
EXPECTED = {
    # ChatML, content as written.
    "smollm2": ["extends", "extends", "extends", "extends"],
    "qwen2.5": ["extends", "extends", "extends", "extends"],
    # Keeps the <think> block of the turns after the last user query (tool turns), drops it before.
    "qwen3": ["extends", "extends", "splits", "splits"],
    # `content | trim`: only the answer that ends with a newline is rewritten.
    "llama3.2": ["extends", "extends", "splits", "extends"],
    # Tool call ids must have 9 characters (RL2's are "call_0", ...); the system prompt moves to the last user turn.
    "mistral-nemo": ["raises", "raises", "splits", "splits"],
    # Drops everything up to </think> of every past assistant turn (and the "<think>\n" its prompt opened).
    "deepseek-r1-distill": ["splits", "splits", "splits", "splits"],
}


class ScriptedPolicy:
    """Writes `actions` in turn: an action that ends its turn gets the end-of-turn token, a tool call ends at
    "</tool_call>" (the rollout's stop string)."""

    def __init__(self, tokenizer, end: str, actions: list[tuple[str, bool]]):
        self.tokenizer, self.end_id, self.actions = tokenizer, tokenizer.convert_tokens_to_ids(end), list(actions)
        self.sampled: list[list[int]] = []

    async def generate(self, payload: dict) -> dict:
        text, ends_turn = self.actions.pop(0)
        text = fidelity.sampled(self.tokenizer.decode(payload["input_ids"]), text)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.end_id] if ends_turn else [])
        self.sampled.append(ids)
        matched = self.end_id if ends_turn else "</tool_call>"
        return {"meta_info": {"output_token_logprobs": [[0.0, i, None] for i in ids], "weight_version": "default",
                              "finish_reason": {"type": "stop", "matched": matched}}}


@pytest.fixture(scope="module")
def tokenizers(tok):
    return {name: fidelity.template_tokenizer(tok, name) for name in fidelity.template_names()}


def test_every_template_has_an_expectation_and_a_source():
    assert sorted(EXPECTED) == sorted(fidelity.template_names())
    for path in fidelity.TEMPLATES.glob("*.jinja"):
        assert path.stem in EXPECTED, path
        assert path.read_text().startswith("{#- Source: "), path


@pytest.mark.parametrize("name", list(EXPECTED))
def test_which_re_renderings_extend_the_sampled_tokens(tokenizers, name):
    tokenizer = tokenizers[name]
    assert fidelity.outcomes(tokenizer, name, "tools") + fidelity.outcomes(tokenizer, name, "chat") == EXPECTED[name]


@pytest.mark.parametrize("scenario", ["tools", "chat"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_rollout_splits_exactly_where_the_template_does_not_extend(tokenizers, name, scenario):
    tokenizer = tokenizers[name]
    extra_info, prompt, actions = fidelity.SCENARIOS[scenario]
    expected = EXPECTED[name][:2] if scenario == "tools" else EXPECTED[name][2:]
    policy = ScriptedPolicy(tokenizer, fidelity.end_token(tokenizer, name), actions)
    rollout = EnvRollout(policy, load_env(fidelity.env_path(scenario)), tokenizer, max_turns=len(actions),
                         tool_use=fidelity.tool_use_for(tokenizer, scenario))
    trajectory = asyncio.run(run_trajectory(rollout, prompt, dict(extra_info, messages=list(prompt)),
                                            {"max_new_tokens": 64}))
    # The turns the rollout reached: all of them, or up to the one whose next prompt the template refused.
    reached = expected.index("raises") + 1 if "raises" in expected else len(actions)
    assert trajectory.n_turns == reached
    if "raises" in expected:
        assert trajectory.fault.startswith("malformed next_state: the chat template raised")
    else:
        assert trajectory.fault is None and trajectory.stop_reason == "done"
    # A new sequence starts after each turn whose next prompt does not extend the one before and its action.
    starts = [sum(len(seq.turns) for seq in trajectory.sequences[:k]) for k in range(len(trajectory.sequences))]
    assert starts == [0] + [k + 1 for k, outcome in enumerate(expected[:reached - 1]) if outcome == "splits"]
    assert trajectory.split_turns == expected[:reached - 1].count("splits")
    # Whatever the splits, every sampled token is trained as sampled, and each sequence's prompt is the template's
    # rendering tokenised (its special tokens the template's own).
    assert [turn.action_ids for turn in trajectory.turns] == policy.sampled
    for seq in trajectory.sequences:
        assert seq.prompt_ids == tokenizer.encode(seq.prompt_text, add_special_tokens=False)
    assert rollout_metrics([[trajectory]])["rollout/split_turns"] == float(trajectory.split_turns)


def test_a_step_with_splits_names_the_template(tokenizers):
    tokenizer = tokenizers["qwen3"]
    extra_info, prompt, actions = fidelity.SCENARIOS["chat"]
    rollout = EnvRollout(ScriptedPolicy(tokenizer, "<|im_end|>", actions), load_env(fidelity.env_path("chat")),
                         tokenizer, max_turns=3)
    trajectory = asyncio.run(run_trajectory(rollout, prompt, dict(extra_info, messages=list(prompt)), {}))
    assert split_summary([[trajectory]], "Qwen/Qwen3-0.6B") == (
        "2 of 3 turns started a new sequence, their next prompt not extending the tokens sampled (the chat template "
        "of Qwen/Qwen3-0.6B re-rendered the conversation otherwise, or the environment's text state changed; "
        "rollout/split_turns, docs/agents.md \"Token in, token out\")")
    assert split_summary([[trajectory]], "x") is not None and split_summary([], "x") is None


def test_the_agents_page_has_the_table(capsys):
    benchmark_module("chat_template_fidelity").main()  # what `python benchmarks/chat_template_fidelity.py` prints
    assert capsys.readouterr().out.strip() in (REPO / "docs" / "agents.md").read_text()

