"""Build a tiny, fully local family of Qwen3-style models for tests and demos.

Everything is made on this machine: a byte-level BPE tokenizer trained on the Python
standard library's own sources, and three randomly initialised ``Qwen3ForCausalLM``
checkpoints (small / medium / large) that share it. No model hub is contacted.

The output is deterministic for a given seed and Python installation, and the build is
idempotent: a finished set carries a ``MANIFEST.json`` and is reused unless ``force``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from tokenrouter.tools.bpe import train_bpe_tokenizer
from tokenrouter.tools.build_dir import build_dir
from tokenrouter.tools.chatml import ENDOFTEXT, IM_END

# Bump whenever the output would change for the same seed, so stale sets get rebuilt.
GENERATOR_VERSION = 1

VOCAB_SIZE = 1024

# About 3 MB keeps BPE training to a few seconds on two cores while still giving
# sensible merges for code and English.
CORPUS_BYTES = 3_000_000

MANIFEST = "MANIFEST.json"
MODEL_NAMES = ("small", "medium", "large")

# hidden, layers, q heads, kv heads, intermediate, tied embeddings. head_dim is 16 for all.
SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "small": (64, 2, 4, 2, 192, True),
    "medium": (96, 3, 6, 2, 256, False),
    "large": (128, 4, 8, 2, 384, False),
}
HEAD_DIM = 16
# Small enough that even the tiny "large" model is split into several shards, so the
# sharded-checkpoint loading path gets exercised.
LARGE_SHARD_SIZE = "1MB"


def _train_tokenizer(out: pathlib.Path) -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(out, VOCAB_SIZE, CORPUS_BYTES)


def _build_model(name: str, k: int, seed: int, tokenizer: PreTrainedTokenizerFast, out: pathlib.Path) -> None:
    hidden, layers, heads, kv_heads, inter, tied = SHAPES[name]
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        intermediate_size=inter,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attention_bias=False,
        # Wider than the usual 0.02 so random logits are spread out and greedy decoding
        # is not decided by near-ties that flip with numerical noise between backends.
        initializer_range=0.05,
        eos_token_id=im_end,
        pad_token_id=eot,
        bos_token_id=eot,
        dtype="float32",
    )
    torch.manual_seed(seed + k)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=eot, do_sample=False
    )
    shard = {"max_shard_size": LARGE_SHARD_SIZE} if name == "large" else {}
    model.save_pretrained(out, safe_serialization=True, **shard)


def _is_complete(out_dir: pathlib.Path, seed: int) -> bool:
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        manifest.get("seed") == seed
        and manifest.get("version") == GENERATOR_VERSION
        and all((out_dir / n / "config.json").is_file() for n in MODEL_NAMES)
        and (out_dir / "tokenizer" / "tokenizer.json").is_file()
    )


def _result(out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    return {name: out_dir / name for name in (*MODEL_NAMES, "tokenizer")}


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' per-shard progress bars; they are noise for a 1-second build."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_into(tmp: pathlib.Path, seed: int) -> None:
    tokenizer = _train_tokenizer(tmp / "tokenizer")
    tok_files = [p for p in (tmp / "tokenizer").iterdir() if p.is_file()]
    for k, name in enumerate(MODEL_NAMES):
        _build_model(name, k, seed, tokenizer, tmp / name)
        # Serving code loads the tokenizer from the model dir, as with hub checkpoints.
        for f in tok_files:
            shutil.copy2(f, tmp / name / f.name)
    # Written last: its presence is what marks a set as complete.
    manifest = {"seed": seed, "version": GENERATOR_VERSION, "vocab_size": len(tokenizer)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def make_tiny(out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> dict[str, pathlib.Path]:
    """Create (or reuse) the tiny model set under ``out_dir``.

    Returns paths of the ``small``, ``medium`` and ``large`` model directories (each also
    holds the tokenizer files) and of the standalone ``tokenizer`` directory.
    """
    out_dir = pathlib.Path(out_dir).absolute()
    if not force and _is_complete(out_dir, seed):
        return _result(out_dir)
    with _quiet_progress():
        build_dir(out_dir, lambda tmp: _build_into(tmp, seed), MANIFEST, "make_tiny")
    return _result(out_dir)
