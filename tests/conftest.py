"""Shared fixtures: the tiny model set (built once, locally) and engine configs over it."""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run in the interpreter on machines without a GPU. This must be set before anything
# imports triton (transformers pulls it in through torch._dynamo at collection time).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny small/medium/large models and tokenizer; built on first use (seconds), reused after."""
    from tokenrouter.tools.make_tiny import make_tiny

    out = Path(os.environ.get("TOKENROUTER_TINY_DIR", REPO / "models" / "tiny"))
    make_tiny(out)
    return out


@pytest.fixture(scope="session")
def small_config(tiny_dir: Path) -> dict:
    return {"models": {"small": {"path": str(tiny_dir / "small"), "kv_cache_tokens": 8192}}, "entry": "small"}


@pytest.fixture(scope="session")
def bench_tokenizer_dir() -> Path:
    """The Qwen3-sized benchmark tokenizer where the qwen3 deployment configs look for it (built in about a
    second on first use, reused after)."""
    from tokenrouter.tools.bench_tokenizer import make_bench_tokenizer

    return make_bench_tokenizer(REPO / "models" / "bench-tokenizer")


@pytest.fixture(scope="session")
def near_pair(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small/large pair for the router trainers: the tiny large model, and the same with its output layer
    perturbed, so the two agree on most tokens and differ on some."""
    import shutil

    import torch
    from transformers import Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("near-pair")
    shutil.copytree(tiny_dir / "large", out / "small")
    model = Qwen3ForCausalLM.from_pretrained(tiny_dir / "large", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.add_(0.2 * model.lm_head.weight.std() * torch.randn(model.lm_head.weight.shape,
                                                                                  generator=gen))
    model.save_pretrained(out / "large")
    for f in (tiny_dir / "large").iterdir():
        if f.name.startswith(("tokenizer", "special", "chat")):
            shutil.copy2(f, out / "large" / f.name)
    return out


# -- helpers shared by the engine tests (import them: `from conftest import assert_idle, model_cfg`) ----------


def model_cfg(tiny_dir: Path, model: str, **overrides: object) -> dict:
    """One tiny model's config as the engine tests use it: 4-token KV blocks (many block boundaries in short
    prompts), a 4,096-token KV pool; `overrides` replace or add keys."""
    return {"path": str(tiny_dir / model), "block_size": 4, "kv_cache_tokens": 4096, **overrides}


def make_engine(tiny_dir: Path, model: str, **overrides: object):
    """A single-model engine of `model` (model_cfg with `overrides`)."""
    from tokenrouter import Engine

    return Engine.from_config({"models": {model: model_cfg(tiny_dir, model, **overrides)}})


def assert_idle(engine) -> None:
    """Nothing left running, and every KV block back in the pool (the invariant after every request ends)."""
    engine.check_integrity()
    bm = engine.block_manager
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held"
