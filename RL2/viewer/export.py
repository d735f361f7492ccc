"""The viewer as one self-contained HTML file (`python -m RL2.viewer SAVE_DIR --html FILE`): the page's CSS and
JS inline and the run's records embedded, for a run on a machine whose ports cannot be reached."""

import json
from pathlib import Path

from RL2.viewer.run import Run
from RL2.viewer.server import STATIC


def embedded_json(data) -> str:
    """`data` as JSON that an HTML parser cannot end early: inside `<script type="application/json">` a `</script>`
    (or `<!--`, which changes how the rest is parsed) in the model's text would end the element and let the rest
    run as markup. Every `<` is written as its JSON escape `\\u003c`, which `JSON.parse` reads back as `<`."""
    return json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")


def export_html(save_dir: str | Path, out: str | Path, max_samples: int | None = None) -> Path:
    """Write the page over `save_dir` with every sample (the first `max_samples`) and metric inside it."""
    run = Run(save_dir)
    n = len(run.rows) if max_samples is None else min(max_samples, len(run.rows))
    data = {"status": run.status(), "metrics": run.metrics(), "samples": [run.sample(i) for i in range(n)]}
    page = (STATIC / "index.html").read_text()
    style = (STATIC / "style.css").read_text()
    page = page.replace('<link rel="stylesheet" href="style.css">', f"<style>\n{style}</style>")
    script = (STATIC / "app.js").read_text().replace("</", "<\\/")
    page = page.replace('<script src="app.js"></script>',
                        f'<script type="application/json" id="rl2-data">{embedded_json(data)}</script>\n'
                        f"<script>\n{script}</script>")
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out
