"""Bad input is refused with a message naming the problem, queues nothing, and leaves the engine serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_idle, model_cfg
from tokenrouter.config import ConfigError
from tokenrouter.engine.engine import Engine
from tokenrouter.sampling_params import SamplingParams

MODEL = "small"
CONTEXT = 64
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
VALID = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    eng = Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL, max_model_len=CONTEXT)}})
    assert eng.vocab_size == 1024
    yield eng
    for rid in list(eng.requests):
        eng.abort(rid)


@pytest.fixture(scope="module")
def valid_reference(engine: Engine) -> list[int]:
    (out,) = engine.generate([VALID], GREEDY)
    assert len(out.token_ids) == 12
    assert_idle(engine)
    return out.token_ids


def bad_prompts(vocab: int) -> list[tuple[object, str]]:
    return [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, 2, vocab], rf"token id {vocab} at position 2 is out of the vocabulary \(size {vocab}\)"),
        ([-1, 2], "token id -1 at position 0 is out of the vocabulary"),
        ([1, 2.5], "position 1 is not an integer"),
        ([1, True], "position 1 is not an integer"),
        (list(range(CONTEXT)), rf"prompt has {CONTEXT} tokens, but the context limit is {CONTEXT}"),
        ("ab " * CONTEXT, rf"prompt has \d+ tokens, but the context limit is {CONTEXT}"),
    ]


def test_too_long_prompt_is_refused_without_a_tokenizer_warning(engine: Engine, capfd: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A text prompt over the context is refused with our message alone: transformers' warning that the ids are
    longer than the model takes ("... will result in indexing errors") would say the opposite of what happened."""
    monkeypatch.setattr(engine.tokenizer, "model_max_length", CONTEXT)
    monkeypatch.setattr(engine.tokenizer, "deprecation_warnings", {})  # (transformers warns once per tokenizer)
    capfd.readouterr()
    with pytest.raises(ValueError, match=rf"prompt has \d+ tokens, but the context limit is {CONTEXT}"):
        engine.add_request("ab " * CONTEXT, GREEDY)
    assert "sequence length is longer" not in capfd.readouterr().err


BAD_PARAMS = [
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1, got -1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature="0.7"), "temperature must be a finite number >= 0, got '0.7'"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
    (dict(top_k=-2), "top_k must be"),
    (dict(seed=2**64), r"seed must be an integer in \[0, 9223372036854775807\], got 18446744073709551616"),
    (dict(seed=-1), r"seed must be an integer in \[0, "),
    (dict(stop_token_ids=[5000]), r"stop_token_ids token id 5000 .*out of the vocabulary"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list of at most 256 non-negative integers, got 7"),
    (dict(stop_token_ids=[3] * 257), r"stop_token_ids must be a list of at most 256 non-negative integers, got \[3, "),
    (dict(stop=[""]), "stop must be a non-empty string or a list of them"),
    (dict(stop=["x"] * 33), "stop must be a non-empty string or a list of them"),
    (dict(stop=["x" * 257]), "of at most 256 characters"),
    (dict(stop=5), r"stop must be a non-empty string or a list of them \(at most 32, .*\), got 5"),
    (dict(ignore_eos="yes"), "ignore_eos must be a boolean"),
]


def test_bad_prompts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    for prompt, msg in bad_prompts(engine.vocab_size):
        with pytest.raises(ValueError, match=msg):
            engine.add_request(prompt, GREEDY)
        with pytest.raises(ValueError, match="prompt 0: .*" + msg):
            engine.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match="prompt must be a string or a list of token ids, got int"):
        engine.add_request(42, GREEDY)
    # A text far longer than the context can hold is refused before it is tokenized (tokenizing megabytes
    # would stall every other request); one just under the character bound is tokenized and refused by count.
    bound = engine._prompt_bound().max_chars
    calls: list[int] = []
    real = type(engine.tokenizer).__call__

    def counting(self, text, **kw):  # noqa: ANN001, ANN202
        calls.append(len(text))
        return real(self, text, **kw)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", counting)
    with pytest.raises(ValueError, match=f"prompt has {bound + 1} characters, more than a context limit of "):
        engine.add_request("x" * (bound + 1), GREEDY)
    assert calls == []
    with pytest.raises(ValueError, match="tokens, but the context limit is"):
        engine.add_request("x " * (bound // 2), GREEDY)
    assert calls == [bound // 2 * 2]
    monkeypatch.undo()
    # The longest prompt that fits leaves room for exactly one generated token.
    (out,) = engine.generate([list(range(CONTEXT - 1))], SamplingParams(max_new_tokens=5, temperature=0))
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) == 1
    assert_idle(engine)


def test_first_text_prompt_scans_no_vocabulary(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt length bound comes from a scan of the whole vocabulary (a quarter of a second for Qwen3's); the
    engine does it when it starts, so a first request does not wait for it."""
    eng = Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL, max_model_len=CONTEXT)}})

    def scan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the vocabulary was scanned on a request")

    monkeypatch.setattr(type(eng.tokenizer), "get_vocab", scan)
    (out,) = eng.generate(["hello"], GREEDY)
    assert len(out.token_ids) == 12
    assert_idle(eng)


def test_bad_sampling_params(engine: Engine) -> None:
    for kw, msg in BAD_PARAMS:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(VALID, SamplingParams(**kw))
        with pytest.raises(ValueError, match=msg):
            engine.generate([VALID], SamplingParams(**kw))
    assert_idle(engine)


def test_tiny_temperature_samples_greedily_beside_other_requests(engine: Engine, valid_reference: list[int]) -> None:
    """A legal but tiny temperature used to overflow the logits to NaN and fail every request of its step."""
    tiny = SamplingParams(max_new_tokens=12, temperature=1e-300, ignore_eos=True)
    outs = engine.generate([VALID, VALID], [tiny, GREEDY])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == outs[1].token_ids == valid_reference
    assert_idle(engine)


def test_one_bad_prompt_queues_nothing(engine: Engine) -> None:
    with pytest.raises(ValueError, match="prompt 2: prompt is empty"):
        engine.generate([VALID, "hello", []], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate([VALID, VALID], [GREEDY])
    assert not engine.has_unfinished()
    assert engine.step() == []
    assert_idle(engine)


def test_bad_append_and_ids(engine: Engine) -> None:
    rid = engine.add_request(VALID, GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request(VALID, GREEDY, request_id="dup")
    with pytest.raises(KeyError, match="no live request 'nope'"):
        engine.append_tokens("nope", [1])
    with pytest.raises(ValueError, match="at least one token"):
        engine.append_tokens(rid, [])
    with pytest.raises(ValueError, match="appended token id 2000 at position 1 is out of the vocabulary"):
        engine.append_tokens(rid, [1, 2000])
    with pytest.raises(ValueError, match=f"would exceed the context limit {CONTEXT}"):
        engine.append_tokens(rid, [1] * (CONTEXT - len(VALID)))
    out = engine.abort(rid)
    assert out is not None and out.finish_reason == "abort"
    assert engine.abort(rid) is None
    with pytest.raises(KeyError, match="no live request 'dup'"):
        engine.append_tokens(rid, [1])
    assert_idle(engine)


def test_engine_keeps_serving(engine: Engine, valid_reference: list[int]) -> None:
    rid = engine.add_request(VALID, GREEDY)
    got = []
    for o in engine.step():  # prefill: the request is mid-flight when the bad input arrives
        assert o.request_id == rid
        got = o.token_ids
    assert len(got) == 1
    for prompt, msg in bad_prompts(engine.vocab_size):
        with pytest.raises(ValueError, match=msg):
            engine.add_request(prompt, GREEDY)
        with pytest.raises(ValueError, match=msg):
            engine.generate([VALID, prompt], GREEDY)
    for kw, msg in BAD_PARAMS:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(VALID, SamplingParams(**kw))
        with pytest.raises(ValueError, match=msg):
            engine.generate(VALID, SamplingParams(**kw))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(VALID, GREEDY, request_id=rid)
    # Nothing was queued by any of it: only the valid request is in the system.
    assert list(engine.requests) == [rid]
    final = None
    for _ in range(100):
        for o in engine.step():
            assert o.request_id == rid
            if o.finished:
                final = o
        if final is not None:
            break
    assert final is not None and final.finish_reason == "length"
    assert final.token_ids == valid_reference
    assert_idle(engine)


def test_unknown_config_keys(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) in config: \['bogus'\]"):
        Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL)}, "bogus": 1})
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) in models\.small: \['blok_size'\]"):
        Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL, blok_size=4)}})


def test_missing_model_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=r"models\.m\.path: model directory .*no-such-model.* does not exist"):
        Engine.from_config({"models": {"m": {"path": str(missing)}}})
    with pytest.raises(ConfigError, match="has no config.json"):
        Engine.from_config({"models": {"m": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError, match="config file .*missing.yaml.* does not exist"):
        Engine.from_config(tmp_path / "missing.yaml")


def test_bad_config_values(tiny_dir: Path) -> None:
    cases = [
        (dict(block_size=0), r"models\.small\.block_size must be >= 1"),
        (dict(dtype="float64"), r"models\.small\.dtype must be one of"),
        (dict(device="tpu"), r"models\.small\.device must be"),
        (dict(kv_cache_tokens=2), r"models\.small\.kv_cache_tokens must hold at least one block"),
        (dict(max_model_len=1), r"models\.small\.max_model_len must be >= 2"),
        (dict(cuda_graph_max_batch="8"), r"models\.small\.cuda_graph_max_batch must be an integer >= 0"),
        (dict(cuda_graph_max_tokens=-1), r"models\.small\.cuda_graph_max_tokens must be an integer >= 0"),
        (dict(enforce_eager="yes"), r"models\.small\.enforce_eager must be true or false"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL, **kw)}})
    with pytest.raises(ConfigError, match="entry 'nope' is not one of the models"):
        Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL)}, "entry": "nope"})
    with pytest.raises(ConfigError, match=r"models\.small: .*path"):
        Engine.from_config({"models": {MODEL: {"dtype": "float32"}}})


def test_gpu_memory_fractions_must_fit_one_gpu(tiny_dir: Path) -> None:
    """Validated from the config alone (no GPU needed): models sized by fraction on one GPU split it."""
    from tokenrouter.config import load_config

    def gpu_model(name: str, fraction: float, **kw) -> dict:
        return {"path": str(tiny_dir / name), "device": "cuda:0", "kv_memory_fraction": fraction, **kw}

    over = {"models": {"small": gpu_model("small", 0.5), "large": {**gpu_model("large", 0.6), "device": "cuda"}},
            "entry": "small"}
    with pytest.raises(ConfigError, match=r"models on cuda:0 claim kv_memory_fraction 1\.1 .*small: 0\.5, large: 0\.6"):
        load_config(over)
    # Fine: fractions that fit, different GPUs, or a pool sized in tokens.
    for models in (
        {"small": gpu_model("small", 0.3), "large": gpu_model("large", 0.7)},
        {"small": gpu_model("small", 0.9), "large": {**gpu_model("large", 0.9), "device": "cuda:1"}},
        {"small": gpu_model("small", 0.9, kv_cache_tokens=1024), "large": gpu_model("large", 0.9)},
    ):
        load_config({"models": models, "entry": "small"})


def test_context_limited_by_kv_pool(tiny_dir: Path) -> None:
    """Without max_model_len the KV pool bounds the context: one sequence can never outgrow it."""
    eng = Engine.from_config({"models": {MODEL: model_cfg(tiny_dir, MODEL, kv_cache_tokens=32)}})
    with pytest.raises(ValueError, match="prompt has 32 tokens, but the context limit is 32"):
        eng.add_request(list(range(32)))
    (out,) = eng.generate([list(range(28))], SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 28
    assert_idle(eng)


def test_a_failing_step_fails_only_its_own_requests(tiny_dir: Path) -> None:
    """An error inside one model's step (here a policy that raises for one request) fails the requests of
    that step, not the others waiting on the model."""
    from tokenrouter.routing.policy import Policy, register

    @register
    class FailsOnOneRequest(Policy):
        name = "test-fails-on-one-request"
        ARGS = {"request": "bad"}

        def route(self, batch, result):
            if any(r.request_id == self.args["request"] for r in batch):
                raise RuntimeError("policy failure for one request")
            return [self.model] * len(batch)

    small = model_cfg(tiny_dir, MODEL, max_num_seqs=1)  # one request per step: "good" is waiting while "bad" runs
    large = model_cfg(tiny_dir, "large")
    cfg = {"models": {"small": small, "large": large}, "entry": "small",
           "policy": {"name": "test-fails-on-one-request"}, "batching": {"thresholds": {"small": 1, "large": 1}}}
    with Engine.from_config(cfg) as eng:
        eng.add_request(VALID, GREEDY, request_id="bad")
        eng.add_request(VALID, GREEDY, request_id="good")
        finals = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out
        assert finals["bad"].finish_reason == "error" and "policy failure" in finals["bad"].error
        assert finals["good"].finish_reason == "length" and len(finals["good"].token_ids) == 12
        assert_idle(eng)
