"""A model whose logits come out NaN for one request (a broken weight, a faulty kernel or library: on an H200,
cuBLAS under an MPS SM limit did this, perf/results/sm_share_h200_2026-12-02) fails that request alone with a
clear error: it never commits argmax(NaN) as a token, never reaches the sampler (whose assert would end the
process), and the requests batched with it finish exactly as they would have without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_stepped_finals import assert_all_free, engine_for
from tokenrouter.engine import subserver
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.warmup import NonFiniteLogits, warm_up
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


def engine(tiny_dir: Path, config: str = "random/tiny-small_tiny-large.yaml", **model: object) -> Engine:
    """`engine_for` with random routing at p=0.2 where the config routes at random."""
    policy = {"p": 0.2} if config.startswith("random/") else {}
    return engine_for(tiny_dir, config, model, **policy)


GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True)  # the batched sampler


@pytest.mark.parametrize(("config", "route_in_step", "params"), [
    ("random/tiny-small_tiny-large.yaml", True, GREEDY),
    ("random/tiny-small_tiny-large.yaml", True, SEEDED),
    ("random/tiny-small_tiny-large.yaml", True, SAMPLED),
    ("random/tiny-small_tiny-large.yaml", False, SEEDED),  # the policy's work after the step's sync
    ("rstitch/tiny-small_tiny-large.yaml", True, SEEDED),  # a policy with tensor work in the step (entropy)
    ("rstitch/tiny-small_tiny-large.yaml", False, GREEDY),
], ids=["greedy", "seeded", "sampled", "seeded-route-after-step", "rstitch-seeded", "rstitch-route-after-step"])
def test_non_finite_logits_fail_only_their_request(tiny_dir: Path, config: str, route_in_step: bool,
                                                   params: SamplingParams) -> None:
    expected = engine(tiny_dir, config, route_in_step=route_in_step).generate(PROMPTS, params)
    poisoned = engine(tiny_dir, config, route_in_step=route_in_step)
    poison(poisoned)
    bad, *others = poisoned.generate(PROMPTS, params)
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "'small' produced non-finite logits (NaN or inf)" in bad.error
    for out, ref in zip(others, expected[1:]):
        assert out.error is None and out.finish_reason == "length"
        if params.greedy or params.seed is not None:  # unseeded draws depend on the batch they share
            assert out.token_ids == ref.token_ids
    assert_all_free(poisoned)
    # The engine carries on: the same request without the poisoned token is served.
    (again,) = poisoned.generate([[5, 6, 8, 9]], params)
    assert again.error is None and len(again.token_ids) == 12
    assert_all_free(poisoned)


def test_a_warm_up_with_non_finite_logits_refuses_the_model(tiny_dir: Path) -> None:
    """On a GPU the warm-up runs before the model reports ready (Subserver.from_config): a model that computes
    NaN must not go on to serve. It leaves no sequence or block behind either way."""
    sub = engine(tiny_dir).subservers["small"]
    sub.runner.model.model.embed_tokens.register_forward_hook(lambda m, i, out: out * float("nan"))
    with pytest.raises(NonFiniteLogits, match="small: non-finite logits in the warm-up"):
        warm_up(sub)
    assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks and not sub.scheduler.num_ready


def test_a_request_with_non_finite_logits_leaves_nothing_in_the_prefix_cache(tiny_dir: Path) -> None:
    """Its KV is suspect: a later prompt with the same prefix must compute its own, not inherit the fault."""
    eng = engine(tiny_dir, block_size=2)  # [5, 6] fills a block
    bm = eng.subservers["small"].block_manager
    eng.generate([[5, 6, 8]], GREEDY)
    assert bm.match_prefix([5, 6, 9]), "a clean request's full block is cached (the premise)"
    poison(eng)
    (bad,) = eng.generate([[1, 2, POISON]], GREEDY)
    assert bad.finish_reason == "error"
    assert bm.match_prefix([1, 2, 9]) == [] and bm.match_prefix([5, 6, 9])
    bm.check_integrity([])


@pytest.mark.parametrize(("raised", "refused"), [
    (NonFiniteLogits("small: non-finite logits in the warm-up"), "model 'small' failed its warm-up: small: non-finite"),
    (RuntimeError("CUDA error: an illegal memory access"), "model 'small': the GPU failed during the warm-up"),
    (RuntimeError("something else"), None),  # costs the warm-up only: the model serves without it
])
def test_what_a_failed_warm_up_means_for_the_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   raised: Exception, refused: str | None) -> None:
    """On a GPU, Subserver.from_config runs this before the model reports ready (the CPU has no warm-up)."""
    sub = engine(tiny_dir).subservers["small"]

    def fail(_sub: object) -> float:
        raise raised

    monkeypatch.setattr(subserver, "warm_up", fail)
    if refused is None:
        sub.warm_up_or_refuse()
        assert sub.warmup_s is None
    else:
        with pytest.raises(RuntimeError, match=refused):
            sub.warm_up_or_refuse()
