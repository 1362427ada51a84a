"""Sampling and stopping: seeded reproducibility regardless of batching, filters, stop tokens and strings,
length limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_idle, make_engine
from tokenrouter.engine.engine import Engine
from tokenrouter.runner.sampler import sample
from tokenrouter.sampling_params import SamplingParams, SamplingParamsError

MODEL = "large"
PROMPT = "def main():\n    "
OTHERS = ["import os\n", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "class A:", [900] * 30]
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123, max_new_tokens=32, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)


def params(base: SamplingParams, **kw) -> SamplingParams:
    d = dict(base.__dict__)
    d.update(kw)
    return SamplingParams(**d)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    eng = make_engine(tiny_dir, MODEL)
    yield eng
    for rid in list(eng.requests):
        eng.abort(rid)


@pytest.fixture(scope="module")
def greedy_out(engine: Engine):
    (out,) = engine.generate([PROMPT], GREEDY)
    assert_idle(engine)
    return out


@pytest.fixture(scope="module")
def seeded_alone(engine: Engine) -> list[int]:
    (out,) = engine.generate([PROMPT], SEEDED)
    assert len(out.token_ids) == 32
    assert_idle(engine)
    return out.token_ids


def test_seeded_is_random_but_reproducible(engine: Engine, seeded_alone, greedy_out) -> None:
    assert seeded_alone != greedy_out.token_ids  # it really sampled
    (again,) = engine.generate([PROMPT], SEEDED)
    assert again.token_ids == seeded_alone
    assert_idle(engine)


def test_seeded_same_when_batched(engine: Engine, seeded_alone) -> None:
    others = [
        params(SEEDED, seed=7),
        GREEDY,
        params(SEEDED, seed=None, max_new_tokens=20),
        params(SEEDED, temperature=1.3, top_k=0, top_p=1.0, seed=99, max_new_tokens=40),
    ]
    outs = engine.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:] + [PROMPT], others[:2] + [SEEDED] + others[2:] + [SEEDED])
    assert outs[2].token_ids == seeded_alone
    assert outs[5].token_ids == seeded_alone  # the same seed twice in one batch: independent generators
    assert_idle(engine)


def test_seeded_same_when_staggered_with_chunked_prefill(tiny_dir: Path, seeded_alone) -> None:
    eng = make_engine(tiny_dir, MODEL, max_num_batched_tokens=8)
    a = eng.add_request(OTHERS[3], params(SEEDED, seed=1))
    eng.step()
    b = eng.add_request(PROMPT, SEEDED)
    eng.step()
    eng.add_request(OTHERS[0], params(SEEDED, seed=2))
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[b].token_ids == seeded_alone
    assert len(finished[a].token_ids) == 32
    assert_idle(eng)


def test_seeded_same_after_preemption(tiny_dir: Path, engine: Engine) -> None:
    seeds = [11, 12, 13, 14, 15]
    plist = [params(SEEDED, seed=s, max_new_tokens=40) for s in seeds]
    prompts = [[100 + i] * (8 + 5 * i) for i in range(len(seeds))]
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, plist)]
    assert_idle(engine)
    small = make_engine(tiny_dir, MODEL, kv_cache_tokens=128)
    outs = small.generate(prompts, plist)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_idle(small)


def test_different_seeds_differ(engine: Engine, seeded_alone) -> None:
    outs = engine.generate([PROMPT] * 3, [params(SEEDED, seed=s) for s in (124, 125, 126)])
    seqs = [tuple(o.token_ids) for o in outs] + [tuple(seeded_alone)]
    assert len(set(seqs)) == 4
    assert_idle(engine)


def test_degenerate_filters_equal_greedy(engine: Engine, greedy_out) -> None:
    variants = [
        params(SEEDED, top_k=1),
        params(SEEDED, top_k=1, top_p=1.0, temperature=1.5, seed=None),
        params(SEEDED, top_k=0, top_p=1e-6),
    ]
    outs = engine.generate([PROMPT] * len(variants), variants)
    for o in outs:
        assert o.token_ids == greedy_out.token_ids
    assert_idle(engine)


def test_filters_restrict_the_support() -> None:
    """Direct sampler check: top-k keeps the k best, top-p the smallest head reaching p."""
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    gen = torch.Generator().manual_seed(0)

    def draws(p: SamplingParams, n: int = 300) -> set[int]:
        return {int(sample(logits, [p], [gen])[0]) for _ in range(n)}

    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {1, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=3)) == {1, 3, 4}
    # Sorted: 0.4, 0.3, 0.15, ...: 0.4 < 0.6, 0.7 >= 0.6, so the head is {1, 3}.
    assert draws(SamplingParams(temperature=1.0, top_p=0.6)) == {1, 3}
    assert draws(SamplingParams(temperature=1.0, top_p=0.75)) == {1, 3, 4}
    assert draws(SamplingParams(temperature=1.0, top_p=0.4)) == {1}
    assert draws(SamplingParams(temperature=0.0)) == {1}
    # A seeded generator makes the draws reproducible.
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    p = SamplingParams(temperature=1.0)
    a = [int(sample(logits, [p], [g1])[0]) for _ in range(50)]
    b = [int(sample(logits, [p], [g2])[0]) for _ in range(50)]
    assert a == b


def test_stop_token_ids(engine: Engine, greedy_out) -> None:
    toks = greedy_out.token_ids
    j = next(j for j in range(2, len(toks)) if toks[j] not in toks[:j])
    (out,) = engine.generate([PROMPT], params(GREEDY, stop_token_ids=[toks[j]]))
    assert out.finish_reason == "stop"
    assert out.token_ids == toks[: j + 1]
    assert out.token_ids[-1] == toks[j]
    assert_idle(engine)


def test_stop_string_cuts_text(engine: Engine, greedy_out) -> None:
    toks = greedy_out.token_ids
    tok = engine.tokenizer

    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    assert greedy_out.text == text(toks)
    # A stop string that first appears, complete, exactly when token k arrives.
    chosen = None
    for k in range(3, len(toks)):
        t = text(toks[:k])
        if not t.isascii() or len(t) <= len(text(toks[: k - 1])):
            continue
        s = t[-2:]
        if s.strip() and t.find(s) == len(t) - len(s) and len(t) > len(s):
            chosen = (k, s, t)
            break
    assert chosen is not None, f"no usable stop string in {greedy_out.text!r}"
    k, s, t = chosen
    (out,) = engine.generate([PROMPT], params(GREEDY, stop=[s, "\x00never"]))
    assert out.finish_reason == "stop"
    assert out.token_ids == toks[:k]
    assert out.text == t[: len(t) - len(s)]
    assert s not in out.text
    assert_idle(engine)


@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_new_tokens(engine: Engine, n: int) -> None:
    (out,) = engine.generate([PROMPT], params(SEEDED, max_new_tokens=n))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == n
    assert_idle(engine)


def test_max_new_tokens_without_ignore_eos(engine: Engine) -> None:
    eos = set(engine.runner.arch.eos_token_ids)
    assert eos
    outs = engine.generate([PROMPT] + OTHERS, params(SEEDED, ignore_eos=False, max_new_tokens=24))
    for o in outs:
        if o.finish_reason == "length":
            assert len(o.token_ids) == 24 and not eos & set(o.token_ids)
        else:
            assert o.finish_reason == "stop" and o.token_ids[-1] in eos
            assert not eos & set(o.token_ids[:-1])
    assert_idle(engine)


# Wrongly typed values (what a JSON or YAML client sends by mistake) each name the field and what it accepts;
# tests/test_bad_input.py drives the common ones through a live engine.
WRONG_TYPES = [
    (dict(max_new_tokens=2.0), r"max_new_tokens must be an integer >= 1, got 2\.0"),
    (dict(max_new_tokens="5"), r"max_new_tokens must be an integer >= 1, got '5'"),
    (dict(temperature=True), r"temperature must be a finite number >= 0, got True"),
    (dict(temperature=None), r"temperature must be a finite number >= 0, got None"),
    (dict(temperature=float("-inf")), r"temperature must be a finite number >= 0, got -inf"),
    (dict(top_k=1.5), r"top_k must be -1, 0 \(disabled\) or a positive integer, got 1\.5"),
    (dict(top_k=True), r"top_k must be -1, 0 \(disabled\) or a positive integer, got True"),
    (dict(top_p="0.9"), r"top_p must be a number in \(0, 1\], got '0\.9'"),
    (dict(top_p=float("inf")), r"top_p must be a number in \(0, 1\], got inf"),
    (dict(seed=True), r"seed must be an integer in \[0, \d+\], got True"),
    (dict(seed="1"), r"seed must be an integer in \[0, \d+\], got '1'"),
    (dict(seed=1.0), r"seed must be an integer in \[0, \d+\], got 1\.0"),
    (dict(stop_token_ids=[True]), r"stop_token_ids must be a list of at most 256 non-negative integers, got \[True\]"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be a list of at most 256 non-negative integers, got \[-1\]"),
    (dict(stop_token_ids="5"), r"stop_token_ids must be a list of at most 256 non-negative integers, got '5'"),
    (dict(stop=None), r"stop must be a non-empty string or a list of them \(.*\), got None"),
    (dict(stop=["a", 3]), r"stop must be a non-empty string or a list of them \(.*\), got \['a', 3\]"),
    (dict(ignore_eos=1), r"ignore_eos must be a boolean, got 1"),
]


@pytest.mark.parametrize(("kw", "msg"), WRONG_TYPES, ids=lambda v: str(v)[:30])
def test_validate_names_field_and_range(kw: dict, msg: str) -> None:
    with pytest.raises(SamplingParamsError, match=f"^{msg}$") as e:
        SamplingParams(**kw).validate()
    # The field travels with the error, so the wire formats can name it as their client spelled it.
    assert isinstance(e.value, ValueError) and e.value.field == next(iter(kw))


def test_validate_accepts_the_documented_forms() -> None:
    for kw in (dict(stop="x"), dict(stop_token_ids=(1, 2)), dict(top_k=-1), dict(temperature=0), dict(top_p=1),
               dict(seed=0), dict(seed=2**63 - 1), dict(temperature=1e-300)):
        SamplingParams(**kw).validate()
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token() -> None:
    """top_p=1e-320 is a valid number in (0, 1] but 0 in float32: the filter must still keep one token
    (it used to drop all, and the NaN probabilities failed every request batched with it)."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 0.5], [2.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_p=1e-320), SamplingParams(temperature=1.0, top_p=1e-46)]
    for _ in range(5):
        assert sample(logits, params, [None, None]).tolist() == [1, 0]


def test_batched_filter_equals_the_per_row_filter() -> None:
    """Unseeded rows are filtered together: every row's distribution must equal the one-row filter's."""
    from tokenrouter.runner.sampler import _filter, _filter_rows

    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    params = [
        SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.5),
        SamplingParams(temperature=0.7, top_k=2000, top_p=0.9),  # top_k past the vocabulary: no top-k
    ]
    batched = _filter_rows(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], _filter(logits[i], p), rtol=0, atol=1e-6)
    assert (batched[2] > 0).sum() == 5 and (batched[0] > 0).sum() <= 20
