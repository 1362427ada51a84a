"""A vocabulary-complete tokenizer for dummy-weight benchmarks: every token id is its own piece of text.

Dummy-weight deployments serve the real Qwen3 shapes (vocabulary 151,936) without a checkpoint, and no
tokenizer can be downloaded. A trained tokenizer of another size would drop or mangle most sampled ids, so
a served benchmark would stream almost no text. This one is generated in about a second, deterministically:
a `tokenizers` WordLevel model in which each id has a distinct, non-empty piece, decoding concatenates the
pieces (streaming one token streams one piece), and encoding the text of any id sequence gives the same ids
back (so tools that re-tokenize streamed text, like genai-perf, count exactly the tokens generated).

Pieces, by id:

- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at `special_start` .. +2: Qwen3's ids (151643..151645) by
  default, so Qwen3's config.json (bos 151643, eos 151645) and generation_config (eos 151645, 151643) name
  the same tokens. Special, as in Qwen3: the engine's decode (skip_special_tokens) shows no text for them.
- one id per character of printable ASCII except `|`, plus tab, newline and carriage return, so ordinary
  prompt text encodes, one token per character;
- `<|unk|>` for any other character (one token each);
- every other id: `|` plus W base-62 digits (`|a3F`), W the fewest digits that number them all.

Why the round trip is exact: in the text of pieces, `|` only ever starts a `|`+W-digit piece, so the
pre-tokenizer (cut into `|`+W digits where possible, else single characters) cuts such text exactly at the
piece boundaries. The added tokens (specials, `<|unk|>`) all end in `|>`, which no concatenation of other
pieces contains, so matching them first never splits a piece either.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import string
from typing import Any

import yaml
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenrouter.tools.build_dir import build_dir
from tokenrouter.tools.chatml import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START

# Bump whenever the output would change for the same arguments, so stale tokenizers get rebuilt.
GENERATOR_VERSION = 1

QWEN3_VOCAB_SIZE = 151936
QWEN3_SPECIAL_START = 151643  # <|endoftext|>; <|im_start|> and <|im_end|> follow
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
UNK = "<|unk|>"
# `|` is left out of the characters: it marks the multi-character pieces (see the module docstring).
CHARS = "".join(c for c in map(chr, range(0x20, 0x7F)) if c != "|") + "\t\n\r"
DIGITS = string.digits + string.ascii_uppercase + string.ascii_lowercase

MANIFEST = "MANIFEST.json"
# `ensure_bench_tokenizer` builds a deployment's `tokenizer:` directory only under this name, so it never
# writes into a directory meant for a real tokenizer.
DIR_PREFIX = "bench-tokenizer"
DEFAULT_OUT = "models/bench-tokenizer"


def default_special_start(vocab_size: int) -> int:
    """Qwen3's layout when the vocabulary is large enough for it, else ids 0..2 (the tiny models' layout)."""
    return QWEN3_SPECIAL_START if vocab_size >= QWEN3_SPECIAL_START + len(SPECIAL_TOKENS) else 0


def _digits_width(n: int) -> int:
    width = 1
    while len(DIGITS) ** width < n:
        width += 1
    return width


def _layout(vocab_size: int, special_start: int) -> tuple[dict[str, int], int]:
    """(piece -> id for every id, digit width of the `|` pieces)."""
    fixed = len(SPECIAL_TOKENS) + 1 + len(CHARS)
    if vocab_size < fixed:
        raise ValueError(f"vocab_size must be at least {fixed} (specials, <|unk|>, characters), got {vocab_size}")
    if not 0 <= special_start <= vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"special_start {special_start} leaves no room for {len(SPECIAL_TOKENS)} special tokens "
            f"in a vocabulary of {vocab_size}"
        )
    width = _digits_width(vocab_size - fixed)
    numbered = ("|" + "".join(d) for d in itertools.product(DIGITS, repeat=width))
    pieces = itertools.chain(CHARS, [UNK], numbered)
    vocab = {}
    for i in range(vocab_size):
        k = i - special_start
        vocab[SPECIAL_TOKENS[k] if 0 <= k < len(SPECIAL_TOKENS) else next(pieces)] = i
    return vocab, width


def build_bench_tokenizer(vocab_size: int = QWEN3_VOCAB_SIZE, special_start: int | None = None) -> Tokenizer:
    """The benchmark tokenizer as a `tokenizers.Tokenizer` (see the module docstring for its pieces)."""
    if special_start is None:
        special_start = default_special_start(vocab_size)
    vocab, width = _layout(vocab_size, special_start)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # `[\s\S]`, not `.`: the latter would not match newlines, which would then merge into unknown words.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf"\|[0-9A-Za-z]{{{width}}}|[\s\S]"), behavior="isolated")
    # Without a decoder, tokenizers joins tokens with spaces; Fuse concatenates them as they are.
    tok.decoder = decoders.Fuse()
    # Already in the vocabulary, so they keep their ids; as added tokens they are matched before
    # pre-tokenization (whole, not cut into characters). <|unk|> is not special so that it shows as text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(UNK, special=False, normalized=False)])
    return tok


def _tokenizer_config() -> dict[str, Any]:
    # Written by hand rather than by save_pretrained: its spellings differ between transformers 4.x and 5.x
    # (see make_tiny), these load under both, and the file does not change with the installed version.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # like Qwen: nothing is prepended
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
        # The default clean-up rewrites " ." etc. and would break the round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def _manifest(vocab_size: int, special_start: int) -> dict[str, Any]:
    return {
        "kind": "bench-tokenizer",
        "version": GENERATOR_VERSION,
        "vocab_size": vocab_size,
        "special_start": special_start,
    }


def _is_complete(out_dir: pathlib.Path, manifest: dict[str, Any]) -> bool:
    try:
        return json.loads((out_dir / MANIFEST).read_text()) == manifest and (out_dir / "tokenizer.json").is_file()
    except (OSError, ValueError):
        return False


def is_bench_tokenizer(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a directory this module wrote (its manifest says so)."""
    if path is None:
        return False
    try:
        return json.loads((pathlib.Path(path) / MANIFEST).read_text()).get("kind") == "bench-tokenizer"
    except (OSError, ValueError, AttributeError):
        return False


def make_bench_tokenizer(
    out_dir: str | os.PathLike = DEFAULT_OUT,
    vocab_size: int = QWEN3_VOCAB_SIZE,
    special_start: int | None = None,
    force: bool = False,
) -> pathlib.Path:
    """Write (or reuse) the benchmark tokenizer directory at `out_dir`; returns its path.

    The directory loads with `AutoTokenizer.from_pretrained` (and `tokenrouter.tokenizer.load_tokenizer`). A
    complete one built with the same arguments is reused unless `force`; one built with other arguments
    is replaced; a directory this function did not write is refused (FileExistsError).
    """
    if special_start is None:
        special_start = default_special_start(vocab_size)
    out = pathlib.Path(out_dir).absolute()
    manifest = _manifest(vocab_size, special_start)
    if not force and _is_complete(out, manifest):
        return out
    tok = build_bench_tokenizer(vocab_size, special_start)  # raises ValueError before anything is written

    def write(tmp: pathlib.Path) -> None:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks it complete

    build_dir(out, write, MANIFEST, "make_bench_tokenizer")
    return out


def ensure_bench_tokenizer(config_path: str | os.PathLike) -> pathlib.Path | None:
    """Build the benchmark tokenizer a deployment YAML names, if it is missing or was built for another size.

    Acts only when the config's `tokenizer:` is a directory named `bench-tokenizer*`; it is then sized to the
    entry model's `vocab_size` (its config.json). Returns that directory, or None when the config names no
    such tokenizer or is malformed (`load_config` reports what is wrong with it). Call it before
    `load_config`, which refuses a config whose tokenizer directory does not exist.
    """
    from tokenrouter.config import resolve_path

    path = pathlib.Path(config_path)
    try:
        data = yaml.safe_load(path.read_text())
        base = path.resolve().parent
        if not isinstance(data, dict) or not isinstance(data.get("tokenizer"), str):
            return None
        tok_dir = pathlib.Path(resolve_path(data["tokenizer"], base))
        if not tok_dir.name.startswith(DIR_PREFIX):
            return None
        models_ = data["models"]
        entry = data.get("entry") or next(iter(models_))
        model_dir = pathlib.Path(resolve_path(models_[entry]["path"], base))
        vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StopIteration, yaml.YAMLError):
        return None
    return make_bench_tokenizer(tok_dir, vocab_size)
