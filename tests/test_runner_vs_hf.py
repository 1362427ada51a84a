"""Our runner's logits equal transformers' Qwen3ForCausalLM through prefill, extend and decode batches.

The test drives `scheduler.schedule()` + `runner.forward()` itself (no sampling), with the same postprocessing
as `Engine.step`, so every new token is a known one: a decode is "append 1 token", an extend "append k".
The reference is a full-sequence HF forward over the request's known tokens, taken at the last position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from conftest import assert_idle
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.sequence import Sequence

MAX_REL_ERR = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def hf_models(tiny_dir: Path):
    cache: dict[str, Qwen3ForCausalLM] = {}

    def get(name: str) -> Qwen3ForCausalLM:
        if name not in cache:
            cache[name] = Qwen3ForCausalLM.from_pretrained(tiny_dir / name, dtype=torch.float32).eval()
        return cache[name]

    return get


@torch.no_grad()
def hf_last_logits(model: Qwen3ForCausalLM, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


def forward_step(engine: Engine, seqs: dict[str, Sequence]) -> dict[str, torch.Tensor] | None:
    """One forward pass of whatever the scheduler picks, postprocessed like Engine.step minus sampling
    (None when nothing is pending). Records each scheduled request's Sequence in `seqs`."""
    chunks = engine.scheduler.schedule()
    if not chunks:
        return None
    for c in chunks:
        seqs[c.seq.request_id] = c.seq
    out = engine.runner.forward(chunks)
    sampling = [c.seq for c in chunks if c.samples]
    assert out.logits.shape == (len(sampling), engine.vocab_size)
    assert out.logits.dtype == torch.float32
    for c in chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
        engine.block_manager.register_full_blocks(c.seq)
    engine.check_integrity()
    return {s.request_id: out.logits[i].clone() for i, s in enumerate(sampling)}


def run_until_computed(engine: Engine, seqs: dict[str, Sequence]) -> dict[str, torch.Tensor]:
    """Forward passes until every request's known tokens are computed (several if prefill is chunked)."""
    got: dict[str, torch.Tensor] = {}
    for _ in range(100):
        step = forward_step(engine, seqs)
        if step is None:
            assert all(s.num_pending_tokens == 0 for s in seqs.values())
            return got
        assert not set(step) & set(got), "a request produced logits twice in one round"
        got.update(step)
    raise AssertionError("requests never finished computing")


# Per round, the number of known tokens each request gets appended: 0 = idle this round, "d" = a decode of
# the argmax of our previous logits for it, k > 0 = an extend by k random tokens. Request 4 arrives in round 3.
ROUNDS = [
    ["d", "d", "d", "d"],
    [1, 3, 7, 2],
    [0, 7, 0, "d"],
    [5, "d", 3, 1, "new"],
    ["d", "d", "d", "d", "d"],
    [7, 1, "d", 3, 4],
    ["d", "d", "d", "d", "d"],
]
PROMPT_LENS = [5, 13, 22, 37]
NEW_PROMPT_LEN = 11


@pytest.mark.parametrize(
    "model,block_size,max_batched",
    [
        ("small", 4, 2048),
        ("medium", 4, 2048),
        ("large", 4, 2048),  # sharded checkpoint, untied head
        ("small", 3, 16),  # odd block size; prompts prefilled in chunks across passes
        ("large", 4, 16),
    ],
)
def test_logits_match_hf(tiny_dir: Path, hf_models, model: str, block_size: int, max_batched: int) -> None:
    hf = hf_models(model)
    engine = Engine.from_config(
        {
            "models": {
                model: {
                    "path": str(tiny_dir / model),
                    "block_size": block_size,
                    "kv_cache_tokens": 4096,
                    "max_num_batched_tokens": max_batched,
                }
            }
        }
    )
    vocab = engine.vocab_size
    assert vocab == hf.config.vocab_size
    if model == "large":  # what this case is here for
        assert (tiny_dir / model / "model.safetensors.index.json").is_file()
        assert not engine.runner.arch.tie_word_embeddings and engine.runner.model.lm_head is not None
    if model == "small":
        assert engine.runner.arch.tie_word_embeddings
    gen = torch.Generator().manual_seed(1234)

    def rand_tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rids = [engine.add_request(rand_tokens(n)) for n in PROMPT_LENS]
    seqs: dict[str, Sequence] = {}
    logits = run_until_computed(engine, seqs)
    checked = 0

    def check(results: dict[str, torch.Tensor], expect: set[str]) -> None:
        nonlocal checked
        assert set(results) == expect
        for rid, ours in results.items():
            seq = seqs[rid]
            ref = hf_last_logits(hf, seq.token_ids)
            err = rel_err(ours, ref)
            assert err <= MAX_REL_ERR, f"{model} {rid} at {seq.num_tokens} tokens: rel err {err:.2e}"
            # Everything known is computed exactly once: no recompute, nothing skipped.
            assert seq.num_computed_tokens == seq.num_tokens
            assert seq.num_forwarded_tokens == seq.num_tokens
            assert len(seq.block_table) == -(-seq.num_tokens // block_size)
            checked += 1

    check(logits, set(rids))
    for plan in ROUNDS:
        expect = set()
        for i, action in enumerate(plan):
            if action == "new":
                assert i == len(rids)
                rids.append(engine.add_request(rand_tokens(NEW_PROMPT_LEN)))
            elif action == "d":
                engine.append_tokens(rids[i], [int(logits[rids[i]].argmax())])
            elif action > 0:
                engine.append_tokens(rids[i], rand_tokens(action))
            else:
                continue
            expect.add(rids[i])
        results = run_until_computed(engine, seqs)
        check(results, expect)
        logits.update(results)
    assert checked == len(PROMPT_LENS) + sum(a != 0 for plan in ROUNDS for a in plan)

    for rid in rids:
        out = engine.abort(rid)
        assert out is not None and out.finish_reason == "abort"
    assert_idle(engine)
