"""When a request is done: stop tokens, end-of-sequence, stop strings, length and context limits."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tokenrouter.engine.detokenizer import MAX_HOLD, Detokenizer
from tokenrouter.engine.sequence import Sequence
from tokenrouter.tokenizer import find_stop


class TextTail:
    """The newest text of a token stream, for a search that only needs its last few characters (stop
    strings, a lease's stop pattern): an incremental detokenizer over the stream plus the last `keep`
    characters emitted before the newest token's text. Work per token does not grow with the stream.

    A request moves between models, so the stream can grow by tokens committed elsewhere while it was
    away: a few are caught up with one push, many by restarting from a bounded tail of the stream."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, keep: int) -> None:
        self.tokenizer = tokenizer
        self.keep = keep
        self.detok = Detokenizer(tokenizer)
        self.num_tokens = 0  # stream tokens pushed so far
        self.tail = ""
        self.search_from = 0  # where the newest token's text starts in the last `update`'s result
        # Each token has at least one byte and a character at most 4, so this many tokens decode to
        # more than `keep` characters beyond the few U+FFFD of a window that starts inside a character
        # and the held characters of its last MAX_HOLD tokens.
        self.restart_tokens = 4 * (keep + 4) + MAX_HOLD

    def _kept(self, text: str) -> str:
        return text[max(0, len(text) - self.keep) :]

    def update(self, token_ids: list[int], begin: int, extra: int | None = None) -> str:
        """The stream is `token_ids[begin:]`, then `extra` if given; its last token is the newest. Returns up
        to `keep` characters of text before the newest token's, then that token's text (from
        `search_from`); `detok.held` is what follows it in a full decode."""
        end = len(token_ids)
        n = end - begin + (extra is not None)
        behind = n - 1 - self.num_tokens  # older tokens this tail has not seen
        if not 0 <= behind <= self.restart_tokens:
            self.detok = Detokenizer(self.tokenizer)
            older_end = begin + n - 1
            self.tail = self._kept(self.detok.prime(token_ids[max(begin, older_end - self.restart_tokens) : older_end]))
        elif behind:
            self.tail = self._kept(self.tail + self.detok.push(token_ids[begin + self.num_tokens : begin + n - 1]))
        new = self.detok.push([extra if extra is not None else token_ids[end - 1]])
        self.num_tokens = n
        self.search_from = len(self.tail)
        text = self.tail + new
        self.tail = self._kept(text)
        return text


class StopChecker:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: set[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, tok: int) -> tuple[str | None, int | None]:
        """(finish_reason or None, characters to drop from the end of the output text through `tok`: the
        matched stop string and what follows it). `tok` is already the last of `seq.token_ids`."""
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop", None
        if p.stop and self.tokenizer is not None:
            trim = self._stop_string(seq, p.stop)
            if trim is not None:
                return "stop", trim
        if seq.num_output_tokens >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _stop_string(self, seq: Sequence, stops: list[str]) -> int | None:
        # Created on the first check here, so requests without stop strings never decode.
        if seq.stop_text is None:
            seq.stop_text = TextTail(self.tokenizer, max(map(len, stops)) - 1)
        tail = seq.stop_text
        text = tail.update(seq.token_ids, seq.num_prompt_tokens)
        at = find_stop(text, stops, tail.search_from)
        return None if at is None else len(text) - at + len(tail.detok.held)

    def lease_done(self, seq: Sequence, tok: int) -> bool:
        """Whether the text produced under `seq.lease` (since `lease.start`), with `tok` not yet appended,
        now ends with the lease's stop pattern."""
        lease = seq.lease
        assert lease is not None and lease.stop_pattern is not None
        if seq.lease_text is None or seq.lease_text[0] is not lease:
            seq.lease_text = (lease, TextTail(self.tokenizer, len(lease.stop_pattern)))
        tail = seq.lease_text[1]
        text = tail.update(seq.token_ids, lease.start, tok) + tail.detok.held
        return text.endswith(lease.stop_pattern)
