"""Run a trainer with a recording wrapper around its learning-curve drawing.

`python record_learning_curve.py RECORD.jsonl sft key=value ...` runs `RL2.trainer.sft` as its command
line would; every call of `RL2.utils.plot.draw_learning_curve` appends what it was given (the panels
and their series) to RECORD.jsonl, then the real function draws the PNG.
"""

import importlib
import json
import sys

import RL2.utils.plot as plot

record_path, trainer_name, *overrides = sys.argv[1:]
draw = plot.draw_learning_curve


def recording_draw(panels, path, title):
    call = {"path": str(path), "title": title,
            "panels": [{"title": panel.title, "series": series} for panel, series in panels]}
    with open(record_path, "a") as f:
        f.write(json.dumps(call) + "\n")
    draw(panels, path, title)


plot.draw_learning_curve = recording_draw
importlib.import_module(f"RL2.trainer.{trainer_name}").main(overrides)
