"""The Triton tensor interface (vllm_backend's, so existing clients and tools work unchanged) and the
pure functions that translate it to and from the engine's types."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenrouter.sampling_params import SamplingParams

# The router's interface (model `tokenrouter`, the one clients use).
INPUTS: list[dict[str, Any]] = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_routing_stats", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "routing_stats", "data_type": "TYPE_STRING", "dims": [-1]},
]

# Subservers are internal: the router reaches them over local sockets (transport/ipc.py), never through
# Triton. Their Triton interface is one probe, which the router sends when a subserver's process died: the
# Python backend restarts a dead stub of a (non-decoupled) model when it next gets a request.
SUBSERVER_INPUTS: list[dict[str, Any]] = [{"name": "tokenrouter_probe", "data_type": "TYPE_BOOL", "dims": [1]}]
SUBSERVER_OUTPUTS: list[dict[str, Any]] = [{"name": "tokenrouter_ready", "data_type": "TYPE_BOOL", "dims": [1]}]
# config.pbtxt parameter that tells `auto_complete` which interface a model gets (written by repository.py).
ROLE_PARAMETER = "tokenrouter_role"

# sampling_parameters keys (vLLM's names) -> SamplingParams fields.
_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


def role_of(config: dict[str, Any]) -> str:
    """`router` or `subserver`, from a model config's parameters (no parameter: the router)."""
    return config.get("parameters", {}).get(ROLE_PARAMETER, {}).get("string_value", "router")


def auto_complete(config: Any) -> Any:
    """Declare the tensors and the transaction policy, so config.pbtxt needs only backend and instances: the
    router streams (decoupled); a subserver answers its probe with one response."""
    as_dict = config.as_dict()
    subserver = role_of(as_dict) == "subserver"
    declared_in = {i["name"] for i in as_dict.get("input", [])}
    declared_out = {o["name"] for o in as_dict.get("output", [])}
    for spec in SUBSERVER_INPUTS if subserver else INPUTS:
        if spec["name"] not in declared_in:
            config.add_input(spec)
    for spec in SUBSERVER_OUTPUTS if subserver else OUTPUTS:
        if spec["name"] not in declared_out:
            config.add_output(spec)
    config.set_max_batch_size(0)
    config.set_model_transaction_policy({"decoupled": not subserver})
    return config


def parse_sampling_parameters(raw: str | bytes | None) -> SamplingParams:
    """SamplingParams from the `sampling_parameters` JSON; ValueError names the offending key."""
    if raw is None or raw in ("", b""):
        return SamplingParams()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("sampling_parameters is nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    unknown = sorted(set(data) - set(_SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; supported: {sorted(_SAMPLING_KEYS)}")
    # Numbers may come as strings, as vllm_backend accepts them (genai-perf sends "max_tokens": "16").
    for key, convert in (("max_tokens", int), ("top_k", int), ("seed", int), ("temperature", float), ("top_p", float)):
        if isinstance(data.get(key), str):
            try:
                data[key] = convert(data[key])
            except ValueError:
                kind = "an integer" if convert is int else "a number"
                raise ValueError(f"{key} must be {kind}, got {data[key]!r}") from None
    kwargs = {_SAMPLING_KEYS[k]: v for k, v in data.items() if v is not None}
    for key in ("temperature", "top_p"):
        if key in kwargs:
            if isinstance(kwargs[key], bool) or not isinstance(kwargs[key], int | float):
                raise ValueError(f"{key} must be a number, got {kwargs[key]!r}")
            kwargs[key] = float(kwargs[key])
    if "max_new_tokens" in kwargs and (
        isinstance(kwargs["max_new_tokens"], bool) or not isinstance(kwargs["max_new_tokens"], int)
        or kwargs["max_new_tokens"] < 1
    ):
        raise ValueError(f"max_tokens must be an integer >= 1, got {data['max_tokens']!r}")
    if "ignore_eos" in kwargs and not isinstance(kwargs["ignore_eos"], bool):
        raise ValueError(f"ignore_eos must be a boolean, got {kwargs['ignore_eos']!r}")
    params = SamplingParams(**kwargs)
    params.validate()
    return params


@dataclass
class GenerateRequest:
    """A client request to the router, decoded and validated."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_output_tokens: bool = False
    return_finish_reason: bool = False
    return_routing_stats: bool = False


def parse_request(get: Any) -> GenerateRequest:
    """`get(name)` returns the numpy array of an input or None. ValueError for anything malformed."""
    text = get("text_input")
    if text is None or text.size == 0:
        raise ValueError("missing required input 'text_input'")
    prompt = text.reshape(-1)[0]
    if isinstance(prompt, bytes):
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("text_input is not valid UTF-8") from None
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("text_input must be a non-empty string")
    raw = get("sampling_parameters")
    params = parse_sampling_parameters(None if raw is None else raw.reshape(-1)[0])

    def flag(name: str) -> bool:
        v = get(name)
        return bool(v.reshape(-1)[0]) if v is not None and v.size else False

    return GenerateRequest(
        prompt,
        params,
        stream=flag("stream"),
        exclude_input_in_output=flag("exclude_input_in_output"),
        return_num_output_tokens=flag("return_num_output_tokens"),
        return_finish_reason=flag("return_finish_reason"),
        return_routing_stats=flag("return_routing_stats"),
    )
