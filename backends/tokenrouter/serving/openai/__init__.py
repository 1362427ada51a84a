"""OpenAI-compatible HTTP server in front of the decoupled `tokenrouter` Triton model.

Layered so that tests can drive the pure parts without any server:

- `protocol`: OpenAI JSON -> validated `GenerationRequest` (`parse_completion_request`, `parse_chat_request`).
- `prompts`: the request's prompt text and token count, from the served tokenizer (`prepare_prompt`).
- `responses`: Triton responses (`TritonChunk`) -> OpenAI objects and SSE bytes (`assemble_response`,
  `StreamAssembler`, `sse_event`).
- `errors`: OpenAI-style error bodies and the HTTP status of a Triton error (`OpenAIError`, `triton_error_status`).
- `triton_client`: the model's input tensors and `TritonGrpcBackend` (one gRPC stream per request, so a
  request can be cancelled alone when its HTTP client goes away).
- `http_server`: the standard-library `ThreadingHTTPServer` (`build_server`) and the command line (`main`);
  with an API key (`--api-key`, $TOKENROUTER_API_KEY) every route but /health needs `Authorization: Bearer`.

Run it with `python -m tokenrouter.serving.openai --tokenizer DIR`.
"""

from tokenrouter.serving.openai.errors import (
    ClientDisconnected,
    OpenAIError,
    TritonRequestError,
    error_body,
    triton_error_status,
)
from tokenrouter.serving.openai.http_server import (
    API_KEY_ENV,
    MAX_BODY_BYTES,
    build_arg_parser,
    build_server,
    main,
    peer_closed,
    run_from_args,
)
from tokenrouter.serving.openai.prompts import count_tokens, load_frontend_tokenizer, prepare_prompt
from tokenrouter.serving.openai.protocol import (
    DEFAULT_MODEL_NAME,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    parse_sampling_parameters,
)
from tokenrouter.serving.openai.responses import (
    SSE_DONE,
    StreamAssembler,
    TritonChunk,
    assemble_response,
    chunk_from_infer_result,
    chunk_from_outputs,
    models_list,
    sse_event,
)
from tokenrouter.serving.openai.triton_client import (
    DEFAULT_TRITON_MODEL,
    TritonGrpcBackend,
    make_grpc_inputs,
    triton_input_arrays,
)

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_TRITON_MODEL",
    "MAX_BODY_BYTES",
    "SSE_DONE",
    "ClientDisconnected",
    "GenerationRequest",
    "OpenAIError",
    "StreamAssembler",
    "TritonChunk",
    "TritonGrpcBackend",
    "TritonRequestError",
    "assemble_response",
    "build_arg_parser",
    "build_server",
    "chunk_from_infer_result",
    "chunk_from_outputs",
    "count_tokens",
    "error_body",
    "load_frontend_tokenizer",
    "main",
    "make_grpc_inputs",
    "models_list",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
    "parse_sampling_parameters",
    "peer_closed",
    "prepare_prompt",
    "run_from_args",
    "sse_event",
    "triton_error_status",
    "triton_input_arrays",
]
