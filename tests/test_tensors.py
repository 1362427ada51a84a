"""The Triton tensor interface's sampling_parameters: what vllm_backend's clients send is understood, and
anything else gets a ValueError naming the field (never an internal error). Each sampling rule lives once,
in `SamplingParams.validate`: the in-process API, the Triton JSON and the OpenAI front end refuse a bad
value with the same rule text, each naming the field as its caller spelled it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tokenrouter.sampling_params import WIRE_KEYS, SamplingParams, SamplingParamsError
from tokenrouter.serving.openai import OpenAIError, parse_chat_request, parse_completion_request
from tokenrouter.serving.tensors import parse_sampling_parameters


def test_numbers_as_strings_like_vllm_backend() -> None:
    # genai-perf's --output-tokens-mean sends max_tokens as a string.
    p = parse_sampling_parameters(json.dumps({"max_tokens": "16", "temperature": "0.5", "top_p": "0.9",
                                              "top_k": "5", "seed": "7"}))
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 0.5, 0.9, 5, 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"max_tokens": "sixteen"}', "^max_tokens must be an integer >= 1, got 'sixteen'$"),
        ('{"max_tokens": "0"}', "^max_tokens must be an integer >= 1, got '0'$"),
        ('{"temperature": "warm"}', "^temperature must be a finite number >= 0, got 'warm'$"),
        ('{"temperature": NaN}', "^temperature must be a finite number >= 0, got nan$"),
        ('{"temperature": "inf"}', "^temperature must be a finite number >= 0, got 'inf'$"),
        ('{"seed": 1180591620717411303424}', r"^seed must be an integer in \[0, "),
        ('{"seed": "1.5"}', r"^seed must be an integer in \[0, \d+\], got '1\.5'$"),
        ('{"stop": 5}', r"^stop must be a non-empty string or a list of them \(.*\), got 5$"),
        ('{"stop_token_ids": 5}', "^stop_token_ids must be a list of at most 256 non-negative integers, got 5$"),
        ('{"ignore_eos": "true"}', "^ignore_eos must be a boolean, got 'true'$"),
        ('{"beam_width": 2}', r"^unknown sampling parameter\(s\) \['beam_width'\]; supported: \["),
        ('{"max_tokens": ' + "1" * 5000 + "}", "^sampling_parameters is not valid JSON: Exceeds the limit"),
        ("[" * 10_000 + "]" * 10_000, "nested too deeply"),
        ('{"a": ' * 5_000 + "1" + "}" * 5_000, "nested too deeply"),
    ],
    ids=["int-string", "zero-string", "float-string", "nan", "inf-string", "seed-2^70", "seed-float-string",
         "stop-number", "stop-ids-number", "bool-string", "unknown-key", "huge-int", "deep-array", "deep-object"],
)
def test_bad_sampling_parameters_name_the_field(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sampling_parameters(raw)


def test_a_huge_bad_value_is_quoted_abridged() -> None:
    with pytest.raises(SamplingParamsError) as e:
        parse_sampling_parameters(json.dumps({"stop": ["x" * 100_000, 3] + [1] * 100_000}))
    assert len(str(e.value)) < 300 and str(e.value).startswith("stop must be a non-empty string or a list of them")


# One bad value per row, in its wire (vLLM / OpenAI) name: every path must refuse it by the same rule.
BAD_VALUES: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("max_tokens", "sixteen"),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "warm"),
    ("temperature", False),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_p", "most"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("stop", ""),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop_token_ids", 7),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=lambda v: repr(v)[:20])
def test_one_rule_for_every_path(key: str, value: Any) -> None:
    field = WIRE_KEYS[key]
    with pytest.raises(SamplingParamsError) as in_process:
        SamplingParams(**{field: value}).validate()
    assert in_process.value.field == field and str(in_process.value).startswith(f"{field} {in_process.value.rule}")
    rule = in_process.value.rule

    with pytest.raises(SamplingParamsError) as triton:
        parse_sampling_parameters(json.dumps({key: value}))
    assert (triton.value.field, triton.value.rule) == (key, rule)
    assert str(triton.value).startswith(f"{key} {rule}, got ")

    with pytest.raises(OpenAIError) as openai:
        parse_completion_request({"prompt": "x", key: value})
    assert openai.value.status == 400 and openai.value.param == key
    assert openai.value.message.startswith(f"'{key}' {rule}, got ")


@pytest.mark.parametrize("value", [0, -3, 2.5, "9", True])
def test_openai_max_completion_tokens_is_named_as_sent(value: Any) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": value, "max_tokens": 4}
    with pytest.raises(OpenAIError) as e:
        parse_chat_request(body)
    assert e.value.param == "max_completion_tokens"
    assert e.value.message == f"'max_completion_tokens' must be an integer >= 1, got {value!r}"


def test_only_the_triton_json_reads_numbers_from_strings() -> None:
    # vllm_backend's clients send numbers as strings; the OpenAI API and the in-process API are typed.
    assert parse_sampling_parameters('{"max_tokens": "5", "top_p": "0.5"}').max_new_tokens == 5
    with pytest.raises(OpenAIError, match=r"^'max_tokens' must be an integer >= 1, got '5'$"):
        parse_completion_request({"prompt": "x", "max_tokens": "5"})
    with pytest.raises(SamplingParamsError, match=r"^max_new_tokens must be an integer >= 1, got '5'$"):
        SamplingParams(max_new_tokens="5").validate()  # type: ignore[arg-type]


def test_good_values_agree_across_paths() -> None:
    sent = {"max_tokens": 5, "temperature": 0, "top_p": 1, "top_k": -1, "seed": 2**63 - 1, "stop": "\n",
            "stop_token_ids": [2], "ignore_eos": True}
    triton = parse_sampling_parameters(json.dumps(sent))
    openai = parse_completion_request({"prompt": "x", **sent}).sampling
    # What the front end sends on is what the model then reads, and both equal the in-process object.
    assert parse_sampling_parameters(json.dumps(openai)) == triton
    assert triton == SamplingParams(max_new_tokens=5, temperature=0.0, top_p=1.0, top_k=-1, seed=2**63 - 1,
                                    stop=["\n"], stop_token_ids=[2], ignore_eos=True)
    assert isinstance(triton.temperature, float) and isinstance(openai["top_p"], float)
