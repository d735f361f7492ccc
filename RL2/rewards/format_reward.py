"""Format rewards: a regular expression, or a structure of tags with partial credit."""

import re

THINK_ANSWER = ("think", "answer")


def tags_reward(response: str, extra_info: dict | None = None, *, tags: tuple[str, ...] = THINK_ANSWER) -> float:
    """How well the response follows `<t1>...</t1> <t2>...</t2> ...` (default: think, then answer): `0.5 /
    len(tags)` for each tag that appears as exactly one `<t>` followed later by exactly one `</t>`, and the other
    half for the tags in this order with nothing but whitespace around and between them (docs/rewards.md)."""
    if not tags:
        raise ValueError("tags_reward needs at least one tag")
    well_formed = sum(_once_in_order(response, f"<{tag}>", f"</{tag}>") for tag in tags)
    structure = r"\s*".join(f"<{re.escape(tag)}>.*?</{re.escape(tag)}>" for tag in tags)
    if well_formed == len(tags) and re.fullmatch(rf"\s*{structure}\s*", response, re.DOTALL):
        return 1.0
    return 0.5 * well_formed / len(tags)


def _once_in_order(text: str, opening: str, closing: str) -> bool:
    return text.count(opening) == 1 and text.count(closing) == 1 and text.index(opening) < text.index(closing)


def regex_reward(response: str, extra_info: dict | None = None, *, pattern: str, fullmatch: bool = False) -> float:
    """1.0 when the response matches the regular expression `pattern` (`.` matches newlines; with
    `fullmatch`, the whole response must match), else 0.0."""
    match = re.fullmatch if fullmatch else re.search
    return float(match(pattern, response, re.DOTALL) is not None)
