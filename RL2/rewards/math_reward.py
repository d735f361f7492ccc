"""Math answers: the response's final answer against `extra_info["answer"]`, compared symbolically by Hugging
Face's `math-verify` (`pip install math-verify`, or 'RL2[math]'), else as normalised strings (docs/rewards.md)."""

import re
import threading
from fractions import Fraction

from RL2.rewards.extract import last_boxed, last_match

BOXED = "boxed"  # `pattern` value: the last \boxed{...}


def math_reward(response: str, extra_info: dict, *, pattern: str | None = BOXED, answer_key: str = "answer") -> float:
    """1.0 when the response's final answer equals `extra_info[answer_key]`, else 0.0. The answer by `pattern`:
    `BOXED` (default) the last \\boxed{...}; a regular expression its last match (first group if any); None the
    whole response, from which math-verify picks the answer itself (its last \\boxed, else the last expression)."""
    if answer_key not in extra_info:
        raise KeyError(f"extra_info has no '{answer_key}' (the reference answer); it has {sorted(extra_info)}")
    gold = str(extra_info[answer_key])
    if pattern is None:
        return float(_equal(response, gold, response, f"${gold}$"))
    answer = last_boxed(response) if pattern == BOXED else last_match(response, pattern)
    return float(answer is not None and answers_equal(answer, gold))


def answers_equal(answer: str, gold: str) -> bool:
    """Whether an extracted answer (no \\boxed around it) and the reference answer are the same:
    math-verify when installed, else normalised strings."""
    return _equal(answer, gold, f"\\boxed{{{answer}}}", f"\\boxed{{{gold}}}")


def require_math_verify() -> None:
    """Raise a clear ImportError when math-verify is missing (for scripts that need its extraction)."""
    if _math_verify() is None:
        raise ImportError("this needs the math-verify package: pip install math-verify (or 'RL2[math]')")


def normalise_answer(text: str) -> str:
    """A canonical string of an answer, for comparing without math-verify: drops spaces, `$`, `\\left`/`\\right`,
    thin spaces, `\\text{...}` markers, degree and percent signs, a trailing period and thousands separators;
    `\\dfrac`/`\\tfrac` become `\\frac`; a number or a fraction of integers becomes its value (`0.50`, `1/2` and
    `\\frac{1}{2}` all become `0.5`)."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}", "\\%", "%", "\\$", "$"):
        s = s.replace(noise, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"^(-?)\\frac\{?(-?\d+)\}?\{?(\d+)\}?$", r"\1\2/\3", s)  # \frac{1}{2}, \frac12, -\frac{1}{2}
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):  # not a plain number: compare the text
        return s
    return str(int(value)) if value.denominator == 1 else repr(float(value))


def _equal(answer: str, gold: str, answer_text: str, gold_text: str) -> bool:
    """math-verify on `answer_text` and `gold_text` when installed, else `answer` and `gold` normalised."""
    math_verify = _math_verify()
    if math_verify is None:
        return normalise_answer(answer) == normalise_answer(gold)
    # math-verify bounds its time with SIGALRM, which Python allows only in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(gold_text, parsing_timeout=timeout)
    answer = math_verify.parse(answer_text, parsing_timeout=timeout)
    # Unparsable text is no match, not an error.
    return bool(math_verify.verify(gold, answer, timeout_seconds=timeout))


def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify
