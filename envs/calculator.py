"""Multi-turn tool use: the model may write <calculate>expression</calculate> and gets
<result>value</result> back in the same sequence; <answer>N</answer> ends the episode with reward 1
if N equals `extra_info["answer"]`, else 0. Sample with stop=["</calculate>", "</answer>"]."""

import ast
import operator
import re

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 200


def evaluate(node: ast.AST) -> float:
    """Value of numbers combined with + - * / and unary minus; anything else raises ValueError."""
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(expression: str) -> str:
    if len(expression) > MAX_EXPRESSION_CHARS:
        return "error: expression too long"
    try:
        value = evaluate(ast.parse(expression.strip(), mode='eval').body)
    # What model-written text can raise: bad syntax, forbidden nodes, division by zero, overflow.
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    # Integers exactly, floats to the 15 digits a float holds (`:g` keeps 6: 1234*5678 read 7.00665e+06).
    return str(value) if isinstance(value, int) else f"{value:.15g}"


def same_number(written: str, answer: str) -> bool:
    try:
        return float(written) == float(answer)
    except ValueError:  # the model wrote something that is not a number
        return False


async def step(state: str, action: str, extra_info: dict) -> dict:
    answers = re.findall(r"<answer>(.*?)</answer>", action, re.DOTALL)
    calls = re.findall(r"<calculate>(.*?)</calculate>", action, re.DOTALL)
    if calls and not answers:
        next_state = state + action + f"\n<result>{calculate(calls[-1])}</result>\n"
        return {"next_state": next_state, "reward": 0.0, "score": 0.0, "done": False, "extra_info": extra_info}
    correct = bool(answers) and same_number(answers[-1], str(extra_info["answer"]))
    reward = float(correct)
    return {"next_state": state + action, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
