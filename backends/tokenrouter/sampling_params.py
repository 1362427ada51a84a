"""Per-request sampling and stopping parameters, and the one place their rules live.

`SamplingParams.validate` holds every value rule; the in-process API calls it directly. The two wire
formats (Triton's `sampling_parameters` JSON and the OpenAI front end) share vLLM's key names and go
through `SamplingParams.from_wire`, which reports a broken rule under the key the client sent.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request samples greedily: dividing logits by a smaller one overflows to inf
# (and the softmax to NaN), which would fail the whole batch's step (vLLM draws the same line).
GREEDY_BELOW = 1e-5
SEED_RANGE = (0, 2**63 - 1)  # what torch.Generator.manual_seed takes
MAX_STOPS, MAX_STOP_CHARS = 32, 256
MAX_STOP_TOKEN_IDS = 256

# The wire names (vLLM's `sampling_parameters` keys, which the OpenAI API shares) -> SamplingParams fields.
WIRE_KEYS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
_WIRE_KEY_OF = {f: k for k, f in WIRE_KEYS.items()}
# What a number sent as a string becomes (`from_wire(..., numbers_as_strings=True)`).
_FROM_STRING: dict[str, Callable[[str], Any]] = {
    "max_tokens": int, "top_k": int, "seed": int, "temperature": float, "top_p": float,
}
# How a bad value is quoted back in an error: in full when short, abridged when a client sent a huge one.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 10, 10, 10
_SHOWN.maxstring = _SHOWN.maxlong = _SHOWN.maxother = 80


def _is_int(v: object) -> bool:
    # bool is a subclass of int, but `"max_tokens": true` is a client bug, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# field -> (accepts(value), the rule as the error states it). Every sampling value rule, and only here.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "temperature": (lambda v: _is_real(v) and v >= 0.0, "must be a finite number >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "must be -1, 0 (disabled) or a positive integer"),
    "top_p": (lambda v: _is_real(v) and 0.0 < v <= 1.0, "must be a number in (0, 1]"),
    "seed": (
        lambda v: v is None or (_is_int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1]),
        f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
    ),
    # Bounded: they travel with the request on every handoff and are looked up after every token, so a request
    # with 1,000,000 of them took 40 s for 100 tokens and held another stream's tokens up to 2.2 s apart (CPU).
    "stop_token_ids": (
        lambda v: isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in v),
        f"must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers",
    ),
    # Bounded: stop strings are matched in the model's decode loop after every token, so a request with
    # 200,000 of them slowed every other request on that model 20x.
    "stop": (
        lambda v: isinstance(v, list) and len(v) <= MAX_STOPS
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v),
        f"must be a non-empty string or a list of them (at most {MAX_STOPS}, of at most {MAX_STOP_CHARS} characters)",
    ),
    "ignore_eos": (lambda v: isinstance(v, bool), "must be a boolean"),
}


class SamplingParamsError(ValueError):
    """A sampling value that breaks its rule: `field` as the caller named it (a SamplingParams field from
    `validate`, the wire key from `from_wire`), `rule` ("must be ..."), and the `value` given."""

    def __init__(self, field: str, rule: str, value: Any) -> None:
        shown = _SHOWN.repr(value)
        super().__init__(f"{field} {rule}, got {shown}")
        self.field, self.rule, self.value, self.shown = field, rule, value, shown

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, though its args differ from the message's
        return type(self), (self.field, self.rule, self.value)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below GREEDY_BELOW) means greedy. top_k 0 (or -1) and top_p 1.0 disable those
    filters. A seed makes the request's samples reproducible regardless of what it is batched with.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Copies of lists; anything else is left for validate() to name.
        if isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise SamplingParamsError (a ValueError) naming the first bad field and what it accepts."""
        for name, (accepts, rule) in _RULES.items():
            value = getattr(self, name)
            if not accepts(value):
                raise SamplingParamsError(name, rule, value)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, numbers_as_strings: bool = False) -> SamplingParams:
        """Validated SamplingParams from vLLM-named keys (`WIRE_KEYS`); a null value means the default.

        `numbers_as_strings` takes "16" for 16, as vllm_backend does (genai-perf sends `"max_tokens": "16"`).
        An unknown key is a ValueError; a broken rule a SamplingParamsError whose `field` is the wire key
        and `value` what was sent under it.
        """
        unknown = sorted(set(data) - set(WIRE_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; supported: {sorted(WIRE_KEYS)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if value is None:
                continue
            if numbers_as_strings and isinstance(value, str) and key in _FROM_STRING:
                with contextlib.suppress(ValueError):  # left a string: the rule below names it
                    value = _FROM_STRING[key](value)
            kwargs[WIRE_KEYS[key]] = value
        params = cls(**kwargs)
        try:
            params.validate()
        except SamplingParamsError as e:
            key = _WIRE_KEY_OF[e.field]
            raise SamplingParamsError(key, e.rule, data.get(key, e.value)) from None
        # Floats whatever the JSON spelled (0 -> 0.0), so what goes on is one type.
        params.temperature, params.top_p = float(params.temperature), float(params.top_p)
        return params
