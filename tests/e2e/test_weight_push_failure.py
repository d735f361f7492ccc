"""A rank that cannot write the weights for its SGLang servers fails the push on every rank with its
reason, instead of leaving the ranks' all-gathers out of step."""

import json

from tests.helpers.launch import run_ranks


def test_a_failed_weight_folder_raises_the_writers_error_on_every_rank(tiny_model_path, tmp_path):
    run_ranks(2, ["tests/e2e/scripts/push_folder_failure.py", tiny_model_path, str(tmp_path)], timeout=120)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["rank"] for report in reports] == [0, 1]
    for report in reports:
        assert report["raised"].startswith("EngineError: rank 0 could not write the weights to "), report
        assert "File too large" in report["raised"], report
