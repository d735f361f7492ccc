"""Countdown (TinyZero): combine every number of `extra_info["numbers"]` once with + - * / to
reach `extra_info["target"]`; the equation goes in <answer></answer>. Reward 1 if right, else 0."""

import ast
import operator

from RL2.rewards import last_tag

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EQUATION_CHARS = 200  # keeps parsing cheap whatever the model writes


def evaluate(node: ast.AST) -> float:
    """Value of an expression of integer literals and + - * /; anything else raises ValueError."""
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise ValueError(f"not allowed in an equation: {ast.dump(node)[:60]}")


def is_correct(equation: str, numbers: list[int], target: int) -> bool:
    if len(equation) > MAX_EQUATION_CHARS:
        return False
    try:
        tree = ast.parse(equation, mode="eval").body
        used = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        return sorted(used) == sorted(numbers) and abs(evaluate(tree) - target) < 1e-6
    # What model-written text can raise: bad syntax, forbidden nodes, division by zero, constants that
    # do not sort with the numbers (a string).
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError):
        return False


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = last_tag(action, "answer")
    correct = answer is not None and is_correct(answer, extra_info["numbers"], extra_info["target"])
    reward = float(correct)
    return {"next_state": state + action, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
