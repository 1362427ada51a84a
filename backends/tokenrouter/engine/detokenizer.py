"""Incremental detokenization: the text of a growing token stream, with work per token independent of its
length.

Decoding the whole output on every token is quadratic. A `Detokenizer` decodes only a short window: a few
tokens of context before the newest ones (decoders that look at a neighbour, like a SentencePiece word's
leading space, still see it) plus what it has not emitted yet. The text is
`decode(window)[done:]`, where `done` counts the window's characters that are context or already emitted.

Incomplete UTF-8. A byte-level BPE token may end inside a character; the decoder then shows U+FFFD for the
bytes so far. Those characters are held back, but boundedly: a character has at most 4 bytes, so once
`MAX_HOLD` tokens have gone by with the text still ending in U+FFFD, everything but the last character is
emitted (all but the last can only be invalid bytes), and a stream can never stall.

What holds. For the byte-level decoders we ship (ByteLevel BPE, including its invalid-byte sequences, and
the concatenating bench tokenizer), the text emitted by `push` and `flush` put together is exactly
`tokenizer.decode(all_ids, skip_special_tokens=True)`: that decode is a lossy UTF-8 decode of the tokens'
bytes, in which only the last character (one U+FFFD for a truncated sequence of at most 3 bytes) can still
change when bytes are appended, and `push` never emits that character. Between pushes at most the U+FFFD
characters of the last `MAX_HOLD` tokens are held, and after that at most one character. Other decoders
are not tested here: the context tokens give a SentencePiece word its leading space as in vLLM, and with
byte fallback (each byte of an incomplete sequence its own U+FFFD) a text that keeps ending in invalid
bytes for more than `MAX_HOLD` tokens may show a character differently from a full decode.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tokenrouter.tokenizer import decode

REPLACEMENT = "\ufffd"
# Tokens kept before the unread ones after compaction: more than the 3 tokens an incomplete UTF-8 sequence
# can span (each kept token has at least one byte), so the sequence never loses its lead byte.
CONTEXT = 4
# Tokens a trailing run of U+FFFD is held whole before only its last character is held.
MAX_HOLD = 4


def special_ids(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(i for i, tok in added.items() if getattr(tok, "special", False))


class Detokenizer:
    """One request's text, token by token (see the module docstring for what is exact)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        # Dropped on arrival: they decode to nothing, and keeping them out means every window token has
        # at least one byte (so CONTEXT tokens always cover an incomplete character) and runs of them do
        # not grow the window.
        self._special = special_ids(tokenizer)
        self._window: list[int] = []
        self._text = ""  # decode(self._window), as of the last decode
        self._done = 0  # characters of _text that are context or already emitted
        self._pending = 0  # window tokens since the text last ended in a complete character

    @property
    def held(self) -> str:
        """The text decoded but not emitted yet (trailing U+FFFD of a possibly incomplete character)."""
        return self._text[self._done :]

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly emitted text."""
        if self.tokenizer is None:
            return ""
        ids = [t for t in token_ids if t not in self._special]
        if not ids:
            return ""
        self._window.extend(ids)
        text = decode(self.tokenizer, self._window)
        if text.endswith(REPLACEMENT):
            self._pending += len(ids)
            # Young: the whole run may be a multi-byte character still arriving. Old: only its last
            # character can still change.
            stable = len(text) - 1 if self._pending > MAX_HOLD else len(text.rstrip(REPLACEMENT))
        else:
            self._pending = 0
            stable = len(text)
        out = text[self._done : stable]
        self._text, self._done = text, max(self._done, stable)
        self._compact()
        return out

    def flush(self) -> str:
        """The held text (the stream ended): emitted as it decodes now."""
        out = self.held
        self._done, self._pending = len(self._text), 0
        return out

    def prime(self, token_ids: list[int]) -> str:
        """Start mid-stream: take `token_ids` as already seen, with one decode of them (the caller bounds
        them). Returns their text less what `push` would still hold; if they start inside a character, it
        begins with a few U+FFFD that a full decode would not show."""
        self._window = [t for t in token_ids if t not in self._special]
        self._text = decode(self.tokenizer, self._window) if self.tokenizer is not None else ""
        self._pending = 1 if self._text.endswith(REPLACEMENT) else 0
        self._done = len(self._text.rstrip(REPLACEMENT))
        out = self._text[: self._done]
        self._compact()
        return out

    def _compact(self) -> None:
        """Drop all but CONTEXT tokens of the window once at most one character is held.

        With one held character, its bytes lie in the last 3 tokens, so the shorter window still decodes
        it the same; if the kept tokens start inside a character, they begin with U+FFFD that counts as
        context and is never emitted."""
        held = len(self._text) - self._done
        if len(self._window) <= 2 * CONTEXT or held > 1:
            return
        self._window = self._window[-CONTEXT:]
        self._text = decode(self.tokenizer, self._window)
        self._done = max(0, len(self._text) - held)
