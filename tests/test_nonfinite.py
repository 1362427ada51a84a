"""A model whose logits come out NaN for one request (a broken weight, a faulty kernel or library: on an H200,
cuBLAS under an MPS SM limit did this, perf/results/sm_share_h200_2026-12-02) fails that request alone with a
clear error: it never commits argmax(NaN) as a token, never reaches the sampler (whose assert would end the
process), and the requests batched with it finish exactly as they would have without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from test_stepped_finals import REPO, assert_all_free, engine_for
from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

POISON = 7  # the last token of the poisoned prompt, at position 2: every prompt has at least 3 tokens
PROMPTS = [[5, 6, POISON], [100, 200, 300], [17] * 11, [40, 41, 42, 43, 44, 45, 46]]


def poison(engine: Engine) -> None:
    """NaN final hidden states (so NaN logits) for the token POISON at position 2, on the entry (small) model:
    the first request's last prompt token only, whatever the others sample (their position 2 is a prompt token). A hook,
    not a weight: the tiny models tie the LM head to the embedding, and a NaN row there would reach every
    request."""

    def hook(module: torch.nn.Module, inputs: tuple, hidden: torch.Tensor) -> torch.Tensor:
        batch = inputs[0]
        hit = (batch.input_ids == POISON) & (batch.positions == 2)
        return hidden.masked_fill(hit[:, None], float("nan"))

    engine.subservers["small"].runner.model.register_forward_hook(hook)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),  # seeded rows
    SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True),  # the batched sampler
], ids=["greedy", "seeded", "sampled"])
def test_non_finite_logits_fail_only_their_request(tiny_dir: Path, params: SamplingParams) -> None:
    clean = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.2)
    expected = clean.generate(PROMPTS, params)
    engine = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml", p=0.2)
    poison(engine)
    outs = engine.generate(PROMPTS, params)
    bad, *others = outs
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "'small' produced non-finite logits (NaN or inf)" in bad.error
    for out, ref in zip(others, expected[1:]):
        assert out.error is None and out.finish_reason == "length"
        if params.greedy or params.seed is not None:  # unseeded draws depend on the batch they share
            assert out.token_ids == ref.token_ids
    assert_all_free(engine)
    # The engine carries on: the same request without the poisoned token is served.
    (again,) = engine.generate([[5, 6, 8, 9]], params)
    assert again.error is None and len(again.token_ids) == 12
    assert_all_free(engine)


def test_a_warm_up_with_non_finite_logits_refuses_the_model(tiny_dir: Path) -> None:
    """On a GPU the warm-up runs before the model reports ready (Subserver.from_config): a model that computes
    NaN must not go on to serve. It leaves no sequence or block behind either way."""
    from tokenrouter.engine.warmup import NonFiniteLogits, warm_up

    engine = engine_for(tiny_dir, "random/tiny-small_tiny-large.yaml")
    sub = engine.subservers["small"]
    sub.runner.model.model.embed_tokens.register_forward_hook(lambda m, i, out: out * float("nan"))
    with pytest.raises(NonFiniteLogits, match="small: non-finite logits in the warm-up"):
        warm_up(sub)
    assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks and not sub.scheduler.num_ready


def test_a_request_with_non_finite_logits_leaves_nothing_in_the_prefix_cache(tiny_dir: Path) -> None:
    """Its KV is suspect: a later prompt with the same prefix must compute its own, not inherit the fault."""
    cfg = yaml.safe_load((REPO / "config" / "random" / "tiny-small_tiny-large.yaml").read_text())
    for name, m in cfg["models"].items():
        m.update(path=str(tiny_dir / name), kv_cache_tokens=1024, block_size=2)  # [5, 6] fills a block
    engine = Engine.from_config(cfg)
    bm = engine.subservers["small"].block_manager
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    engine.generate([[5, 6, 8]], params)
    assert bm.match_prefix([5, 6, 9]), "a clean request's full block is cached (the premise)"
    poison(engine)
    (bad,) = engine.generate([[1, 2, POISON]], params)
    assert bad.finish_reason == "error"
    assert bm.match_prefix([1, 2, 9]) == [] and bm.match_prefix([5, 6, 9])
    bm.check_integrity([])
