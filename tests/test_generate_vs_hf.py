"""Greedy generation is token-identical to transformers' `generate`, however the requests are batched:
all at once, staggered with chunked prefill (batches mixing prefill, chunk continuation and decode), and
under KV pressure that forces preemption and recompute.

The `large` tiny model is used: the small one falls into 1-4 token loops under greedy decoding, which
would hide most divergences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from conftest import assert_idle, make_engine
from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

MODEL = "large"
NEW = 64
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
TEXTS = [
    "def main():",
    "import os\nimport sys\n\n",
    "Hello",
    "class Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
]
ID_PROMPT_LENS = [1, 9, 30, 57]


@pytest.fixture(scope="module")
def prompts(tiny_dir: Path) -> list:
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in ID_PROMPT_LENS]
    return TEXTS + ids


@pytest.fixture(scope="module")
def reference(tiny_dir: Path, prompts: list) -> list[list[int]]:
    """HF greedy continuations, one prompt at a time, no padding.

    EOS is unset for HF so that it neither stops on nor suppresses end tokens: with `min_new_tokens` and the
    checkpoint's EOS, HF would mask EOS logits, which is not what `ignore_eos` means (keep going, but an
    EOS is still a legal argmax)."""
    tok = AutoTokenizer.from_pretrained(tiny_dir / MODEL)
    hf = Qwen3ForCausalLM.from_pretrained(tiny_dir / MODEL, dtype=torch.float32).eval()
    refs = []
    for p in prompts:
        ids = tok(p)["input_ids"] if isinstance(p, str) else p
        x = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                eos_token_id=None,
                pad_token_id=0,
            )
        refs.append(out[0, len(ids) :].tolist())
        assert len(refs[-1]) == NEW
    # A meaningful reference: not all prompts collapse into the same short loop.
    assert len({tuple(r) for r in refs}) == len(refs)
    assert sum(len(set(r)) for r in refs) > 8 * 10
    return refs


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def assert_matches(outputs, prompts, reference) -> None:
    assert len(outputs) == len(prompts)
    for i, (o, ref) in enumerate(zip(outputs, reference)):
        assert o.finished and o.finish_reason == "length", (i, o.finish_reason)
        assert o.token_ids == ref, f"prompt {i}: first difference at output token {first_diff(o.token_ids, ref)}"


def record_batches(engine: Engine) -> list[set[str]]:
    """Wrap the scheduler so every scheduled batch is classified: prefill (first chunk of a prompt), chunk
    (continuation of a chunked prefill), decode (the one token sampled last step), extend (anything else)."""
    log: list[set[str]] = []
    sched = engine.scheduler
    orig = sched.schedule

    def schedule():
        chunks = orig()
        kinds = set()
        for c in chunks:
            s = c.seq
            if s.num_computed_tokens == 0:
                kinds.add("prefill")
            elif s.num_computed_tokens < s.num_prompt_tokens:
                kinds.add("chunk")
            elif c.num_new_tokens == 1:
                kinds.add("decode")
            else:
                kinds.add("extend")
        if chunks:
            log.append(kinds)
        return chunks

    sched.schedule = schedule
    return log


def test_together(tiny_dir: Path, prompts, reference) -> None:
    engine = make_engine(tiny_dir, MODEL)
    outs = engine.generate(prompts, GREEDY)
    assert_matches(outs, prompts, reference)
    for o, p in zip(outs, prompts):
        if isinstance(p, list):
            assert o.prompt_token_ids == p
    assert_idle(engine)


def run_staggered(engine: Engine, prompts: list, gaps: list[int]) -> list:
    """Submit prompts one by one with `gaps[i]` engine steps after the i-th; then run to completion."""
    finished = {}
    rids = []
    for p, gap in zip(prompts, gaps):
        rids.append(engine.add_request(p, GREEDY))
        for _ in range(gap):
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = o
            engine.check_integrity()
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        engine.check_integrity()
    assert set(finished) == set(rids)
    return [finished[r] for r in rids]


def test_staggered_chunked_prefill(tiny_dir: Path, prompts, reference) -> None:
    engine = make_engine(tiny_dir, MODEL, max_num_batched_tokens=16)
    log = record_batches(engine)
    outs = run_staggered(engine, prompts, gaps=[3, 1, 5, 2, 4, 1, 3, 0])
    assert_matches(outs, prompts, reference)
    # The point of the exercise: batches really mixed the three kinds of work.
    assert any("chunk" in k for k in log), "no prompt was prefilled in chunks"
    assert any("decode" in k and k & {"prefill", "chunk"} for k in log), log
    assert any({"decode", "chunk"} <= k for k in log), log
    assert_idle(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption(tiny_dir: Path, prompts, reference, prefix_caching: bool) -> None:
    # 32 blocks of 4 tokens: the longest request (57 + 64 tokens) needs 31 of them on its own.
    engine = make_engine(tiny_dir, MODEL, kv_cache_tokens=128, enable_prefix_caching=prefix_caching)
    assert engine.block_manager.num_blocks == 32
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert_matches(outs, prompts, reference)
    minimal = sum(len(o.prompt_token_ids) + NEW - 1 for o in outs)
    forwarded = sum(o.stats["num_forwarded_tokens"] for o in outs)
    if prefix_caching:
        assert forwarded >= minimal - sum(o.stats["num_cached_tokens"] for o in outs)
    else:
        # Recompute is visible in the counters: preempted requests ran some tokens more than once.
        assert forwarded > minimal
    assert_idle(engine)


def test_staggered_with_preemption(tiny_dir: Path, prompts, reference) -> None:
    engine = make_engine(tiny_dir, MODEL, kv_cache_tokens=128, max_num_batched_tokens=16)
    outs = run_staggered(engine, prompts, gaps=[2, 2, 2, 2, 2, 2, 2, 0])
    assert engine.scheduler.num_preemptions > 0
    assert_matches(outs, prompts, reference)
    assert_idle(engine)


def test_generate_while_other_requests_run(tiny_dir: Path, prompts, reference) -> None:
    """generate() must return its own prompts' outputs even when requests added via add_request finish
    inside its loop (they must not be counted as its results), and those requests must still complete."""
    engine = make_engine(tiny_dir, MODEL)
    short = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    other = engine.add_request(prompts[5], short)
    eight = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    # `other` finishes first, then prompt 0: a loop that counts any finished request would stop here.
    outs = engine.generate(prompts[:2], [eight, GREEDY])
    assert all(o.request_id != other for o in outs)
    assert [o.prompt_token_ids for o in outs] == [engine.tokenize(p) for p in prompts[:2]]
    assert outs[0].token_ids == reference[0][:8] and outs[0].finish_reason == "length"
    assert_matches(outs[1:], prompts[1:2], reference[1:2])
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)


def test_generate_keeps_other_requests_outputs(tiny_dir: Path, prompts, reference) -> None:
    """A request added with add_request that finishes during someone's generate() call must still have
    its final output reported by a later step(); generate() must not swallow it."""
    engine = make_engine(tiny_dir, MODEL)
    short = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    other = engine.add_request(prompts[5], short)
    engine.generate(prompts[:2], GREEDY)
    finals = [o for _ in range(3) for o in engine.step() if o.request_id == other and o.finished]
    assert len(finals) == 1, "the final output of a request that finished inside generate() was lost"
    assert finals[0].token_ids == reference[5][:2]
    assert_idle(engine)
