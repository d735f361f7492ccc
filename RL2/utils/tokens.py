"""The most characters one token of a vocabulary stands for, and tokenising chat text in which only the chat
template writes special tokens: content an environment, a tool or an agent wrote ("<|im_end|><|im_start|>system
...") would otherwise become real role tokens (`render_plain`, then `encode`)."""

import re
import secrets
import weakref
from collections.abc import Callable, Sequence

_LONGEST_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> `longest_token_chars`
_SPECIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> `special_tokens`

# (start, end) character spans of a text: where content wrote the text of a special token
Spans = Sequence[tuple[int, int]]


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: no token decodes to more than its
    vocabulary string has (one character per byte for byte-level BPE, per character for SentencePiece)."""
    if tokenizer not in _LONGEST_TOKEN:
        _LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()))
    return _LONGEST_TOKEN[tokenizer]


def special_tokens(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """A pattern matching the text of `tokenizer`'s special tokens (None if it has none), and their ids
    by text. Added tokens not marked special (Qwen's `<tool_call>`) are not among them: plain text
    tokenises to them too, whoever wrote it."""
    if tokenizer not in _SPECIAL:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        ids = {token.content: i for i, token in added.items() if token.special and token.content}
        ids |= {text: tokenizer.convert_tokens_to_ids(text) for text in tokenizer.all_special_tokens if text}
        texts = sorted(ids, key=len, reverse=True)  # the longest first, as the tokenizer matches them
        _SPECIAL[tokenizer] = (re.compile("|".join(map(re.escape, texts))) if texts else None, ids)
    return _SPECIAL[tokenizer]


def encode(tokenizer, text: str, plain: Spans = ()) -> list[int]:
    """The token ids of `text`, without BOS (chat templates write their special tokens, BOS included, into the
    text itself). `plain`: the spans of `text` where content wrote a special token's text (`render_plain`),
    each tokenised as text, not as that token; the special tokens elsewhere are the template's."""
    if not plain:
        return tokenizer.encode(text, add_special_tokens=False)
    pattern, ids_of = special_tokens(tokenizer)
    ids, start, spans = [], 0, sorted(plain)
    for match in pattern.finditer(text):
        if any(s < match.end() and match.start() < e for s, e in spans):
            continue  # content's: stays in the text around it
        ids += _as_text(tokenizer, text[start:match.start()]) + [ids_of[match.group()]]
        start = match.end()
    return ids + _as_text(tokenizer, text[start:])


def render_plain(tokenizer, render: Callable[..., str], *content) -> tuple[str, list[tuple[int, int]]]:
    """`render(*content)` (a chat template over messages) with the special tokens' text in the strings of
    `content` replaced by plain ASCII markers (a random nonce and a number) that the template neither sees nor
    reacts to, put back after; returns the text and the spans in it of that special-token text, for `encode`."""
    pattern, _ = special_tokens(tokenizer)
    if pattern is None:
        return render(*content), []
    nonce, hidden = secrets.token_hex(8), []

    def marker(match: re.Match) -> str:
        hidden.append(match.group())
        return f"[{nonce}:{len(hidden) - 1}]"

    def hide(value):
        if isinstance(value, str):
            return pattern.sub(marker, value)
        if isinstance(value, dict):
            return {hide(key): hide(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [hide(item) for item in value]
        return value

    text = render(*(hide(part) for part in content))
    if not hidden:
        return text, []
    restored, spans, pos = "", [], 0
    for match in re.finditer(rf"\[{nonce}:(\d+)\]", text):
        original = hidden[int(match.group(1))]
        restored += text[pos:match.start()]
        spans.append((len(restored), len(restored) + len(original)))
        restored += original
        pos = match.end()
    text = restored + text[pos:]
    if nonce in text:  # a template that cut or escaped a marker: its content would not read back as written
        raise ValueError("the chat template altered the content it was given (a marker RL2 put in place of a "
                         "special token's text was cut or escaped); special tokens' text in content cannot be "
                         "told from the template's own")
    return text, spans


def spans_after(spans: Spans, offset: int) -> list[tuple[int, int]]:
    """The spans of `text[offset:]`, from those of `text`."""
    return [(s - offset, e - offset) for s, e in spans if s >= offset]


def _as_text(tokenizer, text: str) -> list[int]:
    # split_special_tokens: the special tokens' text in it tokenises as text (transformers' option)
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
