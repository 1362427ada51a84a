"""OpenAI-compatible HTTP server in front of the decoupled `tokenrouter` Triton model.

Three layers, kept apart so tests can drive the first two without any server:

1. Request translation (pure): OpenAI JSON -> `GenerationRequest` -> prompt text -> Triton input arrays
   (`parse_completion_request`, `parse_chat_request`, `prepare_prompt`, `triton_input_arrays`).
2. Response assembly (pure): Triton responses (`TritonChunk`) -> OpenAI JSON objects and SSE bytes
   (`assemble_response`, `StreamAssembler`, `sse_event`, `error_body`).
3. Plumbing: `TritonGrpcBackend` (one tritonclient gRPC stream per request, clients pooled) and a
   standard-library `ThreadingHTTPServer` (`build_server`, `main`).

Each HTTP request gets its own gRPC stream because Triton's stream API can only cancel a whole stream:
when the HTTP client goes away, `stop_stream(cancel_requests=True)` cancels the RPC and the server
aborts exactly that generation.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tokenrouter"
DEFAULT_TRITON_MODEL = "tokenrouter"
# The Triton model's own default; made explicit so the request sent is self-describing.
DEFAULT_MAX_TOKENS = 16
# Bodies are read whole before parsing; anything bigger is almost certainly a mistake.
MAX_BODY_BYTES = 16 * 1024 * 1024

SSE_DONE = b"data: [DONE]\n\n"

# Triton's gRPC stream drops the status code of an error response and keeps only its message, so
# bad input has to be recognised by wording. These cover the model's request parsing
# (serving/tensors.py), the engine's ValueError messages (tests/test_bad_input.py) and Triton core's
# own input checks.
BAD_INPUT_MARKERS = (
    "invalid",
    "not valid",
    "must be",
    "missing required input",
    "prompt is empty",
    "out of the vocabulary",
    "context limit",
    "is not an integer",
    "unknown sampling parameter",
    "sampling_parameters",
    "unexpected inference input",
    "unexpected shape",
    "unexpected datatype",
    "bad request",
    "bad input",
)
_BAD_INPUT_STATUSES = {"StatusCode.INVALID_ARGUMENT", "INVALID_ARG", "400"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error to report to the HTTP client as an OpenAI-style error body with `status`."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, _ERROR_TYPES.get(self.status, "server_error"), self.param, self.code)


class TritonRequestError(Exception):
    """Triton answered the request with an error (or the stream to it broke)."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ClientDisconnected(Exception):
    """The HTTP client went away while its generation was still running."""


def error_body(
    message: str, err_type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body OpenAI returns for errors; clients (the `openai` package among them) parse this shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def triton_error_status(message: str, status: str | None = None) -> int:
    """HTTP status for a Triton error: 400 when it reports bad input, else 500."""
    if status in _BAD_INPUT_STATUSES:
        return 400
    lowered = message.lower()
    return 400 if any(marker in lowered for marker in BAD_INPUT_MARKERS) else 500


def openai_error_from_triton(err: TritonRequestError) -> OpenAIError:
    return OpenAIError(err.message or "inference failed", triton_error_status(err.message, err.status))


# --------------------------------------------------------------------------------------------------
# Request translation (pure)
# --------------------------------------------------------------------------------------------------


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
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.request_id = f"{prefix}-{uuid.uuid4().hex}"


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v: Any) -> bool:
    # bool is a subclass of int, but `"max_tokens": true` is a client bug, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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

    Mirrors `SamplingParams.validate` so that bad values get a precise 400 here instead of a
    round trip to Triton. `top_k`, `stop_token_ids` and `ignore_eos` are extensions (as in vLLM).
    """
    out: dict[str, Any] = {}

    max_tokens = body.get("max_completion_tokens") if chat else None
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise OpenAIError(f"'{key}' must be an integer >= 1, got {max_tokens!r}", param=key)
    out["max_tokens"] = max_tokens

    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or temperature < 0:
            raise OpenAIError(f"'temperature' must be a number >= 0, got {temperature!r}", param="temperature")
        out["temperature"] = float(temperature)

    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise OpenAIError(f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
        out["top_p"] = float(top_p)

    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < -1:
            raise OpenAIError(f"'top_k' must be -1, 0 (disabled) or a positive integer, got {top_k!r}", param="top_k")
        out["top_k"] = top_k

    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise OpenAIError(f"'seed' must be an integer, got {seed!r}", param="seed")
        out["seed"] = seed

    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
            raise OpenAIError(
                f"'stop' must be a non-empty string or a list of non-empty strings, got {stop!r}", param="stop"
            )
        if stops:
            out["stop"] = stops

    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in stop_token_ids):
            raise OpenAIError(
                f"'stop_token_ids' must be a list of non-negative integers, got {stop_token_ids!r}",
                param="stop_token_ids",
            )
        if stop_token_ids:
            out["stop_token_ids"] = stop_token_ids

    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = _opt_bool(body, "ignore_eos")
    return out


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
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    model = _check_model(body, served_model)
    _reject_unsupported(body)
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
    )


def _message_text(content: Any, index: int) -> str:
    """A message's content as plain text: a string, null, or a list of text parts."""
    if content is None:
        return ""  # e.g. an assistant turn that only carried tool calls
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
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    model = _check_model(body, served_model)
    _reject_unsupported(body)
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
        if not isinstance(role, str) or not role:
            raise OpenAIError(f"messages[{i}].role must be a non-empty string", param="messages")
        msg: dict[str, Any] = {"role": role, "content": _message_text(m.get("content"), i)}
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
    )


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text for `messages`: the tokenizer's chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("the served tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises TemplateError for e.g. roles a template refuses
        raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from None


def count_tokens(tokenizer: Any, text: str) -> int:
    """Token count the same way the engine tokenizes string prompts (`tokenizer(text)["input_ids"]`)."""
    return len(tokenizer(text)["input_ids"])


def prepare_prompt(req: GenerationRequest, tokenizer: Any) -> tuple[str, int]:
    """(prompt text to send, prompt token count) for a parsed request."""
    prompt = render_chat_prompt(tokenizer, req.messages or []) if req.kind == "chat" else req.prompt or ""
    return prompt, count_tokens(tokenizer, prompt)


def triton_input_arrays(prompt: str, sampling: Mapping[str, Any], stream: bool) -> dict[str, np.ndarray]:
    """The `tokenrouter` model's input tensors (all dims [1]; the model does not batch in Triton).

    The prompt is never echoed (`exclude_input_in_output`) since OpenAI's echo is unsupported, and the
    optional outputs are always requested because usage and the `routing` extension need them.
    """
    return {
        "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
        "stream": np.array([stream], dtype=np.bool_),
        "sampling_parameters": np.array([json.dumps(dict(sampling)).encode("utf-8")], dtype=np.object_),
        "exclude_input_in_output": np.array([True], dtype=np.bool_),
        "return_num_output_tokens": np.array([True], dtype=np.bool_),
        "return_finish_reason": np.array([True], dtype=np.bool_),
        "return_routing_stats": np.array([True], dtype=np.bool_),
    }


def make_grpc_inputs(arrays: Mapping[str, np.ndarray]) -> list[Any]:
    """tritonclient.grpc `InferInput`s for `triton_input_arrays` output."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


# --------------------------------------------------------------------------------------------------
# Response assembly (pure)
# --------------------------------------------------------------------------------------------------


@dataclass
class TritonChunk:
    """One Triton response, decoded. `text` is a delta when streaming, the whole text otherwise."""

    text: str = ""
    final: bool = False
    finish_reason: str | None = None
    num_output_tokens: int | None = None
    routing: dict[str, Any] | None = None


def _as_str(v: Any) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def chunk_from_outputs(outputs: Mapping[str, np.ndarray | None], final: bool) -> TritonChunk:
    """Decode a response's outputs: arrays as `InferResult.as_numpy` returns them (absent ones None), or
    the plain values of a `generate_stream` JSON event, which decode the same way."""
    chunk = TritonChunk(final=final)
    text = outputs.get("text_output")
    if text is not None:
        chunk.text = "".join(_as_str(t) for t in np.asarray(text).reshape(-1))
    fr = outputs.get("finish_reason")
    if fr is not None and np.asarray(fr).size:
        chunk.finish_reason = _as_str(np.asarray(fr).reshape(-1)[0]) or None
    n = outputs.get("num_output_tokens")
    if n is not None and np.asarray(n).size:
        chunk.num_output_tokens = int(np.asarray(n).reshape(-1)[0])
    stats = outputs.get("routing_stats")
    if stats is not None and np.asarray(stats).size:
        raw = _as_str(np.asarray(stats).reshape(-1)[0])
        try:
            chunk.routing = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            # Stats are informational; a malformed blob must not fail an otherwise good generation.
            logger.warning("ignoring malformed routing_stats: %r", raw[:200])
    return chunk


_OUTPUT_NAMES = ("text_output", "finish_reason", "num_output_tokens", "routing_stats")


def chunk_from_infer_result(result: Any) -> TritonChunk:
    """Decode a tritonclient gRPC `InferResult` (the final flag is the `triton_final_response` parameter)."""
    response = result.get_response()
    params = response.parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    return chunk_from_outputs({name: result.as_numpy(name) for name in _OUTPUT_NAMES}, final)


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _check_finish(finish_reason: str | None) -> str:
    if finish_reason == "error":
        raise OpenAIError("the generation failed inside the engine (finish_reason 'error')", 500)
    # A well-behaved model always reports one with return_finish_reason; "stop" is the safe reading.
    return finish_reason or "stop"


def completion_response(
    req: GenerationRequest, text: str, finish_reason: str, usage: dict[str, int], routing: dict | None = None
) -> dict[str, Any]:
    """A non-streaming `text_completion` object."""
    obj: dict[str, Any] = {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }
    if routing is not None:
        obj["routing"] = routing
    return obj


def chat_completion_response(
    req: GenerationRequest, text: str, finish_reason: str, usage: dict[str, int], routing: dict | None = None
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object."""
    obj: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }
    if routing is not None:
        obj["routing"] = routing
    return obj


def assemble_response(
    req: GenerationRequest,
    chunks: Iterable[TritonChunk],
    prompt_tokens: int,
    count_completion_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """The non-streaming OpenAI reply from all of a request's Triton responses.

    completion_tokens comes from `num_output_tokens`; `count_completion_tokens` (re-tokenizing the
    text) is only the fallback for a model that did not report it.
    """
    text_parts: list[str] = []
    finish_reason = num_tokens = routing = None
    for c in chunks:
        text_parts.append(c.text)
        finish_reason = c.finish_reason or finish_reason
        num_tokens = c.num_output_tokens if c.num_output_tokens is not None else num_tokens
        routing = c.routing if c.routing is not None else routing
    text = "".join(text_parts)
    finish = _check_finish(finish_reason)
    if num_tokens is None:
        num_tokens = count_completion_tokens(text) if count_completion_tokens and text else 0
    usage = usage_dict(prompt_tokens, num_tokens)
    build = chat_completion_response if req.kind == "chat" else completion_response
    return build(req, text, finish, usage, routing)


class StreamAssembler:
    """Turns a request's Triton stream into OpenAI stream chunk objects, in order.

    Call `start()` once, `feed()` per Triton response, and `finish()` after the final one. The final
    chunk carries `finish_reason` with empty content; with `include_usage` every chunk has `usage: null`
    and one more chunk with no choices carries the usage, as OpenAI does. The `routing` extension rides
    on whichever object is sent last before `[DONE]`.
    """

    def __init__(
        self,
        req: GenerationRequest,
        prompt_tokens: int,
        count_completion_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.count_completion_tokens = count_completion_tokens
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.num_output_tokens: int | None = None
        self.routing: dict[str, Any] | None = None
        self.finished = False

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        chat = self.req.kind == "chat"
        obj: dict[str, Any] = {
            "id": self.req.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.req.created,
            "model": self.req.model,
            "choices": [choice] if choice is not None else [],
        }
        if self.req.include_usage:
            obj["usage"] = None
        return obj

    def _choice(self, content: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.req.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role (and empty content), as OpenAI's do."""
        return [self._chunk(self._choice("", None, role=True))] if self.req.kind == "chat" else []

    def feed(self, chunk: TritonChunk) -> list[dict[str, Any]]:
        """Chunks for one Triton response: its text delta, if any (bookkeeping for the rest)."""
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.num_output_tokens is not None:
            self.num_output_tokens = chunk.num_output_tokens
        if chunk.routing is not None:
            self.routing = chunk.routing
        if not chunk.text:
            return []
        self.text_parts.append(chunk.text)
        return [self._chunk(self._choice(chunk.text, None))]

    def usage(self) -> dict[str, int]:
        n = self.num_output_tokens
        if n is None:
            text = "".join(self.text_parts)
            n = self.count_completion_tokens(text) if self.count_completion_tokens and text else 0
        return usage_dict(self.prompt_tokens, n)

    def finish(self) -> list[dict[str, Any]]:
        """The closing chunk(s); raises OpenAIError (500) when the engine reported finish_reason 'error'."""
        self.finished = True
        finish = _check_finish(self.finish_reason)
        out = [self._chunk(self._choice(None if self.req.kind == "chat" else "", finish))]
        if self.req.include_usage:
            usage_chunk = self._chunk(None)
            usage_chunk["usage"] = self.usage()
            out.append(usage_chunk)
        if self.routing is not None:
            out[-1]["routing"] = self.routing
        return out


def sse_event(obj: Any) -> bytes:
    """One server-sent event. json.dumps escapes newlines, so the payload is always a single data line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def models_list(model_name: str, created: int = 0) -> dict[str, Any]:
    """The `/v1/models` body: the one served model."""
    return {"object": "list", "data": [model_object(model_name, created)]}


def model_object(model_name: str, created: int = 0) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "tokenrouter"}


# --------------------------------------------------------------------------------------------------
# Triton gRPC plumbing
# --------------------------------------------------------------------------------------------------


class GenerationStream(Protocol):
    """What the HTTP layer needs from one in-flight Triton request (a fake can stand in for tests)."""

    def chunks(self) -> Iterator[TritonChunk]: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    def is_ready(self) -> bool: ...

    def open_stream(
        self, arrays: Mapping[str, np.ndarray], request_id: str, should_cancel: Callable[[], bool] | None = None
    ) -> GenerationStream: ...

    def close(self) -> None: ...


class TritonStream:
    """One request on its own tritonclient gRPC stream.

    The stream callback runs on tritonclient's reader thread and only enqueues; everything else
    (including `stop_stream`, which joins that thread) happens on the HTTP handler's thread.
    """

    def __init__(
        self,
        backend: TritonGrpcBackend,
        client: Any,
        arrays: Mapping[str, np.ndarray],
        request_id: str,
        should_cancel: Callable[[], bool] | None,
        poll_interval: float,
    ) -> None:
        self._backend = backend
        self._client = client
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._should_cancel = should_cancel
        self._poll_interval = poll_interval
        self._done = False  # the final response (or an error) has arrived
        self._clean = False  # ...and it was a final response, so the stream can be closed gracefully
        self._closed = False
        self.request_id = request_id
        client.start_stream(callback=self._on_response)
        try:
            client.async_stream_infer(
                backend.model_name,
                make_grpc_inputs(arrays),
                request_id=request_id,
                # A model may end with a flags-only response; without this Triton would not send it
                # and we could never tell the request finished.
                enable_empty_final_response=True,
            )
        except Exception as e:
            # The caller (open_stream) releases the client; only the half-open stream is ours to end.
            self._closed = True
            try:
                client.stop_stream(cancel_requests=True)  # joins the reader thread, so its error is queued
            except Exception:
                logger.debug("stop_stream after a failed send failed", exc_info=True)
            # tritonclient refuses to send on a broken stream with a generic message and reports the
            # actual cause (e.g. "failed to connect to all addresses") only through the callback.
            cause = e
            while not self._queue.empty():
                _, error = self._queue.get_nowait()
                cause = error if error is not None else cause
            raise TritonRequestError(_exc_message(cause), _exc_status(cause)) from None

    def _on_response(self, result: Any, error: Any) -> None:
        self._queue.put((result, error))

    def chunks(self) -> Iterator[TritonChunk]:
        """Decoded responses up to and including the final one.

        Raises TritonRequestError for an error response and ClientDisconnected (after cancelling) when
        `should_cancel` says the HTTP client left; that check runs at least every `poll_interval` s.
        """
        last_poll = time.monotonic()
        while not self._done:
            try:
                result, error = self._queue.get(timeout=self._poll_interval)
            except queue.Empty:
                result = error = None
            now = time.monotonic()
            if self._should_cancel is not None and now - last_poll >= self._poll_interval:
                last_poll = now
                if self._should_cancel():
                    self.cancel()
                    raise ClientDisconnected(self.request_id)
            if result is None and error is None:
                continue
            if error is not None:
                self._done = True
                raise TritonRequestError(_exc_message(error), _exc_status(error))
            chunk = chunk_from_infer_result(result)
            if chunk.final:
                self._done = self._clean = True
            yield chunk

    def cancel(self) -> None:
        """Cancel the RPC; Triton then cancels the request and the model aborts the generation."""
        if self._closed:
            return
        self._closed = True
        self._done = True
        try:
            self._client.stop_stream(cancel_requests=True)
        except Exception:  # the stream may already be broken; cancelling is best effort
            logger.debug("stop_stream(cancel_requests=True) failed", exc_info=True)
        # After a cancel the client's stream state is not worth trusting: drop it, do not pool it.
        self._backend._release(self._client, reusable=False)

    def close(self) -> None:
        """Release the stream: gracefully after a final response, by cancellation otherwise."""
        if self._closed:
            return
        if not self._clean:
            self.cancel()
            return
        self._closed = True
        try:
            # Half-closes the request side; Triton ends the RPC since nothing is outstanding.
            self._client.stop_stream()
            reusable = True
        except Exception:
            logger.debug("stop_stream() failed", exc_info=True)
            reusable = False
        self._backend._release(self._client, reusable=reusable)

    def __enter__(self) -> TritonStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exc_message(error: Any) -> str:
    msg = error.message() if hasattr(error, "message") and callable(error.message) else str(error)
    return msg or str(error)


def _exc_status(error: Any) -> str | None:
    status = error.status() if hasattr(error, "status") and callable(error.status) else None
    return str(status) if status is not None else None


class TritonGrpcBackend:
    """Talks to the `tokenrouter` model over gRPC; keeps idle clients (channels) for reuse.

    A tritonclient `InferenceServerClient` holds at most one stream at a time, so concurrent requests
    each take their own client; idle ones are kept (up to `max_idle_clients`) to skip channel setup.
    """

    def __init__(
        self,
        url: str,
        model_name: str = DEFAULT_TRITON_MODEL,
        max_idle_clients: int = 16,
        poll_interval: float = 0.2,
    ) -> None:
        import tritonclient.grpc as grpcclient

        self._grpcclient = grpcclient
        self.url = url
        self.model_name = model_name
        self.poll_interval = poll_interval
        self._max_idle = max_idle_clients
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        # Unary health checks are thread-safe on a shared client; streams are not, hence the pool.
        self._health_client = grpcclient.InferenceServerClient(url=url)

    def _acquire(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._grpcclient.InferenceServerClient(url=self.url)

    def _release(self, client: Any, reusable: bool) -> None:
        if reusable:
            with self._lock:
                if len(self._idle) < self._max_idle:
                    self._idle.append(client)
                    return
        try:
            client.close()
        except Exception:
            logger.debug("closing a gRPC client failed", exc_info=True)

    def is_ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(self._health_client.is_model_ready(self.model_name, client_timeout=timeout))
        except Exception:
            return False

    def open_stream(
        self, arrays: Mapping[str, np.ndarray], request_id: str, should_cancel: Callable[[], bool] | None = None
    ) -> TritonStream:
        client = self._acquire()
        try:
            return TritonStream(self, client, arrays, request_id, should_cancel, self.poll_interval)
        except Exception as e:
            self._release(client, reusable=False)
            if isinstance(e, TritonRequestError):
                raise
            raise TritonRequestError(_exc_message(e), _exc_status(e)) from None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in [*idle, self._health_client]:
            try:
                c.close()
            except Exception:
                logger.debug("closing a gRPC client failed", exc_info=True)


# --------------------------------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------------------------------


_MSG_DONTWAIT: int | None = getattr(socket, "MSG_DONTWAIT", None)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end of `sock` has closed it (readable with nothing to read means EOF).

    Lets a request notice its HTTP client left while it is still waiting on Triton, before any write
    could fail. Pipelined request bytes make the socket readable too, but then the peek sees data.
    """
    try:
        if _MSG_DONTWAIT is None:  # no MSG_DONTWAIT (Windows): ask select first so recv cannot block
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        # recv rather than select: select fails outright on descriptors above FD_SETSIZE (1024).
        return sock.recv(1, socket.MSG_PEEK | _MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # nothing to read: still connected
    except (OSError, ValueError):
        return True  # reset, or the socket is already closed


class OpenAIFrontendServer(ThreadingHTTPServer):
    """The HTTP server plus what its handlers share: backend, tokenizer, served model name."""

    daemon_threads = True
    # Many short-lived connections from load generators; the default backlog of 5 drops some.
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], backend: Backend, tokenizer: Any, model_name: str = DEFAULT_MODEL_NAME
    ) -> None:
        super().__init__(address, _Handler)
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        # HF fast tokenizers can fail with "Already borrowed" when one instance is used from several
        # threads at once; tokenizing is cheap next to generation, so serialise it.
        self.tokenizer_lock = threading.Lock()

    def count_tokens(self, text: str) -> int:
        with self.tokenizer_lock:
            return count_tokens(self.tokenizer, text)

    def prepare_prompt(self, req: GenerationRequest) -> tuple[str, int]:
        with self.tokenizer_lock:
            return prepare_prompt(req, self.tokenizer)

    def server_close(self) -> None:
        super().server_close()
        self.backend.close()


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 for keep-alive; streamed bodies use chunked transfer encoding so the connection survives.
    protocol_version = "HTTP/1.1"
    server: OpenAIFrontendServer
    server_version = "tokenrouter-openai/0.1"
    _sse_started = False  # set per request: once the 200 went out, errors can only be reported in-band

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)

    # ---- responses ----

    def _send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error_obj(self, err: OpenAIError) -> None:
        if err.status >= 500:
            logger.warning("request failed (%d): %s", err.status, err.message)
        self._send_json(err.status, err.body())

    def _start_sse(self) -> None:
        self._sse_started = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # ---- routing ----

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        srv = self.server
        if path == "/health":
            ready = srv.backend.is_ready()
            self._send_json(200 if ready else 503, {"status": "ready" if ready else "unavailable"})
        elif path == "/v1/models":
            self._send_json(200, models_list(srv.model_name, srv.created))
        elif path == f"/v1/models/{srv.model_name}":
            self._send_json(200, model_object(srv.model_name, srv.created))
        elif path.startswith("/v1/models/"):
            self._send_error_obj(OpenAIError(f"the model '{path[len('/v1/models/') :]}' does not exist", 404))
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._send_error_obj(OpenAIError(f"use POST for {path}", 405))
        else:
            self._send_error_obj(OpenAIError(f"no route for GET {path}", 404))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/completions":
            self._generate(parse_completion_request)
        elif path == "/v1/chat/completions":
            self._generate(parse_chat_request)
        else:
            self._read_body_or_close()
            self._send_error_obj(OpenAIError(f"no route for POST {path}", 404))

    def _read_body_or_close(self) -> bytes | None:
        """The request body; None (and the connection marked to close) when it could not be read."""
        length = self.headers.get("Content-Length")
        if length is None:
            # No body we can delimit (e.g. a chunked upload): refuse it and drop the connection,
            # since whatever bytes follow cannot be told apart from the next request.
            self.close_connection = True
            return None
        try:
            n = int(length)
        except ValueError:
            self.close_connection = True
            return None
        if n < 0 or n > MAX_BODY_BYTES:
            self.close_connection = True
            return None
        return self.rfile.read(n)

    def _generate(self, parse: Callable[[Any, str], GenerationRequest]) -> None:
        srv = self.server
        raw = self._read_body_or_close()
        if raw is None:
            length = self.headers.get("Content-Length")
            if length is None:
                self._send_error_obj(OpenAIError("a Content-Length header is required", 411))
            else:
                self._send_error_obj(OpenAIError(f"request body too large or bad Content-Length {length!r}", 413))
            return
        stream: GenerationStream | None = None
        self._sse_started = False
        try:
            req = parse(parse_json_body(raw), srv.model_name)
            prompt, prompt_tokens = srv.prepare_prompt(req)
            arrays = triton_input_arrays(prompt, req.sampling, req.stream)
            stream = srv.backend.open_stream(arrays, req.request_id, should_cancel=lambda: peer_closed(self.connection))
            if req.stream:
                self._stream_reply(req, stream, prompt_tokens)
            else:
                self._send_json(200, assemble_response(req, stream.chunks(), prompt_tokens, srv.count_tokens))
        except (ClientDisconnected, BrokenPipeError, ConnectionResetError):
            # The client is gone: cancel the gRPC stream so Triton aborts the generation.
            logger.info("client disconnected; cancelling the Triton request")
            if stream is not None:
                stream.cancel()
            self.close_connection = True
        except Exception as e:
            if isinstance(e, TritonRequestError):
                err = openai_error_from_triton(e)
            elif isinstance(e, OpenAIError):
                err = e
            else:
                logger.exception("unexpected error while serving %s", self.path)
                err = OpenAIError(f"internal error: {e}", 500)
            if self._sse_started:
                # Mid-stream there is no status left to set and the chunked body cannot be closed
                # cleanly; dropping the connection is the only honest signal.
                self.close_connection = True
            else:
                self._send_error_obj(err)
        finally:
            if stream is not None:
                stream.close()

    def _stream_reply(self, req: GenerationRequest, stream: GenerationStream, prompt_tokens: int) -> None:
        """Write the SSE reply.

        The headers wait for Triton's first response so that a request Triton refuses still gets a
        proper 400/500 status rather than an error event inside a 200 stream.
        """
        asm = StreamAssembler(req, prompt_tokens, self.server.count_tokens)
        chunks = stream.chunks()
        first = next(chunks, None)
        self._start_sse()
        try:
            for obj in asm.start():
                self._write_chunk(sse_event(obj))
            chunk = first
            while chunk is not None:
                for obj in asm.feed(chunk):
                    self._write_chunk(sse_event(obj))
                chunk = next(chunks, None)
            for obj in asm.finish():
                self._write_chunk(sse_event(obj))
        except (TritonRequestError, OpenAIError) as e:
            # Too late for a status code: report it in-band, the way OpenAI-compatible servers do.
            err = e if isinstance(e, OpenAIError) else openai_error_from_triton(e)
            if err.status >= 500:
                logger.warning("stream failed: %s", err.message)
            self._write_chunk(sse_event(err.body()))
        self._write_chunk(SSE_DONE)
        self._write_chunk(b"")  # zero-length chunk: end of the chunked body


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def load_frontend_tokenizer(tokenizer_dir: str) -> Any:
    """The tokenizer in `tokenizer_dir` (loaded the way the engine loads it); ValueError if there is none."""
    from tokenrouter.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tokenizer_dir!r}")
    return tokenizer


def build_server(
    triton_url: str,
    host: str,
    port: int,
    tokenizer_dir: str,
    model_name: str = DEFAULT_MODEL_NAME,
    *,
    triton_model_name: str = DEFAULT_TRITON_MODEL,
    backend: Backend | None = None,
    tokenizer: Any = None,
) -> ThreadingHTTPServer:
    """A bound (not yet serving) OpenAI-compatible server; call `serve_forever()` on it.

    `model_name` is the id clients see in /v1/models and must send as `model`; `triton_model_name` is the
    Triton model it forwards to. `backend` and `tokenizer` replace the gRPC backend and the tokenizer
    loaded from `tokenizer_dir` (tests pass fakes). Port 0 picks a free port (`server.server_address`).
    """
    if tokenizer is None:
        tokenizer = load_frontend_tokenizer(tokenizer_dir)
    if backend is None:
        backend = TritonGrpcBackend(triton_url, triton_model_name)
    return OpenAIFrontendServer((host, port), backend, tokenizer, model_name)


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The front end's options, added to `parser` (e.g. a CLI subcommand) or to a new parser."""
    p = parser or argparse.ArgumentParser(
        prog="tokenrouter-openai", description="OpenAI-compatible HTTP server in front of the Triton model."
    )
    p.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC address (host:port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=9000, help="port to listen on")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (chat template, token counts)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME, help="model id clients use")
    p.add_argument("--triton-model-name", default=DEFAULT_TRITON_MODEL, help="Triton model to call")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG logs every HTTP request)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """Serve with options parsed by `build_arg_parser` until interrupted; returns a process exit code."""
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    # A no-op when the caller (e.g. the `tokenrouter` CLI) configured logging already; the module
    # logger's own level still makes --log-level count.
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(level)
    try:
        server = build_server(
            args.triton_url,
            args.host,
            args.port,
            args.tokenizer,
            args.served_model_name,
            triton_model_name=args.triton_model_name,
        )
    except (OSError, ValueError) as e:
        logger.error("cannot start: %s", e)
        return 2
    host, port = server.server_address[:2]
    logger.info(
        "serving OpenAI API for %r on http://%s:%s/v1 (Triton %s)", args.served_model_name, host, port, args.triton_url
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: parse `argv` (default sys.argv[1:]) and serve until interrupted."""
    return run_from_args(build_arg_parser().parse_args(argv))


if __name__ == "__main__":
    import sys

    sys.exit(main())
