"""OpenAI front end: request translation, response assembly, SSE and error bodies as pure functions;
then the gRPC and HTTP plumbing against an in-process fake of the `tokenrouter` Triton model.

No tritonserver is needed; the fake speaks Triton's real gRPC service (tritonclient's protobufs), so
`TritonGrpcBackend` runs unchanged, cancellation included.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np
import pytest

from tokenrouter.serving.openai import (
    SSE_DONE,
    GenerationRequest,
    OpenAIError,
    StreamAssembler,
    TritonChunk,
    TritonGrpcBackend,
    TritonRequestError,
    assemble_response,
    build_server,
    chunk_from_infer_result,
    chunk_from_outputs,
    error_body,
    load_frontend_tokenizer,
    make_grpc_inputs,
    models_list,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    peer_closed,
    prepare_prompt,
    sse_event,
    triton_error_status,
    triton_input_arrays,
)
from tokenrouter.serving.openai.errors import UNREACHABLE_MESSAGE


class WordTokenizer:
    """Stand-in tokenizer: one token per whitespace-separated word, ChatML-like template."""

    chat_template = "chatml"

    def __call__(self, text: str, verbose: bool = True) -> dict[str, list[int]]:  # (transformers' signature)
        return {"input_ids": list(range(len(text.split())))}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        out = "".join(f"<{m['role']}> {m['content']} " for m in messages)
        return out + ("<assistant> " if add_generation_prompt else "")


def raises_400(fn, *args, match: str | None = None) -> OpenAIError:
    with pytest.raises(OpenAIError, match=match) as ei:
        fn(*args)
    assert ei.value.status == 400
    return ei.value


# --------------------------------------------------------------------------------------------------
# Request translation
# --------------------------------------------------------------------------------------------------


def test_parse_json_body() -> None:
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    raises_400(parse_json_body, b"{not json", match="not valid JSON")
    raises_400(parse_json_body, b"\xff\xfe", match="not valid JSON")
    # JSON can escape a lone UTF-16 surrogate, which no tokenizer takes (it failed the request with a 500)
    raises_400(parse_json_body, b'{"prompt": "a\\ud800b"}', match="not Unicode text: a lone surrogate")
    raises_400(parse_json_body, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', match="lone surrogate")
    assert parse_json_body(b'{"prompt": "a\\ud83d\\ude00b"}') == {"prompt": "a\U0001f600b"}  # a surrogate pair
    raises_400(parse_json_body, b"[1, 2]", match="must be a JSON object, got list")


def test_completion_request_defaults_and_mapping() -> None:
    req = parse_completion_request({"model": "tokenrouter", "prompt": "hello"})
    assert req.kind == "completion" and req.prompt == "hello" and not req.stream and not req.include_usage
    assert req.sampling == {"max_tokens": 16}
    assert req.request_id.startswith("cmpl-") and req.created > 0

    req = parse_completion_request(
        {
            "prompt": ["one string"],  # no model: the single served one is assumed
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "echo": False,
            "logprobs": None,
            "user": "ignored",
        },
        "tokenrouter",
    )
    assert req.prompt == "one string" and req.stream and req.include_usage and req.model == "tokenrouter"
    assert req.sampling == {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "top_k": 7, "seed": 3, "stop": ["\n"]}
    ext = parse_completion_request({"prompt": "x", "stop_token_ids": [1, 2], "ignore_eos": True, "stop": ["a", "b"]})
    assert ext.sampling == {"max_tokens": 16, "stop": ["a", "b"], "stop_token_ids": [1, 2], "ignore_eos": True}


@pytest.mark.parametrize(
    "body, match",
    [
        ({}, "'prompt' is required"),
        ({"prompt": None}, "'prompt' is required"),
        ({"prompt": 42}, "'prompt' must be a string"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"prompt": ["a", "b"]}, "exactly one string"),
        ({"prompt": [[1, 2, 3]]}, "exactly one string"),
        ({"prompt": "x", "model": "gpt-4"}, "the model 'gpt-4' does not exist"),
        ({"prompt": "x", "model": 7}, "'model' must be a string"),
        ({"prompt": "x", "n": 2}, "only n=1"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer >= 1"),
        ({"prompt": "x", "max_tokens": "5"}, "'max_tokens' must be an integer"),
        ({"prompt": "x", "max_tokens": True}, "'max_tokens' must be an integer"),
        ({"prompt": "x", "max_tokens": 2.5}, "'max_tokens' must be an integer"),
        ({"prompt": "x", "temperature": -1}, "'temperature' must be a finite number >= 0, got -1"),
        ({"prompt": "x", "temperature": float("nan")}, "'temperature' must be a finite number >= 0, got nan"),
        ({"prompt": "x", "temperature": "hot"}, "'temperature'"),
        ({"prompt": "x", "top_p": 0}, r"'top_p' must be a number in \(0, 1\]"),
        ({"prompt": "x", "top_p": 1.5}, "'top_p'"),
        ({"prompt": "x", "top_k": -2}, "'top_k'"),
        ({"prompt": "x", "seed": 1.5}, "'seed' must be an integer"),
        ({"prompt": "x", "seed": 2**64}, r"'seed' must be an integer in \[0, \d+\], got 18446744073709551616"),
        ({"prompt": "x", "stop": ""}, "'stop'"),
        ({"prompt": "x", "stop": ["ok", 3]}, "'stop'"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "'stop_token_ids'"),
        ({"prompt": "x", "stream": "yes"}, "'stream' must be a boolean"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed when 'stream' is true"),
        ({"prompt": "x", "stream": True, "stream_options": []}, "'stream_options' must be an object"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "'include_usage' must be a boolean"),
    ],
)
def test_completion_request_rejects(body: dict, match: str) -> None:
    err = raises_400(parse_completion_request, body, "tokenrouter", match=match)
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model_error_body() -> None:
    err = raises_400(parse_completion_request, {"prompt": "x", "model": "other"}, "served")
    assert err.body() == {
        "error": {
            "message": "the model 'other' does not exist; this server serves 'served'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_chat_request() -> None:
    req = parse_chat_request(
        {
            "model": "tokenrouter",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "name": "bot"},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 100,  # the newer field wins
            "logprobs": False,
            "response_format": {"type": "text"},
        }
    )
    assert req.kind == "chat" and req.request_id.startswith("chatcmpl-")
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    assert req.sampling == {"max_tokens": 9}
    assert parse_chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}).sampling == {
        "max_tokens": 4
    }


@pytest.mark.parametrize(
    "body, match",
    [
        ({}, "'messages' is required"),
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
        ({"messages": [{"content": "hi"}]}, r"messages\[0\].role"),
        ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, r"messages\[0\].role must be one of system, "),
        ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\].content is required for role 'user'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "only n=1"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "'max_completion_tokens'"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, "does not exist"),
    ],
)
def test_chat_request_rejects(body: dict, match: str) -> None:
    raises_400(parse_chat_request, body, "tokenrouter", match=match)


def test_prepare_prompt_counts_with_tokenizer() -> None:
    tok = WordTokenizer()
    req = parse_completion_request({"prompt": "a b c"})
    assert prepare_prompt(req, tok) == ("a b c", 3)
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi there"}]})
    assert prepare_prompt(chat, tok) == ("<user> hi there <assistant> ", 4)

    class NoTemplate(WordTokenizer):
        chat_template = None

    raises_400(prepare_prompt, chat, NoTemplate(), match="no chat template")

    class Refuses(WordTokenizer):
        def apply_chat_template(self, *a, **k):
            raise ValueError("Conversation roles must alternate")

    raises_400(prepare_prompt, chat, Refuses(), match="roles must alternate")


def test_real_chat_template(tiny_dir) -> None:
    """The tiny tokenizer's ChatML template, with the assistant turn opened."""
    tok = load_frontend_tokenizer(str(tiny_dir / "tokenizer"))
    chat = parse_chat_request({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    prompt, n = prepare_prompt(chat, tok)
    assert prompt == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert n == len(tok(prompt)["input_ids"]) > 0
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_frontend_tokenizer(str(tiny_dir))


def test_triton_input_arrays() -> None:
    arrays = triton_input_arrays("héllo", {"max_tokens": 3, "stop": ["x"]}, stream=True)
    assert set(arrays) == {
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
        "return_num_output_tokens",
        "return_finish_reason",
        "return_routing_stats",
    }
    assert all(a.shape == (1,) for a in arrays.values())
    assert arrays["text_input"][0] == "héllo".encode()
    assert json.loads(arrays["sampling_parameters"][0]) == {"max_tokens": 3, "stop": ["x"]}
    assert arrays["stream"].dtype == np.bool_ and bool(arrays["stream"][0])
    assert bool(arrays["exclude_input_in_output"][0]) and bool(arrays["return_routing_stats"][0])
    assert not triton_input_arrays("p", {}, stream=False)["stream"][0]

    inputs = {i.name(): i for i in make_grpc_inputs(arrays)}
    assert inputs["text_input"].datatype() == "BYTES" and inputs["text_input"].shape() == [1]
    assert inputs["stream"].datatype() == "BOOL"


# --------------------------------------------------------------------------------------------------
# Response assembly
# --------------------------------------------------------------------------------------------------


def test_chunk_from_outputs() -> None:
    c = chunk_from_outputs(
        {
            "text_output": np.array(["héllo".encode(), b" world"], dtype=object),
            "finish_reason": np.array([b"length"], dtype=object),
            "num_output_tokens": np.array([7], dtype=np.uint32),
            "routing_stats": np.array([b'{"handoffs": 2}'], dtype=object),
        },
        final=True,
    )
    assert c == TritonChunk(
        text="héllo world", final=True, finish_reason="length", num_output_tokens=7, routing={"handoffs": 2}
    )
    # Triton's HTTP generate_stream events hold plain JSON values; they decode the same way.
    event = {"text_output": "hi", "finish_reason": "stop", "num_output_tokens": 3, "routing_stats": '{"handoffs": 1}'}
    assert chunk_from_outputs(event, final=True) == TritonChunk("hi", True, "stop", 3, {"handoffs": 1})
    # A flags-only final response carries no outputs at all.
    assert chunk_from_outputs({"text_output": None}, final=True) == TritonChunk(final=True)
    assert chunk_from_outputs({"routing_stats": np.array([b"{broken"], dtype=object)}, False).routing is None


def test_chunk_from_infer_result() -> None:
    """A real tritonclient InferResult: outputs deserialised, final flag read from the parameters."""
    from tritonclient.grpc import InferResult

    resp = _infer_response("r1", {"text_output": np.array([b"hi"], dtype=object)}, final=False)
    assert chunk_from_infer_result(InferResult(resp.infer_response)) == TritonChunk(text="hi")
    resp = _infer_response("r1", {"finish_reason": np.array([b"stop"], dtype=object)}, final=True)
    assert chunk_from_infer_result(InferResult(resp.infer_response)) == TritonChunk(final=True, finish_reason="stop")


def _completion_req(**kw: Any) -> GenerationRequest:
    return GenerationRequest(kind="completion", model="tokenrouter", sampling={}, prompt="p", **kw)


def _chat_req(**kw: Any) -> GenerationRequest:
    return GenerationRequest(kind="chat", model="tokenrouter", sampling={}, messages=[], **kw)


def test_assemble_completion() -> None:
    req = _completion_req(request_id="cmpl-1", created=5)
    chunks = [TritonChunk(text="Hello", final=True, finish_reason="length", num_output_tokens=4, routing={"h": 1})]
    assert assemble_response(req, chunks, prompt_tokens=3) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "tokenrouter",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "routing": {"h": 1},
    }


def test_assemble_chat_and_fallbacks() -> None:
    req = _chat_req(request_id="chatcmpl-1", created=5)
    # Text split over responses (as when streaming) and no num_output_tokens: counted by the callback.
    chunks = [TritonChunk(text="a b"), TritonChunk(text=" c"), TritonChunk(final=True, finish_reason="stop")]
    out = assemble_response(req, chunks, 2, lambda t: len(t.split()))
    assert out["object"] == "chat.completion" and "routing" not in out
    assert out["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "a b c"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    # No finish reason reported at all reads as "stop"; an engine error is a 500.
    assert assemble_response(req, [TritonChunk(final=True)], 1)["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(OpenAIError) as ei:
        assemble_response(req, [TritonChunk(text="x", final=True, finish_reason="error")], 1)
    assert ei.value.status == 500 and ei.value.body()["error"]["type"] == "server_error"


def test_stream_chat_chunks() -> None:
    req = _chat_req(request_id="chatcmpl-9", created=1, stream=True)
    asm = StreamAssembler(req, prompt_tokens=4)
    objs = asm.start()
    objs += asm.feed(TritonChunk(text="Hel"))
    objs += asm.feed(TritonChunk(text=""))  # empty deltas send nothing
    objs += asm.feed(TritonChunk(text="lo", final=True, finish_reason="stop", num_output_tokens=2, routing={"x": 1}))
    objs += asm.finish()
    assert [o["choices"][0]["delta"] for o in objs] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert [o["choices"][0]["finish_reason"] for o in objs] == [None, None, None, "stop"]
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == "chatcmpl-9" for o in objs)
    assert all("usage" not in o for o in objs)  # only with stream_options.include_usage
    assert objs[-1]["routing"] == {"x": 1} and all("routing" not in o for o in objs[:-1])


def test_stream_completion_chunks_with_usage() -> None:
    req = _completion_req(stream=True, include_usage=True)
    asm = StreamAssembler(req, prompt_tokens=4, count_completion_tokens=lambda t: 99)
    assert asm.start() == []
    objs = asm.feed(TritonChunk(text="abc"))
    objs += asm.feed(TritonChunk(final=True, finish_reason="length", num_output_tokens=3, routing={"handoffs": 0}))
    objs += asm.finish()
    assert [o["object"] for o in objs] == ["text_completion"] * 3
    assert objs[0]["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": None}]
    assert objs[1]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert objs[0]["usage"] is None and objs[1]["usage"] is None
    assert objs[2]["choices"] == [] and objs[2]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
    }
    assert objs[2]["routing"] == {"handoffs": 0} and "routing" not in objs[1]


def test_stream_finish_error() -> None:
    asm = StreamAssembler(_completion_req(stream=True), 1)
    asm.feed(TritonChunk(final=True, finish_reason="error"))
    with pytest.raises(OpenAIError) as ei:
        asm.finish()
    assert ei.value.status == 500


def test_sse_and_error_bodies() -> None:
    assert sse_event({"a": "x\ny", "b": "é"}) == 'data: {"a": "x\\ny", "b": "é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert error_body("bad") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert OpenAIError("boom", 500).body()["error"]["type"] == "server_error"
    assert models_list("m", 3) == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 3, "owned_by": "tokenrouter"}],
    }


@pytest.mark.parametrize(
    "message, status, expected",
    [
        ("prompt is empty", None, 400),
        ("prompt has 70 tokens, but the context limit is 64", None, 400),
        ("max_new_tokens must be an integer >= 1, got 0", None, 400),
        ("token id 5000 at position 0 is out of the vocabulary (size 1024)", None, 400),
        ("invalid sampling_parameters: not JSON", None, 400),
        ("[request id: x] unexpected inference input 'foo' for model 'tokenrouter'", None, 400),
        ("sampling_parameters is not valid JSON: Expecting value", None, 400),
        ("unknown sampling parameter(s) ['bogus']; supported: [...]", None, 400),
        ("text_input must be a non-empty string", None, 400),
        ("missing required input 'text_input'", None, 400),
        ("anything", "StatusCode.INVALID_ARGUMENT", 400),
        ("request unfinished after request_timeout_s (2 s): aborted", None, 504),
        ("CUDA out of memory", None, 500),
        ("failed to connect to all addresses", "StatusCode.UNAVAILABLE", 503),
        ("model 'large' is unavailable: its process exited and is being restarted; retry shortly", None, 503),
        ("model 'large' went away during the request (its process exited, or the server is shutting down)", None, 503),
        ("the server is shutting down", None, 503),
        ("model 'large' rejected the request: prompt has 70 tokens, but the context limit is 64", None, 400),
        ("Request for unknown model: 'tokenrouter' is not found", None, 500),
    ],
)
def test_triton_error_status(message: str, status: str | None, expected: int) -> None:
    assert triton_error_status(message, status) == expected


def test_peer_closed() -> None:
    a, b = socket.socketpair()
    try:
        assert not peer_closed(a)
        a.settimeout(30)  # as the handler's connection has (IDLE_TIMEOUT_S): still asked without waiting
        start = time.monotonic()
        assert not peer_closed(a) and time.monotonic() - start < 1
        b.sendall(b"GET / HTTP/1.1\r\n")  # pipelined bytes: readable but not closed
        assert not peer_closed(a)
        b.close()
        a.recv(100)
        assert peer_closed(a)
    finally:
        a.close()
    assert peer_closed(a)  # a closed socket counts as gone


# --------------------------------------------------------------------------------------------------
# A fake `tokenrouter` Triton model behind Triton's real gRPC service definition
# --------------------------------------------------------------------------------------------------


def _infer_response(request_id: str, outputs: dict[str, np.ndarray], final: bool) -> Any:
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    resp = service_pb2.ModelInferResponse(model_name="tokenrouter", id=request_id)
    for name, arr in outputs.items():
        # Metadata in `outputs`, data in `raw_output_contents` at the same index, as Triton sends them.
        resp.outputs.add(name=name, datatype=np_to_triton_dtype(arr.dtype), shape=list(arr.shape))
        resp.raw_output_contents.append(serialize_byte_tensor(arr).item() if arr.dtype == object else arr.tobytes())
    resp.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


class FakeTriton:
    """Generates "w0 w1 ..." one word per response; prompts "BAD"/"CRASH" fail; records cancellations.

    Like the real model it streams deltas when `stream` is true (then a flags-only final response with
    the stats), answers once with everything otherwise, and stops when its gRPC context is cancelled.
    """

    def __init__(self, token_delay: float = 0.0) -> None:
        from tritonclient.grpc import service_pb2_grpc

        self.token_delay = token_delay
        self.requests: list[dict[str, Any]] = []
        self.cancelled = threading.Event()
        fake = self

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelReady(self, request, context):
                from tritonclient.grpc import service_pb2

                return service_pb2.ModelReadyResponse(ready=request.name == "tokenrouter")

            def ModelStreamInfer(self, request_iterator, context):
                for req in request_iterator:
                    yield from fake.generate(req, context)

        import grpc

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"127.0.0.1:{self.port}"

    @staticmethod
    def decode_inputs(req: Any) -> dict[str, Any]:
        from tritonclient.utils import deserialize_bytes_tensor

        out = {}
        for inp, raw in zip(req.inputs, req.raw_input_contents):
            if inp.datatype == "BYTES":
                out[inp.name] = deserialize_bytes_tensor(raw)[0].decode()
            else:
                out[inp.name] = bool(np.frombuffer(raw, dtype=np.bool_)[0])
        return out

    def generate(self, req: Any, context: Any) -> Iterator[Any]:
        inputs = self.decode_inputs(req)
        inputs["sampling_parameters"] = json.loads(inputs["sampling_parameters"])
        self.requests.append(inputs)
        from tritonclient.grpc import service_pb2

        if inputs["text_input"] == "BAD":
            yield service_pb2.ModelStreamInferResponse(
                error_message="prompt has 99 tokens, but the context limit is 64"
            )
            return
        if inputs["text_input"] == "FAILMID":  # fails after the first token, once the 200 has gone out
            yield _infer_response(req.id, {"text_output": np.array([b"w0 "], dtype=object)}, False)
            yield service_pb2.ModelStreamInferResponse(error_message="CUDA error: an illegal memory access")
            return
        if inputs["text_input"] == "CRASH":
            yield service_pb2.ModelStreamInferResponse(error_message="CUDA error: an illegal memory access")
            return
        # gRPC stops pulling from a cancelled RPC's generator, so the generator cannot notice by itself;
        # the termination callback can. Finishing first means it was not a cancellation.
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self.cancelled.set())
        n = inputs["sampling_parameters"]["max_tokens"]
        words = [f"w{i} " for i in range(n)]
        stats = {
            "finish_reason": np.array([b"length"], dtype=object),
            "num_output_tokens": np.array([n], dtype=np.uint32),
            "routing_stats": np.array([json.dumps({"tokens_per_model": {"small": n}, "handoffs": 0}).encode()], object),
        }
        for w in words:
            time.sleep(self.token_delay)
            if not context.is_active():
                return
            if inputs["stream"]:
                yield _infer_response(req.id, {"text_output": np.array([w.encode()], dtype=object)}, False)
        finished.set()
        if inputs["stream"]:
            yield _infer_response(req.id, stats, True)  # flags-only final, as enable_empty_final_response allows
            return
        text = "".join(words) if inputs["exclude_input_in_output"] else inputs["text_input"] + "".join(words)
        yield _infer_response(req.id, {"text_output": np.array([text.encode()], dtype=object), **stats}, True)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def fake_triton() -> Iterator[FakeTriton]:
    fake = FakeTriton()
    yield fake
    fake.stop()


def test_grpc_backend_stream_and_final(fake_triton: FakeTriton) -> None:
    backend = TritonGrpcBackend(fake_triton.url)
    try:
        assert backend.is_ready()
        for _ in range(2):  # the second request reuses the pooled client
            with backend.open_stream(triton_input_arrays("p", {"max_tokens": 3}, True), "req-1") as s:
                chunks = list(s.chunks())
            assert [c.text for c in chunks] == ["w0 ", "w1 ", "w2 ", ""]
            assert chunks[-1].final and chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 3
            assert chunks[-1].routing == {"tokens_per_model": {"small": 3}, "handoffs": 0}
        assert len(backend._idle) == 1
        with backend.open_stream(triton_input_arrays("p", {"max_tokens": 2}, False), "req-2") as s:
            (chunk,) = list(s.chunks())
        assert chunk.text == "w0 w1 " and chunk.final
        with backend.open_stream(triton_input_arrays("BAD", {"max_tokens": 2}, False), "req-3") as s:
            with pytest.raises(TritonRequestError, match="context limit") as ei:
                list(s.chunks())
        assert triton_error_status(ei.value.message, ei.value.status) == 400
    finally:
        backend.close()
    assert not TritonGrpcBackend("127.0.0.1:1").is_ready(timeout=0.5)


def test_grpc_backend_cancel_reaches_server() -> None:
    fake = FakeTriton(token_delay=0.01)
    backend = TritonGrpcBackend(fake.url)
    try:
        s = backend.open_stream(triton_input_arrays("p", {"max_tokens": 1000}, True), "req-c")
        it = s.chunks()
        assert next(it).text == "w0 "
        s.cancel()
        assert fake.cancelled.wait(5), "the fake model never saw the RPC cancelled"
        s.close()  # idempotent after cancel
        assert backend._idle == []  # a cancelled client is not reused
    finally:
        backend.close()
        fake.stop()


# --------------------------------------------------------------------------------------------------
# The HTTP server end to end (real gRPC backend, fake model)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def frontend() -> Iterator[tuple[FakeTriton, tuple[str, int]]]:
    fake = FakeTriton(token_delay=0.002)
    server = build_server(fake.url, "127.0.0.1", 0, "", "tokenrouter", tokenizer=WordTokenizer())
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield fake, server.server_address[:2]
    server.shutdown()
    server.server_close()
    fake.stop()


def _post(addr: tuple[str, int], path: str, body: Any) -> tuple[int, http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection(*addr, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp, resp.read()


def _sse_objects(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_http_get_routes(frontend) -> None:
    _, addr = frontend
    conn = http.client.HTTPConnection(*addr, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read()) == {"status": "ready"}
    conn.request("GET", "/v1/models")  # same keep-alive connection
    r = conn.getresponse()
    assert r.status == 200 and [m["id"] for m in json.loads(r.read())["data"]] == ["tokenrouter"]
    conn.request("GET", "/nope")
    r = conn.getresponse()
    assert r.status == 404 and "error" in json.loads(r.read())


def test_http_health_503_when_model_missing() -> None:
    fake = FakeTriton()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=WordTokenizer(), triton_model_name="other")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()


def test_http_503_when_triton_is_unreachable(frontend, caplog: pytest.LogCaptureFixture) -> None:
    """Triton gone (stopped, restarting): a request is a 503 saying the server is unavailable, streamed or not,
    with gRPC's channel details (addresses, resolver) in the front end's log rather than in the client's body;
    a model the router reports down ("... is unavailable ...; retry shortly") is a 503 too."""
    fake, addr = frontend
    fake.stop()
    for stream in (False, True):
        status, _, body = _post(addr, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "stream": stream})
        err = json.loads(body)["error"]
        assert (status, err["message"], err["type"]) == (503, UNREACHABLE_MESSAGE, "server_error"), body
    assert any("request failed with 503" in r.getMessage() and fake.url.rsplit(":", 1)[1] in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_client_reset_is_no_traceback(frontend, capfd: pytest.CaptureFixture) -> None:
    """A client that resets its connection before its request line (a load generator's, a cancelled one's) is
    routine: no traceback on the front end's stderr, and it goes on serving."""
    _, addr = frontend
    capfd.readouterr()
    for _ in range(3):
        s = socket.create_connection(addr)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close -> RST
        s.send(b"POST /v1/compl")
        s.close()
    status, _, _ = _post(addr, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
    assert status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_http_completion(frontend) -> None:
    fake, addr = frontend
    status, _, raw = _post(addr, "/v1/completions", {"model": "tokenrouter", "prompt": "a b c", "max_tokens": 3})
    assert status == 200
    out = json.loads(raw)
    assert out["choices"][0]["text"] == "w0 w1 w2 " and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert out["routing"]["tokens_per_model"] == {"small": 3}
    sent = fake.requests[-1]
    assert sent["text_input"] == "a b c" and sent["stream"] is False and sent["exclude_input_in_output"] is True
    assert sent["sampling_parameters"] == {"max_tokens": 3}


def test_http_chat_stream_with_usage(frontend) -> None:
    fake, addr = frontend
    body = {
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, resp, raw = _post(addr, "/v1/chat/completions", body)
    assert status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    objs = _sse_objects(raw)
    deltas = [o["choices"][0]["delta"] for o in objs if o["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "w0 "}, {"content": "w1 "}, {}]
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
    }
    assert objs[-1]["routing"]["handoffs"] == 0
    assert fake.requests[-1]["text_input"] == "<user> hi there <assistant> " and fake.requests[-1]["stream"] is True


def test_http_errors(frontend) -> None:
    _, addr = frontend
    status, _, raw = _post(addr, "/v1/completions", b"{oops")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "x", "n": 2})
    assert status == 400 and "n=1" in json.loads(raw)["error"]["message"]
    status, _, raw = _post(addr, "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and json.loads(raw)["error"]["code"] == "model_not_found"
    # Triton's own errors: bad input -> 400, anything else -> 500; even when streaming, since the
    # status line waits for Triton's first response.
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "BAD", "stream": True})
    assert status == 400 and "context limit" in json.loads(raw)["error"]["message"]
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "CRASH"})
    assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"
    # After the first token the status is spent: the error comes in-band, then [DONE].
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "FAILMID", "stream": True})
    objs = _sse_objects(raw)
    assert status == 200 and objs[0]["choices"][0]["text"] == "w0 "
    assert objs[-1]["error"]["type"] == "server_error" and "illegal memory access" in objs[-1]["error"]["message"]


def _send_raw_post(addr: tuple[str, int], body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(addr, timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_http_disconnect_cancels_triton_request(stream: bool) -> None:
    """Closing the HTTP connection mid-generation cancels the gRPC stream, so Triton aborts the request.

    Streaming notices on the next write (or the socket poll); non-streaming only through the poll.
    """
    fake = FakeTriton(token_delay=0.01)
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=WordTokenizer())
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        sock = _send_raw_post(server.server_address[:2], {"prompt": "x", "max_tokens": 2000, "stream": stream})
        if stream:
            got = b""
            while b"w1" not in got:  # tokens are flowing
                got += sock.recv(4096)
        else:
            deadline = time.monotonic() + 5
            while not fake.requests and time.monotonic() < deadline:  # the request reached the model
                time.sleep(0.01)
        sock.close()
        assert fake.cancelled.wait(5), "closing the HTTP connection did not cancel the Triton request"
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()


# --------------------------------------------------------------------------------------------------
# API key (`--api-key` / $TOKENROUTER_API_KEY)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def keyed_frontend() -> Iterator[tuple[FakeTriton, tuple[str, int]]]:
    fake = FakeTriton()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=WordTokenizer(), api_key="s3cret-key")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield fake, server.server_address[:2]
    server.shutdown()
    server.server_close()
    fake.stop()


def _request(conn: http.client.HTTPConnection, method: str, path: str, auth: str | None, body: Any = None):
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    return resp.status, resp, resp.read()


def test_api_key_required_on_every_route_but_health(keyed_frontend) -> None:
    fake, addr = keyed_frontend
    conn = http.client.HTTPConnection(*addr, timeout=10)  # one keep-alive connection throughout
    completion = {"prompt": "a b", "max_tokens": 2}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tokenrouter", None),
        ("POST", "/v1/completions", completion),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("GET", "/nope", None),
    ]:
        for auth in (None, "Bearer wrong-key", "Basic s3cret-key", "Bearer", "s3cret-key", "Bearer s3cret-keyX"):
            status, resp, raw = _request(conn, method, path, auth, body)
            assert status == 401, (method, path, auth)
            assert resp.getheader("WWW-Authenticate") == "Bearer"
            err = json.loads(raw)["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            assert "s3cret" not in err["message"]
    assert fake.requests == []  # nothing reached Triton
    status, _, raw = _request(conn, "GET", "/health", None)
    assert status == 200 and json.loads(raw) == {"status": "ready"}
    # With the key (the scheme is case-insensitive, as RFC 7235 has it).
    for auth in ("Bearer s3cret-key", "bearer s3cret-key"):
        status, _, raw = _request(conn, "POST", "/v1/completions", auth, completion)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == "w0 w1 "
    status, _, raw = _request(conn, "GET", "/v1/models", "Bearer s3cret-key")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "tokenrouter"
    status, _, _ = _request(conn, "GET", "/nope", "Bearer s3cret-key")
    assert status == 404


def test_api_key_refusal_drains_the_body() -> None:
    """A refused POST still reads its body, so the next request on the connection parses."""
    fake = FakeTriton()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=WordTokenizer(), api_key="k")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        big = {"prompt": "x " * 50_000, "max_tokens": 1}
        assert _request(conn, "POST", "/v1/completions", None, big)[0] == 401
        assert _request(conn, "POST", "/v1/completions", "Bearer k", {"prompt": "x", "max_tokens": 1})[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()


def test_api_key_from_flag_or_env(monkeypatch) -> None:
    """`--api-key` wins over $TOKENROUTER_API_KEY; with neither, no key is asked for."""
    from tokenrouter.serving.openai import API_KEY_ENV, build_arg_parser, http_server

    seen: list[str | None] = []

    def fake_build_server(*args: Any, api_key: str | None = None, **kw: Any) -> Any:
        seen.append(api_key)
        raise OSError("stop here")  # run_from_args reports it and returns 2

    monkeypatch.setattr(http_server, "build_server", fake_build_server)
    parser = build_arg_parser()
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert http_server.run_from_args(parser.parse_args(["--tokenizer", "t"])) == 2
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert http_server.run_from_args(parser.parse_args(["--tokenizer", "t"])) == 2
    assert http_server.run_from_args(parser.parse_args(["--tokenizer", "t", "--api-key", "from-flag"])) == 2
    assert seen == [None, "from-env", "from-flag"]


def test_a_busy_port_is_a_clear_error_and_the_backend_is_closed() -> None:
    """`tokenrouter openai --port P` with P taken: run_from_args says `cannot start` (it catches OSError); the
    server's failed bind must not trip over its own half-built state, and the backend it was given is closed."""
    from tokenrouter.serving.openai import build_server

    class Backend:
        closed = False

        def close(self) -> None:
            self.closed = True

    backend = Backend()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use"):
            build_server("unused:1", "127.0.0.1", taken.getsockname()[1], "", backend=backend,
                         tokenizer=WordTokenizer())
    assert backend.closed


def test_the_frontend_stops_on_sigint_even_when_started_with_it_ignored(tiny_dir) -> None:
    """A shell starts a background job (`tokenrouter openai ... &`) with SIGINT ignored; a container stops
    with SIGTERM. Both must end the front end (it needs no Triton server to start or stop)."""
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    for sig in (signal.SIGINT, signal.SIGTERM):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "tokenrouter.serving.openai", "--tokenizer", str(tiny_dir / "tokenizer"),
               "--port", str(port), "--triton-url", "127.0.0.1:1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                    break
                except urllib.error.HTTPError:
                    break  # answering (the Triton server behind it is absent)
                except OSError:
                    assert time.monotonic() < deadline, "the front end did not start"
                    time.sleep(0.2)
            proc.send_signal(sig)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
