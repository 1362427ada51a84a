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
# A peer gateway (serving/peer_model.py) offers a subserver to a router on another server: a connection's
# request streams its events back (decoupled); message batches come in further requests.
PEER_INPUTS: list[dict[str, Any]] = [
    {"name": "tokenrouter_connection", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "tokenrouter_messages", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
]
PEER_OUTPUTS: list[dict[str, Any]] = [{"name": "tokenrouter_events", "data_type": "TYPE_STRING", "dims": [1]}]
# How the router's error for a request aborted at request_timeout_s begins (frontends map it to a timeout).
TIMEOUT_ERROR = "request unfinished after request_timeout_s"
# config.pbtxt parameter that tells `auto_complete` which interface a model gets (written by repository.py).
ROLE_PARAMETER = "tokenrouter_role"


def role_of(config: dict[str, Any]) -> str:
    """`router`, `subserver` or `peer`, from a model config's parameters (no parameter: the router)."""
    return config.get("parameters", {}).get(ROLE_PARAMETER, {}).get("string_value", "router")


def auto_complete(config: Any) -> Any:
    """Declare the tensors and the transaction policy, so config.pbtxt needs only backend and instances: the
    router and a peer gateway stream (decoupled); a subserver answers its probe with one response."""
    as_dict = config.as_dict()
    role = role_of(as_dict)
    inputs, outputs = {"subserver": (SUBSERVER_INPUTS, SUBSERVER_OUTPUTS), "peer": (PEER_INPUTS, PEER_OUTPUTS)}.get(
        role, (INPUTS, OUTPUTS))
    declared_in = {i["name"] for i in as_dict.get("input", [])}
    declared_out = {o["name"] for o in as_dict.get("output", [])}
    for spec in inputs:
        if spec["name"] not in declared_in:
            config.add_input(spec)
    for spec in outputs:
        if spec["name"] not in declared_out:
            config.add_output(spec)
    config.set_max_batch_size(0)
    config.set_model_transaction_policy({"decoupled": role != "subserver"})
    return config


def parse_sampling_parameters(raw: str | bytes | None) -> SamplingParams:
    """SamplingParams from the `sampling_parameters` JSON; ValueError names the offending key as sent."""
    if raw is None or raw in ("", b""):
        return SamplingParams()
    try:
        data = json.loads(raw)
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer past Python's digit limit
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("sampling_parameters is nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    # The keys, coercions and rules are shared with the OpenAI front end; numbers may come as strings here,
    # as vllm_backend accepts them.
    return SamplingParams.from_wire(data, numbers_as_strings=True)


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
