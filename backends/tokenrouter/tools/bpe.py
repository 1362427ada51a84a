"""The project's byte-level BPE tokenizer, trained here on the Python standard library's own sources (no
hub): the tiny test models (make_tiny.py) and the trained pair (train_pair.py) use it, at their vocabulary
sizes. ChatML special tokens and chat template (chatml.py); `<|endoftext|>` is id 0.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tokenrouter.tools.chatml import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START

# Order matters: the trainer assigns ids in this order, so <|endoftext|> is id 0.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]


def stdlib_root() -> pathlib.Path:
    """This Python's standard library folder."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's .py files in path order (third-party packages under it left out: they vary
    between machines). `root`: a copy of a standard library elsewhere (default: this Python's)."""
    root = stdlib_root() if root is None else root
    return sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def read_sources(files: list[pathlib.Path], max_bytes: int | None = None) -> Iterator[str]:
    """The texts of `files` in order, until about `max_bytes` were read (None: all)."""
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test fixtures are deliberately not UTF-8
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def train_bpe_tokenizer(out: pathlib.Path, vocab_size: int, corpus_bytes: int,
                        files: list[pathlib.Path] | None = None) -> PreTrainedTokenizerFast:
    """Train on the first `corpus_bytes` of `files` (default: all stdlib sources) and save to `out` (a Hugging
    Face tokenizer directory that transformers 4 and 5 both load)."""
    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: bytes in, same bytes out, so decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Seed all 256 bytes so any unicode text can be encoded, seen in training or not.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_sources(stdlib_sources() if files is None else files, corpus_bytes), trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,  # like Qwen: nothing is prepended
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        # The default cleanup rewrites " ." etc. and would break exact round-trips.
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(out)
    # transformers 5 writes its internal class name and a list-valued
    # "extra_special_tokens", neither of which 4.x understands; the older spellings
    # load the same tokenizer under both major versions.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(cfg.get("extra_special_tokens"), list):
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return wrapped
