"""Co-LLM deferral-head training (tools/train_collm.py): the paper's marginal-likelihood objective, and a
trained head that the `collm` policy loads and routes with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenrouter import Engine, SamplingParams
from tokenrouter.tools.train_collm import main, marginal_nll


def test_marginal_nll_is_the_mixture_likelihood() -> None:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, generator=gen)
    p_small, p_large = torch.rand(64, generator=gen), torch.rand(64, generator=gen)
    w = torch.sigmoid(z)
    direct = -torch.log((1 - w) * p_small + w * p_large).mean()
    torch.testing.assert_close(marginal_nll(z, p_small.log(), p_large.log()), direct)


def test_head_trains_and_routes_in_the_policy(near_pair: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "collm.safetensors"
    rc = main(["--pair", str(near_pair), "--out", str(ckpt), "--windows", "20", "--window-len", "32",
               "--init-epochs", "1", "--epochs", "8", "--target-share", "0.3", "--device", "cpu"])
    assert rc == 0
    report = json.loads(Path(str(ckpt) + ".json").read_text())
    val = report["validation"]
    # The learned mixture is no worse than the worse model alone, and the reported threshold defers about
    # the share asked for on the validation positions (a quantile: exact up to ties).
    assert val["nll_marginal"] <= max(val["nll_small"], val["nll_large"]) + 1e-6, val
    chosen = next(r for r in val["routed"] if r["threshold"] == report["policy"]["threshold"])
    assert abs(chosen["deferral_rate"] - 0.3) < 0.05, val

    models = {m: {"path": str(near_pair / m), "dtype": "float32", "kv_cache_tokens": 2048} for m in ("small", "large")}
    engine = Engine.from_config({"models": models, "entry": "small", "policy": report["policy"]})
    try:
        outs = engine.generate([[5, 9, 17, 33, 65], [7, 11, 13]], SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                                                    temperature=0.0))
        assert all(len(o.token_ids) == 24 for o in outs)
    finally:
        engine.shutdown()
