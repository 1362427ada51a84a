"""R2R router training (tools/train_router.py) on `near_pair` (conftest: two tiny models that agree on most
tokens and diverge on some; random models of different shapes diverge everywhere: nothing to learn). The
features the trainer computes offline must be the ones the policy computes inside the engine's step, or a
trained router would be served wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from tokenrouter import Engine, SamplingParams
from tokenrouter.routing.policies.r2r import R2RRouter
from tokenrouter.tools.train_router import label_prompt, main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy", ["r2r", "citer"])
def test_router_trains_on_divergence_labels_and_loads_in_the_policy(near_pair: Path, tmp_path: Path,
                                                                    policy: str) -> None:
    ckpt = tmp_path / f"{policy}.safetensors"
    rc = main(["--policy", policy, "--pair", str(near_pair), "--out", str(ckpt), "--prompts", "12",
               "--prompt-len", "24", "--gen-len", "16", "--lookahead", "4", "--hidden-dim", "32", "--epochs", "60"])
    assert rc == 0
    report = json.loads(Path(str(ckpt) + ".json").read_text())
    assert 0 < report["divergent"] < report["tokens"], report
    assert report["train_loss_last_epoch"] < report["train_loss_first_epoch"]
    assert report["policy"]["name"] == policy and report["policy"]["checkpoint"] == str(ckpt)

    # The report's policy settings load the checkpoint as they are (a wrong network shape fails here).
    settings = {**report["policy"], "threshold": 0.5}
    models = {m: {"path": str(near_pair / m), "dtype": "float32", "kv_cache_tokens": 2048} for m in ("small", "large")}
    engine = Engine.from_config({"models": models, "entry": "small", "policy": settings})
    try:
        greedy = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0)
        out = engine.generate([5, 9, 17, 33, 65], greedy)[0]
        assert len(out.token_ids) == 16
    finally:
        engine.shutdown()


def test_training_features_are_the_served_ones(near_pair: Path) -> None:
    """The router's value for each token, from the trainer's features (transformers, teacher-forced), equals
    the value the policy computes inside the engine's step for the same tokens (the probe records it)."""
    sys.path.insert(0, str(REPO / "perf"))
    from std_serving.probe_policy import ProbePolicy  # noqa: F401  (registers `probe`)

    tok = AutoTokenizer.from_pretrained(near_pair / "small")
    small = Qwen3ForCausalLM.from_pretrained(near_pair / "small", dtype=torch.float32).eval()
    large = Qwen3ForCausalLM.from_pretrained(near_pair / "large", dtype=torch.float32).eval()
    prompt = [5, 9, 17, 33, 65, 129, 257]
    h, top, emb, _ = label_prompt(small, large, tok, prompt, gen_len=10, lookahead=2, k=100)
    net = R2RRouter(small.config.hidden_size, 100, 32)
    torch.manual_seed(1)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ckpt = near_pair / "probe_router.pt"
    torch.save(net.state_dict(), ckpt)
    with torch.no_grad():
        offline = net(h, top, emb)

    inner = {"name": "r2r", "checkpoint": str(ckpt), "hidden_dim": 32}
    engine = Engine.from_config({
        "models": {"small": {"path": str(near_pair / "small"), "dtype": "float32", "kv_cache_tokens": 2048}},
        "entry": "small", "policy": {"name": "probe", "inner": inner, "models": ["small", "large"]},
    })
    try:
        out = engine.generate(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0))[0]
        served = torch.tensor([row[0] for row in engine.entry.policy.take(out.request_id)])
    finally:
        engine.shutdown()
    torch.testing.assert_close(served, offline, rtol=1e-4, atol=1e-4)
