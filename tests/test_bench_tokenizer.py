"""The benchmark tokenizer: every id is a distinct non-empty piece, text round-trips, the engine streams it."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import yaml

from tokenrouter import Engine, SamplingParams, load_config
from tokenrouter.cli import main
from tokenrouter.tokenizer import decode, load_tokenizer
from tokenrouter.tools.bench_tokenizer import (
    QWEN3_VOCAB_SIZE,
    UNK,
    ensure_bench_tokenizer,
    is_bench_tokenizer,
    make_bench_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
QWEN3_CONFIGS = sorted((REPO / "config").glob("*/qwen3-*.yaml"))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB = 1024


@pytest.fixture(scope="module")
def full(bench_tokenizer_dir: Path):
    return load_tokenizer(str(bench_tokenizer_dir))


@pytest.fixture(scope="module")
def tiny_bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bench_tokenizer(tmp_path_factory.mktemp("bench") / "bench-tokenizer", vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny(tiny_bench_dir: Path):
    return load_tokenizer(str(tiny_bench_dir))


def _pieces(tok) -> list[str]:
    # The Rust decoder that `tok.decode` calls, over the whole vocabulary in one call (transformers'
    # per-call overhead would make 151,936 separate decodes take many seconds).
    return tok.backend_tokenizer.decode_batch([[i] for i in range(len(tok))], skip_special_tokens=False)


def _piece_problems(tok) -> list[str]:
    """What breaks "one id, one distinct non-empty piece": empty pieces and pieces shared by several ids."""
    pieces = _pieces(tok)
    problems = [f"id {i} decodes to nothing" for i, p in enumerate(pieces) if not p]
    seen: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p and p in seen:
            problems.append(f"ids {seen[p]} and {i} both decode to {p!r}")
        seen.setdefault(p, i)
    return problems


def _mixed_ids(rng: random.Random, pieces: list[str], n: int) -> list[int]:
    """Ids drawn so that characters, `|` pieces, specials and <|unk|> often sit next to each other (uniform
    draws over 151,936 ids would almost never put two single characters side by side)."""
    chars = [i for i, p in enumerate(pieces) if len(p) == 1]
    specials = [pieces.index(t) for t in (*SPECIALS, UNK)]
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.4:
            ids.append(rng.choice(chars))
        elif r < 0.5:
            ids.append(rng.choice(specials))
        elif r < 0.6 and ids:
            ids.append(ids[-1])  # the same id twice in a row
        else:
            ids.append(rng.randrange(len(pieces)))
    return ids


def test_every_id_is_a_distinct_nonempty_piece(full, tiny) -> None:
    assert len(full) == QWEN3_VOCAB_SIZE and len(tiny) == TINY_VOCAB
    assert _piece_problems(full) == []
    assert _piece_problems(tiny) == []
    # The batch decode above is what the engine's decode does, one id at a time.
    pieces = _pieces(full)
    for i in random.Random(0).sample(range(len(full)), 500):
        assert full.decode([i]) == pieces[i]


def test_the_check_catches_a_tokenizer_that_drops_ids(tiny_dir: Path) -> None:
    # The tiny models' byte-level BPE: partial UTF-8 bytes decode to the same replacement character.
    assert _piece_problems(load_tokenizer(str(tiny_dir / "tokenizer")))


@pytest.mark.parametrize("which", ["full", "tiny"])
def test_text_round_trips_to_the_same_ids(which: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(which)
    pieces = _pieces(tok)
    special_ids = set(tok.all_special_ids)
    rng = random.Random(1)
    for n in range(1, 200):
        ids = _mixed_ids(rng, pieces, n) if n % 2 else [rng.randrange(len(tok)) for _ in range(n)]
        text = tok.decode(ids)
        assert text == "".join(pieces[i] for i in ids)
        assert tok(text)["input_ids"] == ids, text
        # What the engine streams: special tokens show no text (as with Qwen3's own tokenizer), the rest
        # concatenate, and re-encoding that text gives back exactly the non-special ids.
        shown = decode(tok, ids)
        assert shown == "".join(pieces[i] for i in ids if i not in special_ids)
        assert tok(shown)["input_ids"] == [i for i in ids if i not in special_ids]


def test_any_text_encodes(full) -> None:
    ascii_text = 'def f(x):\n\treturn {"a": x[0] + 1}  # ok\r\n'
    ids = full(ascii_text)["input_ids"]
    assert len(ids) == len(ascii_text) and full.decode(ids) == ascii_text  # one token per character
    unk = full.convert_tokens_to_ids(UNK)
    assert full("héllo 你好 a|b")["input_ids"].count(unk) == 4  # é, 你, 好 and the `|` marker character
    assert full("x<|im_end|>")["input_ids"][1:] == [full.eos_token_id]


def test_qwen3_ids_match_the_model_configs(full, bench_tokenizer_dir: Path) -> None:
    assert (full.eos_token, full.eos_token_id) == ("<|im_end|>", 151645)
    assert (full.pad_token, full.pad_token_id) == ("<|endoftext|>", 151643)
    assert full.convert_ids_to_tokens(151644) == "<|im_start|>"
    for model in sorted((REPO / "perf" / "models").glob("qwen3-*")):
        cfg = json.loads((model / "config.json").read_text())
        gen = json.loads((model / "generation_config.json").read_text())
        assert cfg["vocab_size"] == len(full), model.name
        assert full.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"
        assert full.convert_ids_to_tokens(cfg["bos_token_id"]) == "<|endoftext|>"
        assert full.convert_ids_to_tokens(gen["eos_token_id"]) == ["<|im_end|>", "<|endoftext|>"]
    # Every Qwen3 deployment names this directory: what `make-bench-tokenizer` writes from the repo root.
    assert len(QWEN3_CONFIGS) >= 9
    for path in QWEN3_CONFIGS:
        assert Path(load_config(path).tokenizer_path) == bench_tokenizer_dir, path


def test_tiny_ids_match_the_tiny_models(tiny, tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "small" / "config.json").read_text())
    assert cfg["vocab_size"] == len(tiny)
    assert tiny.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>" == tiny.eos_token
    assert tiny.convert_ids_to_tokens(cfg["pad_token_id"]) == "<|endoftext|>"


def test_chat_template(full) -> None:
    text = full.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = full(text)["input_ids"]
    assert ids.count(151644) == 2 and ids.count(151645) == 1


def test_engine_streams_one_piece_per_token(tiny_dir: Path, tiny_bench_dir: Path, tiny) -> None:
    # The tiny routed deployment with the bench tokenizer in place of the tiny BPE one.
    cfg = load_config(REPO / "config" / "r2r" / "tiny-small_tiny-large.yaml")
    cfg = dataclasses.replace(cfg, tokenizer=str(tiny_bench_dir))
    pieces = _pieces(tiny)
    special_ids = set(tiny.all_special_ids)
    deltas: dict[str, list[tuple[list[int], str]]] = {}
    finals = {}

    def listen(out) -> None:
        deltas.setdefault(out.request_id, []).append((out.delta_token_ids, out.delta_text))
        if out.finished:
            finals[out.request_id] = out

    with Engine.from_config(cfg) as engine:
        assert len(engine.tokenizer) == engine.vocab_size == TINY_VOCAB
        for seed in range(4):  # sampled, so the outputs cover many ids rather than a greedy loop
            params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)
            engine.add_request(f"prompt {seed}: def f(x):", params, listener=listen)
        while engine.has_unfinished():
            engine.step()
        engine.check_integrity()
    assert len(finals) == 4
    for rid, out in finals.items():
        assert len(out.token_ids) == 32 and out.finish_reason == "length"
        assert len(set(out.token_ids)) > 10
        for ids, text in deltas[rid]:
            assert text == "".join(pieces[i] for i in ids if i not in special_ids)
        shown = [i for i in out.token_ids if i not in special_ids]
        assert all(pieces[i] for i in shown)  # so every one of them streamed some text
        assert tiny(out.text)["input_ids"] == shown
        assert len(shown) >= 28  # specials (3 of 1,024 ids) are rare; everything else streamed text


def test_build_is_deterministic_reused_and_careful(tmp_path: Path) -> None:
    a = make_bench_tokenizer(tmp_path / "a", vocab_size=500)
    b = make_bench_tokenizer(tmp_path / "b", vocab_size=500)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    mtime = (a / "tokenizer.json").stat().st_mtime_ns
    assert make_bench_tokenizer(a, vocab_size=500) == a
    assert (a / "tokenizer.json").stat().st_mtime_ns == mtime  # reused, not rewritten
    make_bench_tokenizer(a, vocab_size=600)  # another size replaces it
    assert len(load_tokenizer(str(a))) == 600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary folders left behind
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "tokenizer.json").write_text("{}")
    with pytest.raises(FileExistsError):
        make_bench_tokenizer(foreign, vocab_size=500)
    assert is_bench_tokenizer(a) and not is_bench_tokenizer(foreign) and not is_bench_tokenizer(None)
    with pytest.raises(ValueError, match="at least"):
        make_bench_tokenizer(tmp_path / "c", vocab_size=50)


def test_ensure_builds_what_a_config_names(tmp_path: Path, tiny_dir: Path) -> None:
    cfg = {"models": {"small": {"path": str(tiny_dir / "small")}}, "tokenizer": "toks/bench-tokenizer"}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="make-bench-tokenizer"):
        load_config(path)  # missing: the error says how to build it
    built = ensure_bench_tokenizer(path)
    assert built == tmp_path / "toks" / "bench-tokenizer"
    assert len(load_tokenizer(load_config(path).tokenizer_path)) == TINY_VOCAB  # sized to the entry model
    # A tokenizer directory of another name is never generated.
    path.write_text(yaml.safe_dump({**cfg, "tokenizer": "toks/qwen3"}))
    assert ensure_bench_tokenizer(path) is None and not (tmp_path / "toks" / "qwen3").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench-tokenizer"
    assert main(["make-bench-tokenizer", "--out", str(out), "--vocab-size", "2048"]) == 0
    assert str(out) in capsys.readouterr().out
    assert len(load_tokenizer(str(out))) == 2048
    assert main(["make-bench-tokenizer", "--out", str(tmp_path / "x"), "--vocab-size", "10"]) == 2
