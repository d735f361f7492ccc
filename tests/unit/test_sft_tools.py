"""SFT on OpenAI-format tool conversations: the tokens are those the rollout records for the same
conversation, the loss is on the assistant turns (their calls included) and never on tool results.

The expected tokens are built independently, as test_tool_use.py builds a rollout's: the conversation written
out by hand in RL2's default format (the default model's template shows no tools: the Hermes-style system
block, each call as the policy writes it, results as <tool_response> user turns), rendered by the chat template,
and laid out as the rollout records it (the prompt, each action, then the template's text after it).
"""

import json

import pytest
from omegaconf import OmegaConf

from RL2.config.schema import DataConfig
from RL2.datasets.loading import DataError
from RL2.datasets.splits import load_splits
from RL2.trainer.sft import sft_rows

SCHEMA = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "a factor"},
                                                    "b": {"type": "integer", "description": "a factor"}},
                   "required": ["a", "b"]}}}
QUESTION = {"role": "user", "content": "What is 123 times 456?"}
ROW = {"tools": [SCHEMA], "messages": [
    {"role": "system", "content": "Be brief."},
    QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 123, "b": 456}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "name": "multiply", "content": "56088"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 456, "b": 123}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "multiply", "content": "56088"},
    {"role": "assistant", "content": "56088."},
]}


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def examples(tok, tmp_path, rows) -> list[dict]:
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"train": {"path": write_rows(tmp_path, rows)}})
    return load_splits(cfg, sft_rows(tok), seed=0)[0]


def test_a_tool_conversation_has_the_rollouts_tokens_and_trains_only_the_assistant(tok, tmp_path):
    [example] = examples(tok, tmp_path, [ROW])
    system = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n"
              f"<tools>\n{json.dumps(SCHEMA)}\n</tools>\n\n"
              "For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n"
              '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
              "The results come back within <tool_response></tool_response> XML tags.\n\nBe brief.")
    actions = ['<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n</tool_call>',
               'Let me check.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 456, "b": 123}}\n</tool_call>',
               "56088."]
    messages = [{"role": "system", "content": system}, QUESTION]
    prompts = [tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)]
    for action in actions[:2]:
        messages += [{"role": "assistant", "content": action},
                     {"role": "user", "content": "<tool_response>\n56088\n</tool_response>"}]
        prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": actions[2]}], tokenize=False)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    end_of_turn = encode("<|im_end|>\n")  # what the template writes after an assistant's content: trained too
    # The rollout's record: the prompt, then per action its tokens and the template's text after it.
    ids, mask = encode(prompts[0]), [0] * len(encode(prompts[0]))
    for k, action in enumerate(actions):
        ids += encode(action) + end_of_turn
        mask += [1] * len(encode(action) + end_of_turn)
        after = (prompts[k + 1] if k < 2 else whole)[len(prompts[k]) + len(action) + len("<|im_end|>\n"):]
        ids, mask = ids + encode(after), mask + [0] * len(encode(after))
    assert tok.decode(ids) == whole
    assert example["input_ids"] == ids and example["loss_mask"] == mask
    trained = tok.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])
    assert "56088\n" not in trained.replace("56088.", "")  # no tool result is trained on


@pytest.mark.parametrize("change, message", [
    (lambda ms: ms.pop(2), r"message 2 is a tool result with no tool call before it"),
    (lambda ms: ms[2]["tool_calls"][0]["function"].update(name="divide"),
     r"message 2 calls tool 'divide', which the row's tools do not declare \(they are: multiply\)"),
    (lambda ms: ms[2]["tool_calls"][0]["function"].update(arguments="{a: 1"), r"message 2 call 0 \(multiply\) has "
                                                                             r"arguments that are not JSON"),
])
def test_a_bad_tool_conversation_names_its_file_and_row(tok, tmp_path, change, message):
    bad = json.loads(json.dumps(ROW))
    change(bad["messages"])
    with pytest.raises(DataError, match=rf"sft\.jsonl row 1: key 'messages' {message}"):
        examples(tok, tmp_path, [ROW, bad])


def test_a_call_without_the_tools_column_is_an_unknown_tool(tok, tmp_path):
    with pytest.raises(DataError, match=r"row 0: .*calls tool 'multiply', which the row's tools do not declare "
                                        r"\(they are: none\)"):
        examples(tok, tmp_path, [{"messages": ROW["messages"]}])


def test_a_tool_without_a_name_is_refused(tok, tmp_path):
    with pytest.raises(DataError, match=r"row 0: the row's tool 0 has no name; write OpenAI schemas"):
        examples(tok, tmp_path, [ROW | {"tools": [{"description": "Multiply."}]}])
