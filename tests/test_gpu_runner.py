"""The runner on a GPU (bf16; Triton attention and fused kernels, with and without CUDA graphs; and the torch
path) against transformers. Skipped without CUDA; run on the GPU machine with
`TRITON_INTERPRET=0 python -m pytest tests/test_gpu_runner.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT_LENS = [5, 9, 17, 33, 64, 100, 130, 200]


def _engine(tiny_dir: Path, model: str, attention: str, graphs: bool):
    from tokenrouter import Engine

    cfg = {"models": {model: {"path": str(tiny_dir / model), "dtype": "bfloat16", "device": "cuda:0",
                              "kv_cache_tokens": 16384, "attention": attention, "enforce_eager": not graphs}}}
    return Engine.from_config(cfg)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(("attention", "graphs"), [("triton", True), ("triton", False), ("torch", False)])
@pytest.mark.parametrize("model", ["small", "large"])
def test_greedy_matches_transformers_bf16(tiny_dir: Path, model: str, attention: str, graphs: bool) -> None:
    from transformers import AutoModelForCausalLM

    from tokenrouter import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir / model, dtype=torch.bfloat16).cuda().eval()
    # The logits reference is the exact (float32) model: measured against transformers' bf16 path instead, the
    # error would add that path's own bf16 error (it applies RoPE in bf16) to ours.
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_dir / model, dtype=torch.float32).cuda().eval()
    engine = _engine(tiny_dir, model, attention, graphs)
    assert engine.runner.attn_backend.name == attention
    assert (engine.runner.graphs is not None) == graphs
    prompts = _prompts(engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    worst = worst_hf_bf16 = 0.0
    matched = near_ties = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None)
        ref_ids = ref[0, len(prompt):].tolist()
        if out.token_ids == ref_ids:
            matched += 1
        else:
            # bf16 rounds differently from transformers' kernels: a divergence is only acceptable where
            # the reference itself hesitates (its top two logits within the logit tolerance).
            k = next(i for i, (a, b) in enumerate(zip(out.token_ids, ref_ids)) if a != b)
            with torch.no_grad():
                at = hf(torch.tensor([prompt + ref_ids[:k]], device="cuda")).logits[0, -1].float()
            top2 = at.topk(2).values
            gap = (top2[0] - top2[1]).item() / at.abs().max().item()
            assert gap <= 2e-2, f"diverged at token {k} where the reference was sure (gap {gap:.3g})"
            near_ties += 1
        # Logits of our tokens' continuation, one full forward, against ours through the paged path.
        with torch.no_grad():
            full = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
            ref_logits = hf32(full).logits[0, len(prompt) - 1:].float()
            bf16_logits = hf(full).logits[0, len(prompt) - 1:].float()
        ours = _teacher_forced_logits(engine, prompt, out.token_ids[:-1])
        worst = max(worst, ((ours - ref_logits).abs().max() / ref_logits.abs().max()).item())
        worst_hf_bf16 = max(worst_hf_bf16, ((bf16_logits - ref_logits).abs().max() / ref_logits.abs().max()).item())
    print(f"{model}/{attention}/graphs={graphs}: logits rel. error vs float32 {worst:.4f} "
          f"(transformers bf16: {worst_hf_bf16:.4f})")
    # bf16 logits differ from float32 by rounding, and how much depends on summation order (split-K, KV splits,
    # fused kernels): no fixed bound holds for every model. The yardstick is transformers' own bf16 path on the
    # same prompts: ours may not be worse than its error plus a quarter (and 2e-2 passes whatever it measures).
    # On the H200 (2026-12-02) the tiny large model measured 0.0204 on the graph path against transformers'
    # 0.0222: a fixed 2e-2 had failed it while it was closer to float32 than transformers.
    limit = max(2e-2, 1.25 * worst_hf_bf16)
    assert worst <= limit, f"logits relative error {worst:.3g} > {limit:.3g}"
    # Every sequence either matches exactly or diverges only at a reference near-tie (asserted above).
    assert matched + near_ties == len(prompts)
    if graphs:
        assert engine.runner.graphs.num_replays > 0, "no step replayed a CUDA graph"
    engine.check_integrity()
    engine.shutdown()


def _teacher_forced_logits(engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Our logits at every position from the prompt's last token on, with the continuation forced in
    (prefill, then one decode step per token through the paged KV path). bf16 matmuls are not batch
    invariant, so regenerating greedily alone could wander off the batched run's tokens."""
    from tokenrouter import SamplingParams

    rows = []
    orig = engine.runner.forward

    def record(chunks, **kw):
        out = orig(chunks, **kw)
        rows.append(out.logits[0].float().clone())  # a graph's logits buffer is overwritten by the next step
        return out

    engine.runner.forward = record
    # A step launched ahead would feed the sampled token on the device before the forced one replaces it here.
    ahead, engine.entry.step_ahead = engine.entry.step_ahead, False
    try:
        params = SamplingParams(max_new_tokens=len(continuation) + 1, temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        seq = engine.entry.seqs[rid]
        for tok in continuation:
            engine.step()
            seq.token_ids[-1] = tok  # sampled but not yet computed: replace it with the forced token
        engine.step()
        assert not engine.has_unfinished()
    finally:
        engine.runner.forward = orig
        engine.entry.step_ahead = ahead
    return torch.stack(rows)


def test_routed_generation_same_with_and_without_graphs(tiny_dir: Path) -> None:
    """R2R on the tiny pair in float32 on the GPU: the router runs inside the small model's graphs, the large
    model's returns replay extend graphs, and the small model steps ahead, yet every token and every routing
    decision equals the eager engine's (and the graphed engine's without stepping ahead)."""
    import yaml

    from tokenrouter import Engine, SamplingParams

    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((repo / "config" / "r2r" / "tiny-small_tiny-large.yaml").read_text())
    outs = {}
    # (graphs, step ahead): stepping ahead, a step's tokens are fed to the next one on the device, into the graphs'
    # static inputs, while its copies to the host are still on their way.
    for graphs, ahead in ((True, True), (False, False), (True, False)):
        for name, m in cfg["models"].items():
            m.update(path=str(tiny_dir / name), device="cuda:0", enforce_eager=not graphs, step_ahead=ahead)
        engine = Engine.from_config(cfg)
        prompts = _prompts(engine.vocab_size)
        outs[graphs, ahead] = engine.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0,
                                                                      ignore_eos=True))
        if graphs:
            assert all(s.runner.graphs.num_replays > 0 for s in engine.subservers.values())
        assert (engine.subservers["small"].num_ahead_steps > 0) == ahead
        engine.check_integrity()
        engine.shutdown()
    for other in ((False, False), (True, False)):
        for a, b in zip(outs[True, True], outs[other]):
            assert a.token_ids == b.token_ids
            assert a.stats == b.stats  # the same tokens from the same models
    assert sum(o.stats["handoffs"] for o in outs[True, True]) > 0, "nothing was routed: the test checks nothing"
