"""The model-pair training script (tools/train_pair.py) end to end on the CPU with its smoke shapes: both
models learn (held-out loss falls), they share the tokenizer, and what it saves is a deployment the engine
serves, routed, with greedy output equal to Hugging Face's for the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from tokenrouter import Engine, SamplingParams
from tokenrouter.tools.train_pair import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pair")
    rc = main(["--out", str(out), "--shapes", "smoke", "--steps", "40", "--batch-size", "8", "--seq-len", "64",
               "--max-train-bytes", "1500000", "--eval-windows", "64", "--vocab-size", "1024", "--device", "cpu",
               "--log-every", "0"])
    assert rc == 0
    return out


def test_both_models_learn_and_share_the_tokenizer(pair: Path) -> None:
    report = json.loads((pair / "TRAINING.json").read_text())
    for name in ("small", "large"):
        m = report["models"][name]
        assert m["held_out_loss"] < m["held_out_loss_before"] - 0.3, m  # random init: ~ln(1024) = 6.9
        assert (pair / name / "model.safetensors").is_file()
        assert (pair / name / "tokenizer.json").read_bytes() == (pair / "tokenizer" / "tokenizer.json").read_bytes()
    assert report["models"]["large"]["parameters"] > report["models"]["small"]["parameters"]
    assert report["data"]["held_out_files"] > 0 and report["data"]["train_tokens"] > 0


def test_the_pair_serves_routed_and_matches_transformers(pair: Path) -> None:
    tok = AutoTokenizer.from_pretrained(pair / "small")
    prompt = tok("def main():\n    ", add_special_tokens=False)["input_ids"]
    hf = Qwen3ForCausalLM.from_pretrained(pair / "small", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0]
    small_only = Engine.from_config({"models": {"small": {"path": str(pair / "small"), "dtype": "float32",
                                                          "kv_cache_tokens": 2048}}})
    out = small_only.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0))[0]
    small_only.shutdown()
    assert out.token_ids == ref[len(prompt):].tolist()

    routed = Engine.from_config({
        "models": {m: {"path": str(pair / m), "dtype": "float32", "kv_cache_tokens": 2048} for m in ("small", "large")},
        "entry": "small", "policy": {"name": "random", "p": 0.3, "seed": 0},
    })
    try:
        out = routed.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0))[0]
        assert len(out.token_ids) == 24 and out.stats["tokens_per_model"].get("large", 0) > 0
    finally:
        routed.shutdown()


def test_the_held_out_files_travel_with_the_pair(pair: Path) -> None:
    """Tools that use the pair read its own held-out list (by path and hash), not their machine's split: a
    file listed there is never a training file, and one that changed is used for neither."""
    from tokenrouter.tools.train_pair import HELD_OUT_FILE, pair_split

    listed = json.loads((pair / HELD_OUT_FILE).read_text())["files"]
    train, held, note = pair_split(pair)
    assert {f.name for f in held} and len(held) == len(listed), note
    assert not {f.as_posix() for f in train} & {f.as_posix() for f in held}
    changed = dict(listed[0], sha256="0" * 64)
    (pair / "altered").mkdir(exist_ok=True)
    (pair / "altered" / HELD_OUT_FILE).write_text(json.dumps({"files": [changed, *listed[1:]]}))
    train2, held2, note2 = pair_split(pair / "altered")
    assert len(held2) == len(listed) - 1 and "1 left out" in note2
    assert all(not f.as_posix().endswith(listed[0]["path"]) for f in train2)
