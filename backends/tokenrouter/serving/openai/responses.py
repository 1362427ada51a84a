"""Triton responses -> OpenAI replies (pure): decoding responses into `TritonChunk`s, then assembling the
non-streaming reply object (`assemble_response`) or the stream's chunk objects (`StreamAssembler`), and
the server-sent-event framing around them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenrouter.serving.openai.errors import OpenAIError
from tokenrouter.serving.openai.protocol import GenerationRequest

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


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


@dataclass
class ReplyTotals:
    """What a reply reports beyond its text, gathered over a request's Triton responses."""

    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int | None = None
    routing: dict[str, Any] | None = None

    def add(self, chunk: TritonChunk) -> None:
        if chunk.text:
            self.text_parts.append(chunk.text)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if chunk.num_output_tokens is not None:
            self.num_output_tokens = chunk.num_output_tokens
        if chunk.routing is not None:
            self.routing = chunk.routing

    def text(self) -> str:
        return "".join(self.text_parts)

    def checked_finish_reason(self) -> str:
        """The finish reason to report; raises OpenAIError (500) when the engine reported 'error'."""
        return _check_finish(self.finish_reason)

    def usage(self, prompt_tokens: int, count_completion_tokens: Callable[[str], int] | None) -> dict[str, int]:
        """completion_tokens comes from `num_output_tokens`; `count_completion_tokens` (re-tokenizing the
        text) is only the fallback for a model that did not report it."""
        n = self.num_output_tokens
        if n is None:
            text = self.text()
            n = count_completion_tokens(text) if count_completion_tokens and text else 0
        return usage_dict(prompt_tokens, n)


def _envelope(req: GenerationRequest, object_type: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": object_type,
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }


def _text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    """A `text_completion` choice; streamed chunks have the same shape as the whole reply."""
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def response_body(
    req: GenerationRequest, text: str, finish_reason: str, usage: dict[str, int], routing: dict | None = None
) -> dict[str, Any]:
    """A non-streaming reply: a `chat.completion` object for chat requests, else a `text_completion` one."""
    if req.kind == "chat":
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        obj = _envelope(req, "chat.completion", [choice])
    else:
        obj = _envelope(req, "text_completion", [_text_choice(text, finish_reason)])
    obj["usage"] = usage
    if routing is not None:
        obj["routing"] = routing
    return obj


def assemble_response(
    req: GenerationRequest,
    chunks: Iterable[TritonChunk],
    prompt_tokens: int,
    count_completion_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """The non-streaming OpenAI reply from all of a request's Triton responses (usage: `ReplyTotals.usage`)."""
    totals = ReplyTotals()
    for c in chunks:
        totals.add(c)
    finish = totals.checked_finish_reason()
    usage = totals.usage(prompt_tokens, count_completion_tokens)
    return response_body(req, totals.text(), finish, usage, totals.routing)


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
        self.totals = ReplyTotals()

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        object_type = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        obj = _envelope(self.req, object_type, [choice] if choice is not None else [])
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
        return _text_choice(content or "", finish_reason)

    def start(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role (and empty content), as OpenAI's do."""
        return [self._chunk(self._choice("", None, role=True))] if self.req.kind == "chat" else []

    def feed(self, chunk: TritonChunk) -> list[dict[str, Any]]:
        """Chunks for one Triton response: its text delta, if any (bookkeeping for the rest)."""
        self.totals.add(chunk)
        return [self._chunk(self._choice(chunk.text, None))] if chunk.text else []

    def finish(self) -> list[dict[str, Any]]:
        """The closing chunk(s); raises OpenAIError (500) when the engine reported finish_reason 'error'."""
        finish = self.totals.checked_finish_reason()
        out = [self._chunk(self._choice(None if self.req.kind == "chat" else "", finish))]
        if self.req.include_usage:
            usage_chunk = self._chunk(None)
            usage_chunk["usage"] = self.totals.usage(self.prompt_tokens, self.count_completion_tokens)
            out.append(usage_chunk)
        if self.totals.routing is not None:
            out[-1]["routing"] = self.totals.routing
        return out


def sse_event(obj: Any) -> bytes:
    """One server-sent event. json.dumps escapes newlines, so the payload is always a single data line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def models_list(model_name: str, created: int = 0) -> dict[str, Any]:
    """The `/v1/models` body: the one served model."""
    return {"object": "list", "data": [model_object(model_name, created)]}


def model_object(model_name: str, created: int = 0) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "tokenrouter"}
