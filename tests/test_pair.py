"""The committed trained pair (models/pair, tools/train_pair.py) and the default deployment that serves it:
the large model is better than the small one on held-out text, recomputed here with transformers, and the
deployment's relative paths (models and router checkpoint) resolve against its YAML, from any directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from tokenrouter.config import load_config
from tokenrouter.serving.server import DEFAULT_CONFIG
from tokenrouter.tools.bpe import read_sources
from tokenrouter.tools.train_pair import pair_split

REPO = Path(__file__).resolve().parents[1]
PAIR = REPO / "models" / "pair"


@torch.no_grad()
def test_large_model_is_better_on_held_out_files() -> None:
    _, held, _ = pair_split(PAIR)
    assert len(held) >= 10, "the pair's held-out files should be on this machine"
    tok = AutoTokenizer.from_pretrained(PAIR / "small")
    tok.model_max_length = 1 << 30
    windows = [ids[:129] for ids in (tok(t, add_special_tokens=False)["input_ids"] for t in read_sources(held[:12]))
               if len(ids) > 129]
    x = torch.tensor(windows[:8])
    loss = {}
    for name in ("small", "large"):
        model = Qwen3ForCausalLM.from_pretrained(PAIR / name, dtype=torch.float32).eval()
        logits = model(x[:, :-1]).logits
        flat = logits.reshape(-1, logits.shape[-1])
        loss[name] = float(torch.nn.functional.cross_entropy(flat, x[:, 1:].reshape(-1)))
    assert loss["large"] < loss["small"] - 0.1, loss
    recorded = json.loads((PAIR / "TRAINING.json").read_text())["models"]
    assert recorded["large"]["held_out_loss"] < recorded["small"]["held_out_loss"], recorded


def test_default_deployment_loads_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a server's working directory is not the repository
    cfg = load_config(os.path.relpath(DEFAULT_CONFIG, tmp_path))
    assert cfg.policy["name"] == "r2r"
    checkpoint = Path(cfg.policy["checkpoint"])
    assert checkpoint.is_absolute() and checkpoint == PAIR / "r2r_router.safetensors"
    assert [Path(m.path) for m in cfg.models.values()] == [PAIR / "small", PAIR / "large"]


def test_policy_file_arguments_resolve_against_the_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GlimpRouter's `tokenizer` follows the same rule as a router `checkpoint` (one place: POLICY_PATH_ARGS)."""
    cfg = {"models": {"small": {"path": str(PAIR / "small")}, "large": {"path": str(PAIR / "large")}},
           "entry": "small", "policy": {"name": "glimprouter", "tokenizer": "pair/tokenizer"}}
    (tmp_path / "deploy.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    (tmp_path / "pair").symlink_to(PAIR)
    monkeypatch.chdir(REPO)
    assert load_config(tmp_path / "deploy.yaml").policy["tokenizer"] == str(PAIR / "tokenizer")
