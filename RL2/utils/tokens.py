"""What a tokenizer's vocabulary bounds: the most characters one token stands for."""

import weakref

# tokenizer -> the most characters one of its tokens stands for (see `longest_token_chars`)
_LONGEST_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: no token decodes to more than its
    vocabulary string has (one character per byte for byte-level BPE, per character for SentencePiece)."""
    if tokenizer not in _LONGEST_TOKEN:
        _LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()))
    return _LONGEST_TOKEN[tokenizer]
