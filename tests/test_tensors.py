"""The Triton tensor interface's sampling_parameters: what vllm_backend's clients send is understood, and
anything else gets a ValueError naming the field (never an internal error)."""

from __future__ import annotations

import json

import pytest

from tokenrouter.serving.tensors import parse_sampling_parameters


def test_numbers_as_strings_like_vllm_backend() -> None:
    # genai-perf's --output-tokens-mean sends max_tokens as a string.
    p = parse_sampling_parameters(json.dumps({"max_tokens": "16", "temperature": "0.5", "top_p": "0.9",
                                              "top_k": "5", "seed": "7"}))
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 0.5, 0.9, 5, 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"max_tokens": "sixteen"}', "max_tokens must be an integer, got 'sixteen'"),
        ('{"temperature": "warm"}', "temperature must be a number, got 'warm'"),
        ('{"temperature": NaN}', "temperature must be a finite number >= 0, got nan"),
        ('{"temperature": "inf"}', "temperature must be a finite number >= 0, got inf"),
        ('{"seed": 1180591620717411303424}', r"seed must be an integer in \[0, "),
        ('{"stop": 5}', "stop must be a non-empty string or a list of them, got 5"),
        ('{"stop_token_ids": 5}', "stop_token_ids must be a list of non-negative integers, got 5"),
        ("[" * 10_000 + "]" * 10_000, "nested too deeply"),
        ('{"a": ' * 5_000 + "1" + "}" * 5_000, "nested too deeply"),
    ],
    ids=["int-string", "float-string", "nan", "inf-string", "seed-2^70", "stop-number", "stop-ids-number",
         "deep-array", "deep-object"],
)
def test_bad_sampling_parameters_name_the_field(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sampling_parameters(raw)
