"""The viewer's JSON endpoints over a made-up samples.jsonl (filters, pagination, a run that grows or is rewritten),
its self-contained page (data embedded so that no text of the run can end its <script>), and the per-token
columns save_samples writes with rollout.save_sample_tokens."""

import json
import re
import urllib.error
import urllib.request

import pytest
import torch

from RL2.rollout.metrics import save_samples
from RL2.rollout.sample_tokens import sample_tokens
from RL2.rollout.trajectory import Trajectory, Turn, training_batch
from RL2.viewer.export import embedded_json, export_html
from RL2.viewer.run import Run
from RL2.viewer.server import serve


def record(step, group, reward, **extra):
    return {"step": step, "group": group, "prompt": f"prompt {group}", "response": f"answer {step}.{group} {reward}",
            "reward": reward, "score": reward, "n_turns": 1, "finish_reason": "stop", "stop_reason": "done",
            "fault": None} | extra


def write(path, records, mode="w"):
    with open(path, mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def save_dir(tmp_path):
    records = [record(step, g, float(g == k), data_source="a" if g else "b")
               for step in (1, 2) for g in range(3) for k in range(2)]
    records[0] |= {"fault": "step raised ValueError", "reward": 0.0}
    records[1] |= {"tool_calls": 2, "tool_errors": 1, "parse_errors": 0, "n_sequences": 2,
                   "tokens": {"n_tokens": 1, "text": ["</script>"], "mask": [1], "logp": [-0.5], "version": [0]}}
    write(tmp_path / "samples.jsonl", records)
    write(tmp_path / "metrics.jsonl", [{"step": 1, "rollout/reward": 0.5}, {"step": 2, "rollout/reward": 0.7}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollo')  # a line still being written
    return tmp_path


@pytest.fixture
def get(save_dir):
    server = serve(save_dir, 0)
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path):
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return json.loads(response.read()) if path.startswith("/api/") else response.read().decode()

    yield get
    server.shutdown()


def test_filters_and_pages(get):
    assert get("/api/samples")["total"] == 12
    assert [r["id"] for r in get("/api/samples?step=2&min_reward=0.5")["rows"]] == [6, 9]
    assert [r["id"] for r in get("/api/samples?fault=yes")["rows"]] == [0]
    assert get("/api/samples?fault=no")["total"] == 11
    assert [r["id"] for r in get("/api/samples?source=b")["rows"]] == [0, 1, 6, 7]
    assert [r["id"] for r in get("/api/samples?tool_errors=1")["rows"]] == [1]
    assert [r["id"] for r in get("/api/samples?split=1")["rows"]] == [1]
    assert [r["id"] for r in get("/api/samples?q=ANSWER%202.1")["rows"]] == [8, 9]
    page = get("/api/samples?offset=10&limit=5")
    assert page["total"] == 12 and [r["id"] for r in page["rows"]] == [10, 11]
    assert get("/api/samples?step=1&max_reward=0")["total"] == 5
    row = get("/api/samples?limit=2")["rows"][1]
    assert row["has_tokens"] and "tokens" not in row and row["snippet"] == "answer 1.0 0.0"


def test_records_steps_groups_and_metrics(get):
    assert get("/api/sample?id=1")["tokens"]["text"] == ["</script>"]
    assert get("/api/sample?id=99") is None
    assert [r["reward"] for r in get("/api/group?step=2&group=1")] == [0.0, 1.0]
    assert [r["step"] for r in get("/api/same_prompt?id=3")] == [1, 1, 2, 2]
    steps = get("/api/steps")
    assert [(s["step"], s["n"], s["faults"]) for s in steps] == [(1, 6, 1), (2, 6, 0)]
    assert steps[1]["reward"] == pytest.approx(2 / 6) and steps[1]["reward_max"] == 1.0
    assert get("/api/metrics") == [{"step": 1, "rollout/reward": 0.5}, {"step": 2, "rollout/reward": 0.7}]
    assert get("/api/status")["sources"] == ["a", "b"]
    assert "<script src=\"app.js\"></script>" in get("/") and "function openSample" in get("/app.js")
    for bad, code in (("/api/samples?step=x", 400), ("/api/nothing", 404), ("/../run.py", 404), ("/server.py", 404)):
        with pytest.raises(urllib.error.HTTPError, match=str(code)):
            get(bad)


def test_a_growing_run_is_followed_and_a_rewritten_one_read_again(save_dir, get):
    assert get("/api/status")["n_samples"] == 12
    with open(save_dir / "samples.jsonl", "a") as f:
        f.write(json.dumps(record(3, 0, 1.0)) + "\n" + json.dumps(record(3, 1, 0.0))[:20])  # the second: half-written
    assert get("/api/status")["steps"] == [1, 2, 3] and get("/api/status")["n_samples"] == 13
    write(save_dir / "samples.jsonl", [record(1, 0, 0.25)])  # a resume rewrote it
    assert get("/api/samples")["total"] == 1 and get("/api/sample?id=0")["reward"] == 0.25


def test_the_server_listens_on_loopback_only(save_dir):
    server = serve(save_dir, 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()


def test_the_saved_page_embeds_the_run_where_no_text_can_end_its_script(save_dir, tmp_path):
    hostile = "</script><script>alert(1)</script><!--<script>"
    assert "<" not in embedded_json({"x": hostile}) and json.loads(embedded_json({"x": hostile})) == {"x": hostile}
    page = export_html(save_dir, tmp_path / "page.html").read_text()
    data = re.search(r'<script type="application/json" id="rl2-data">(.*?)</script>', page, re.S).group(1)
    assert "</" not in data and json.loads(data)["samples"][1]["tokens"]["text"] == ["</script>"]
    assert len(json.loads(data)["samples"]) == 12 and 'src="' not in page and "href=\"style.css\"" not in page


def test_sample_tokens_line_up_with_the_trained_batch(tmp_path):
    """Each token's advantage and trainer log-prob are those of the batch at its position; the prompt is left out,
    and a trajectory's columns stop at the limit."""

    class Tokenizer:
        def batch_decode(self, ids):
            return [f"<{i[0]}>" for i in ids]

    def trajectory(reward):
        t = Trajectory(extra_info={"data_source": "s"})
        t.start_sequence("p", [1, 2])
        t.add_turn(Turn([3, 4], [-0.1, -0.2], "a", "stop", reward=reward, action_versions=[0, 0]))
        t.continue_sequence("o", [5])
        t.add_turn(Turn([6], [-0.3], "b", "length", action_versions=[1]))
        return t

    groups = [[trajectory(1.0), trajectory(0.0)]]
    batch = training_batch(groups, version=1)
    batch.tokens["advantages"] = torch.arange(batch.n_labels, dtype=torch.float32)
    batch.tokens["old_logps"] = -torch.arange(batch.n_labels, dtype=torch.float32) / 10
    columns = sample_tokens(groups, Tokenizer(), 3, groups, batch)
    # Labels of the second trajectory start at 5 (each has 6 tokens, 5 labels); token t is label t - 1.
    assert columns[1] == {"n_tokens": 4, "text": ["<3>", "<4>", "<5>"], "mask": [1, 1, 0], "logp": [-0.1, -0.2, 0.0],
                          "version": [0, 0, -1], "adv": [6.0, 7.0, 8.0], "trainer_logp": [-0.6, -0.7, -0.8]}
    save_samples(tmp_path / "samples.jsonl", groups, 1, columns)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [list(json.loads(line))[-1] for line in lines] == ["tokens", "tokens"]  # last: the viewer reads past it
    first = json.loads(lines[0])
    assert first["data_source"] == "s" and first["turns"][0]["observation"] == "o" and first["response_length"] == 3
    assert Run(tmp_path).rows[0]["has_tokens"] and Run(tmp_path).sample(1)["tokens"] == columns[1]
