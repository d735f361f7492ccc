"""The task of envs/tool_use.py with its calculator served by an MCP server (envs/mcp_calculator.py, started
over stdio once per rank and closed at the end of the run); `search`, which reads the row's corpus from
extra_info, stays a plain Python tool. The model sees and calls the server's tools as it does RL2's own."""

import importlib.util
import sys
from pathlib import Path

# The task's search and scoring, from the environment script beside this one.
_spec = importlib.util.spec_from_file_location("tool_use_task", Path(__file__).with_name("tool_use.py"))
task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task)

search, step = task.search, task.step
TOOLS = [search]
MCP_SERVERS = [{"name": "calculator", "command": [sys.executable, str(Path(__file__).with_name("mcp_calculator.py"))]}]
