"""The viewer in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; nothing is downloaded):
over the save_dir of a 2-step CPU PPO run (tests/data/viewer_run: samples.jsonl with tokens and metrics.jsonl, from
the run whose command its README gives) the page shows a trajectory's text and reward, colours its tokens, keeps a
`<script>` of the model's or the environment's text as text that never runs, follows new steps, and works as a
saved page (`--html`). It takes the screenshot of docs/outputs.md: into the test's folder, and into docs/viewer.png
when RL2_UPDATE_SCREENSHOT=1 (the checkout is left as it was otherwise)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from RL2.viewer.export import export_html
from RL2.viewer.server import serve
from tests.helpers import REPO

CHROMIUM = Path("/usr/bin/chromium")
RUN = REPO / "tests" / "data" / "viewer_run"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: apt-get install chromium "
                                "(.ci/run installs it)")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def save_dir(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(RUN, folder)
    return folder


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    page.close()
    assert errors == [], errors


def ready(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=10_000)


def open_first_with_markup(page) -> dict:
    records = [json.loads(line) for line in (RUN / "samples.jsonl").read_text().splitlines()]
    page.fill("#f-q", "<script>")
    page.wait_for_selector("#samples tbody tr")
    page.click("#samples tbody tr >> nth=0")
    page.wait_for_selector("#detail .bubble")
    return records[int(page.get_attribute("#samples tbody tr >> nth=0", "data-id"))]


def test_the_page_shows_a_trajectory_colours_its_tokens_and_runs_none_of_its_text(page, save_dir, tmp_path):
    server = serve(save_dir, 0)
    try:
        ready(page, f"http://127.0.0.1:{server.server_address[1]}/")
        assert page.locator("#curves svg").count() >= 1  # rollout/reward by default
        page.hover("#curves svg >> nth=0")
        assert "step" in page.text_content("#curves .tip")
        assert page.locator("#steps tbody tr").count() == 2

        record = open_first_with_markup(page)
        chat = page.text_content("#chat")
        assert record["turns"][0]["action"] in chat and "<script>window.__rl2_injected = 1</script>" in chat
        assert page.locator("#chat script, #chat b").count() == 0  # shown as text, not parsed as markup
        assert page.evaluate("window.__rl2_injected === undefined && window.__pwned === undefined")
        assert f"{record['reward']:.3g}"[:4] in page.text_content("#detail .meta")

        for mode in ("mask", "adv", "logp", "mismatch", "version"):
            page.check(f"#mode-{mode}")
            coloured = page.locator("#chat .tok").evaluate_all("s => s.filter(x => x.style.background).length")
            assert page.locator("#chat .tok").count() == len(record["tokens"]["text"]) and coloured > 0, mode
        page.check("#mode-adv")
        update = os.environ.get("RL2_UPDATE_SCREENSHOT") == "1"
        shot = REPO / "docs" / "viewer.png" if update else tmp_path / "viewer.png"
        page.locator("#detail-section").screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000

        page.click("#show-group")
        page.wait_for_selector("#compare .compare-grid > div")
        assert page.locator("#compare .compare-grid > div").count() == 4  # responses_per_prompt
        assert page.evaluate("window.__rl2_injected === undefined")

        # Live: a step the running job appends shows up without a reload.
        lines = (save_dir / "samples.jsonl").read_text().splitlines()
        step3 = [json.dumps(json.loads(line) | {"step": 3}) for line in lines[:2]]
        with open(save_dir / "samples.jsonl", "a") as f:
            f.write("\n".join(step3) + "\n")
        playwright.expect(page.locator("#steps tbody tr")).to_have_count(3, timeout=10_000)
    finally:
        server.shutdown()


def test_the_saved_page_works_offline_and_runs_none_of_its_text(page, save_dir, tmp_path):
    out = export_html(save_dir, tmp_path / "viewer.html")
    ready(page, out.as_uri())
    assert page.locator("#samples tbody tr").count() > 0
    record = open_first_with_markup(page)
    assert record["prompt"].split("<script>")[0][-20:] in page.text_content("#chat")
    page.select_option("#f-fault", "yes")
    page.wait_for_selector("#page-info:has-text('none')")
    assert page.evaluate("window.__rl2_injected === undefined && window.__pwned === undefined")
