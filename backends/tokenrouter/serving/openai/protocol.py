"""OpenAI request bodies -> validated `GenerationRequest`s (pure; every problem is a 400 `OpenAIError`)."""

from __future__ import annotations

import json
import re
import reprlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenrouter.sampling_params import WIRE_KEYS, SamplingParams, SamplingParamsError
from tokenrouter.serving.openai.errors import OpenAIError

DEFAULT_MODEL_NAME = "tokenrouter"
# The Triton model's own default; made explicit so the request sent is self-describing.
DEFAULT_MAX_TOKENS: int = SamplingParams.max_new_tokens


@dataclass
class GenerationRequest:
    """One validated OpenAI request, reduced to what the Triton model needs plus what the reply echoes."""

    kind: str  # "completion" or "chat"
    model: str
    sampling: dict[str, Any]
    prompt: str | None = None  # completions: the prompt as given
    messages: list[dict[str, Any]] | None = None  # chat: rendered into a prompt by `prepare_prompt`
    stream: bool = False
    include_usage: bool = False
    request_id: str = ""
    # The key the client set the output limit with ("max_tokens", or chat's "max_completion_tokens"); None where
    # it set none (DEFAULT_MAX_TOKENS, capped at what the context holds rather than refused).
    max_tokens_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.request_id = f"{prefix}-{uuid.uuid4().hex}"


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the JSON escape of a UTF-16 surrogate, \ud800-\udfff


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer past Python's digit limit
        raise OpenAIError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise OpenAIError("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"request body must be a JSON object, got {type(body).__name__}")
    try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"): no tokenizer takes such a string
        if _SURROGATE_ESCAPE.search(raw):  # (the body is encoded again only where one may be)
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(f"request body holds a string that is not Unicode text: a lone surrogate "
                          f"{e.object[e.start:e.end]!r}") from None
    except RecursionError:  # (loads just managed it: the encoder's frames may not)
        raise OpenAIError("request body is nested too deeply") from None
    return body


def _opt_bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OpenAIError(f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def _check_model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:
        # Lenient: a server with one model needs no name, and some clients leave it out.
        return served_model
    if not isinstance(model, str):
        raise OpenAIError(f"'model' must be a string, got {model!r}", param="model")
    if model != served_model:
        raise OpenAIError(
            f"the model '{model}' does not exist; this server serves '{served_model}'",
            param="model",
            code="model_not_found",
        )
    return model


def _check_common(body: Any, served_model: str) -> str:
    """The checks both endpoints make before their own fields; returns the model name to echo."""
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    model = _check_model(body, served_model)
    _reject_unsupported(body)
    return model


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    """Refuse options this server cannot honour instead of silently ignoring them."""
    n = body.get("n")
    if n is not None and n != 1:
        raise OpenAIError(f"only n=1 is supported, got n={n!r}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise OpenAIError(f"only best_of=1 is supported, got {best_of!r}", param="best_of")
    if body.get("echo"):
        raise OpenAIError("echo=true is not supported", param="echo")
    if body.get("suffix"):
        raise OpenAIError("suffix is not supported", param="suffix")
    # Completions take an integer `logprobs`, chat a boolean; 0 and false both mean "none".
    if body.get("logprobs") or body.get("top_logprobs"):
        raise OpenAIError("logprobs are not supported", param="logprobs")
    if body.get("logit_bias"):
        raise OpenAIError("logit_bias is not supported", param="logit_bias")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key):
            raise OpenAIError(f"{key} is not supported (only 0)", param=key)
    if body.get("tools") or body.get("functions"):
        raise OpenAIError("tools and function calling are not supported", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise OpenAIError("only response_format {'type': 'text'} is supported", param="response_format")


def parse_sampling_parameters(body: Mapping[str, Any], *, chat: bool = False) -> dict[str, Any]:
    """OpenAI sampling fields -> the model's `sampling_parameters` JSON object, validated.

    The rules are the model's own (`SamplingParams.from_wire`), so a bad value gets the same precise 400
    here as from the model, without the round trip to Triton. Only the OpenAI spellings are this layer's:
    chat's `max_completion_tokens` (which wins over `max_tokens`), and errors naming the key as sent.
    `top_k`, `stop_token_ids` and `ignore_eos` are extensions (as in vLLM).
    """
    wire = {key: body.get(key) for key in WIRE_KEYS}
    sent_as: dict[str, str] = {}  # wire key -> the client's key, where they differ
    if max_tokens_key(body, chat) == "max_completion_tokens":
        wire["max_tokens"], sent_as["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    if wire["max_tokens"] is None:
        wire["max_tokens"] = DEFAULT_MAX_TOKENS
    try:
        params = SamplingParams.from_wire(wire)
    except SamplingParamsError as e:
        key = sent_as.get(e.field, e.field)
        raise OpenAIError(f"'{key}' {e.rule}, got {e.shown}", param=key) from None
    # What the client set, as validated (`"stop": "x"` goes on as ["x"]); empty stop lists are left out.
    return {key: getattr(params, WIRE_KEYS[key]) for key, v in wire.items() if v is not None and v != []}


def max_tokens_key(body: Mapping[str, Any], chat: bool) -> str | None:
    """The key that sets the request's output limit: chat's `max_completion_tokens` wins over `max_tokens`;
    None where the body sets neither."""
    if chat and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens" if body.get("max_tokens") is not None else None


def _parse_stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise OpenAIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(opts, dict):
        raise OpenAIError(f"'stream_options' must be an object, got {opts!r}", param="stream_options")
    return stream, _opt_bool(opts, "include_usage")


def parse_completion_request(body: Any, served_model: str = DEFAULT_MODEL_NAME) -> GenerationRequest:
    """Validate a `/v1/completions` body. The prompt is a string or a list holding exactly one string."""
    model = _check_common(body, served_model)
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            # Batches (and token-id prompts) would need n Triton requests and n choices; not supported.
            raise OpenAIError("'prompt' must be a string or a list of exactly one string", param="prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError(f"'prompt' must be a string, got {type(prompt).__name__}", param="prompt")
    if not prompt:
        raise OpenAIError("'prompt' is empty", param="prompt")
    stream, include_usage = _parse_stream_flags(body)
    return GenerationRequest(
        kind="completion",
        model=model,
        sampling=parse_sampling_parameters(body),
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        max_tokens_key=max_tokens_key(body, chat=False),
    )


# The roles OpenAI's chat API takes without tools (a "tool" turn answers a tool call, and tools are not supported).
CHAT_ROLES = ("system", "developer", "user", "assistant")


def _message_text(content: Any, index: int, role: str) -> str:
    """A message's content as plain text: a string, a list of text parts, or null for an assistant turn."""
    if content is None and role == "assistant":
        return ""  # an assistant turn that only carried tool calls (OpenAI allows null there alone)
    if content is None:
        raise OpenAIError(f"messages[{index}].content is required for role '{role}'", param="messages")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param="messages",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_chat_request(body: Any, served_model: str = DEFAULT_MODEL_NAME) -> GenerationRequest:
    """Validate a `/v1/chat/completions` body; messages are normalised to {role, content[, name]} text."""
    model = _check_common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise OpenAIError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    normalised: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise OpenAIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {reprlib.repr(role)}",
                              param="messages")
        msg: dict[str, Any] = {"role": role, "content": _message_text(m.get("content"), i, role)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        normalised.append(msg)
    stream, include_usage = _parse_stream_flags(body)
    return GenerationRequest(
        kind="chat",
        model=model,
        sampling=parse_sampling_parameters(body, chat=True),
        messages=normalised,
        stream=stream,
        include_usage=include_usage,
        max_tokens_key=max_tokens_key(body, chat=True),
    )
