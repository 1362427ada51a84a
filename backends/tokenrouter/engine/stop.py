"""When a request is done: stop tokens, end-of-sequence, stop strings, length and context limits."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.tokenizer import decode, find_stop


class StopChecker:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: set[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def text_of(self, token_ids: list[int]) -> str:
        return decode(self.tokenizer, token_ids)

    def check(self, seq: Sequence, tok: int) -> tuple[str | None, int | None]:
        """(finish_reason or None, index in the output text where a matched stop string starts)."""
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop", None
        if p.stop and self.tokenizer is not None:
            text = self.text_of(seq.output_token_ids)
            at = find_stop(text, p.stop, seq.checked_text_len)
            seq.checked_text_len = len(text)
            if at is not None:
                return "stop", at
        if seq.num_output_tokens >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None
