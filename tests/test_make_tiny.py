"""The tiny local model set: loadable through transformers, shaped as promised, reusable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tokenrouter.tools.make_tiny import GENERATOR_VERSION, make_tiny

MODELS = ("small", "medium", "large")


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # A private directory, not the shared tiny_dir fixture: the reuse test inspects mtimes.
    return make_tiny(tmp_path_factory.mktemp("tiny") / "set", seed=0)


def test_layout_and_manifest(built: dict[str, Path]) -> None:
    assert set(built) == {*MODELS, "tokenizer"}
    root = built["small"].parent
    manifest = json.loads((root / "MANIFEST.json").read_text())
    assert manifest["seed"] == 0 and manifest["version"] == GENERATOR_VERSION
    for name in MODELS:
        d = built[name]
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), d / f
        assert list(d.glob("*.safetensors"))
    # Nothing from the temporary build directory is left next to the set.
    assert sorted(p.name for p in root.parent.iterdir()) == ["set"]


def test_models_and_tokenizers_load(built: dict[str, Path]) -> None:
    vocab_sizes = set()
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(built[name])
        tok = AutoTokenizer.from_pretrained(built[name])
        assert model.dtype == torch.float32
        assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
        assert model.config.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == 0
        assert model.generation_config.eos_token_id == [tok.eos_token_id, 0]
        assert model.generation_config.do_sample is False
        vocab_sizes |= {model.config.vocab_size, len(tok)}
    assert vocab_sizes == {1024}
    assert len(AutoTokenizer.from_pretrained(built["tokenizer"])) == 1024


def test_shapes(built: dict[str, Path]) -> None:
    small, medium, large = (AutoConfig.from_pretrained(built[n]) for n in MODELS)
    assert large.num_hidden_layers > medium.num_hidden_layers > small.num_hidden_layers
    assert large.hidden_size > medium.hidden_size > small.hidden_size
    assert small.tie_word_embeddings and not large.tie_word_embeddings
    assert all(c.head_dim == 16 and c.num_key_value_heads == 2 for c in (small, medium, large))


def test_large_is_sharded(built: dict[str, Path]) -> None:
    large = built["large"]
    index = json.loads((large / "model.safetensors.index.json").read_text())
    shards = sorted(large.glob("*.safetensors"))
    assert len(shards) > 1
    assert set(index["weight_map"].values()) == {p.name for p in shards}


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  two leading spaces, trailing too  ",
        "def f(x):\n\treturn x ** 2  # square\n",
        "héllo wörld — 日本語のテキスト, emoji 🚀👍🏽, zero\u200bwidth",
        "role markers inline: <|im_start|>user\nhi<|im_end|>",
    ],
)
def test_round_trip(built: dict[str, Path], text: str) -> None:
    tok = AutoTokenizer.from_pretrained(built["tokenizer"])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # No BOS/EOS is added unless asked for.
    assert ids == tok.encode(text, add_special_tokens=True) == tok(text)["input_ids"]


def test_chat_template(built: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built["small"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without.endswith("<|im_end|>\n")


def test_generate_small(built: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built["small"])
    model = AutoModelForCausalLM.from_pretrained(built["small"])
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Count to three."}], add_generation_prompt=True, tokenize=False
    )
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert new.numel() == 8
    assert int(new.max()) < 1024


def test_second_call_reuses(built: dict[str, Path]) -> None:
    root = built["small"].parent
    files = [p for p in root.rglob("*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in files}
    start = time.perf_counter()
    again = make_tiny(root, seed=0)
    assert time.perf_counter() - start < 1.0
    assert again == built
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert sorted(p for p in root.rglob("*") if p.is_file()) == sorted(files)


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenrouter.tools.make_tiny as mt

    real = mt._build_model

    def fail_on_large(name: str, *args, **kwargs) -> None:
        if name == "large":
            raise RuntimeError("simulated crash")
        real(name, *args, **kwargs)

    monkeypatch.setattr(mt, "_build_model", fail_on_large)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_tiny(tmp_path / "set")
    # No half-built set under the target name, and the scratch directory is cleaned up.
    assert list(tmp_path.iterdir()) == []
