"""Tokenizer loading and stop-string detection on the decoded output."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer in `path`, or None when the folder has none (dummy-weight benchmarks use token ids)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def decode(tokenizer: PreTrainedTokenizerBase | None, token_ids: list[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def find_stop(text: str, stops: list[str], search_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only where new text could complete one."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
