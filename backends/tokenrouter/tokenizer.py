"""Tokenizer loading and stop-string detection on the decoded output."""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer in `path`, or None when the folder has none (dummy-weight benchmarks use token ids)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A text prompt's token ids, as the engine (and the OpenAI frontend's counts) take them. Not verbose: a prompt
    over the context is refused by the caller with its own message, not logged by transformers as one that
    "will result in indexing errors"."""
    return tokenizer(text, verbose=False)["input_ids"]


@dataclass(frozen=True)
class PromptCharBound:
    """The most characters a text prompt may have to fit a context of `max_model_len` tokens: no token covers
    more characters than the longest vocabulary entry (a byte-level BPE entry has one character per byte), with
    a factor 4 for normalization that shrinks text. Checked before tokenizing: tokenizing megabytes stalls the
    thread (and memory) that does it, for a prompt the context could never hold."""

    max_model_len: int
    max_chars: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> PromptCharBound:
        """The bound for `tokenizer`; scans the vocabulary (tens of ms for 150k entries), so build it once."""
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        return cls(max_model_len, 4 * max_model_len * max(1, longest))

    def for_limit(self, max_model_len: int) -> PromptCharBound:
        """The same bound for another context limit (no second scan: the characters per token stay)."""
        return PromptCharBound(max_model_len, self.max_chars // self.max_model_len * max_model_len)

    def check(self, num_chars: int, what: str = "prompt") -> None:
        """ValueError naming the length and the bound when `num_chars` is over it."""
        if num_chars > self.max_chars:
            raise ValueError(
                f"{what} has {num_chars} characters, more than a context limit of {self.max_model_len} tokens can "
                f"hold (at most {self.max_chars} characters)"
            )


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
