"""Getting the answer out of a response: the last \\boxed{...}, the last <tag>...</tag>, the last
match of a pattern, or the Python code of a fenced block. Each returns None when there is none."""

import re

# \boxed and \fbox both mark a final answer in MATH-style solutions.
BOX_COMMANDS = ("\\boxed", "\\fbox")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_FENCES = ("python", "python3", "py")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included (`\\{` and `\\}` are
    literal braces); of `\\boxed 5` (no braces), the word after it. The last box left unclosed (a response cut at
    max_new_tokens) gives None: the final answer was never finished."""
    position, command = max((text.rfind(command), command) for command in BOX_COMMANDS)
    if position < 0:
        return None
    rest = text[position + len(command) :]
    if not rest.startswith("{"):
        word = re.match(r"\s+([^\s$]+)", rest)  # `\boxed 5`; `\boxed 5.` ends a sentence
        return word.group(1).rstrip(".,;:") or None if word else None
    depth, i = 0, 0
    while i < len(rest):
        char = rest[i]
        if char == "\\":  # an escaped character, such as a literal brace
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
        i += 1
    return None


def last_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last `<tag>...</tag>` (`tag` e.g. "answer")."""
    matches = re.findall(f"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return matches[-1].strip() if matches else None


def last_match(text: str, pattern: str | re.Pattern) -> str | None:
    """The last match of a regular expression: its first group if it has groups, else the whole match.
    In a `pattern` given as a string, `.` matches newlines too."""
    regex = re.compile(pattern, re.DOTALL) if isinstance(pattern, str) else pattern
    matches = list(regex.finditer(text))
    if not matches:
        return None
    return matches[-1].group(1) if regex.groups else matches[-1].group(0)


def extract_code(text: str) -> str:
    """The Python code of a response: its last ```python fence, else its last unlabelled fence, else the whole text."""
    fences = _FENCE.findall(text)
    for wanted in (PYTHON_FENCES, ("",)):
        blocks = [code for language, code in fences if language.lower() in wanted]
        if blocks:
            return blocks[-1]
    return text
