"""The HTTP side: a standard-library `ThreadingHTTPServer` serving the OpenAI routes (`build_server`), and the
command line around it (`build_arg_parser`, `run_from_args`, `main`).

With an API key (`--api-key` or $TOKENROUTER_API_KEY, as vLLM's `--api-key` / $VLLM_API_KEY) every route but
/health needs `Authorization: Bearer <key>`; without one, the routes are open.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tokenrouter.serving.openai.errors import ClientDisconnected, OpenAIError, TritonRequestError, to_openai_error
from tokenrouter.serving.openai.prompts import (
    check_context,
    count_tokens,
    load_frontend_tokenizer,
    prepare_prompt,
    tokenizer_context_limit,
)
from tokenrouter.serving.openai.protocol import (
    DEFAULT_MODEL_NAME,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from tokenrouter.serving.openai.responses import (
    SSE_DONE,
    StreamAssembler,
    assemble_response,
    model_object,
    models_list,
    sse_event,
)
from tokenrouter.serving.openai.triton_client import (
    DEFAULT_TRITON_MODEL,
    Backend,
    GenerationStream,
    TritonGrpcBackend,
    triton_input_arrays,
)

if TYPE_CHECKING:  # (it imports transformers; this package stays light to import)
    from tokenrouter.tokenizer import PromptCharBound

logger = logging.getLogger(__name__)

# Bodies are read whole before parsing; anything bigger is almost certainly a mistake. With a prompt bound the
# cap is lower (`body_limit`).
MAX_BODY_BYTES = 16 * 1024 * 1024
# Room in a body for what is not prompt text: the JSON around it, the other fields, each message's keys.
BODY_OVERHEAD_BYTES = 64 * 1024
# Prompts of at least this many characters are tokenized LONG_PROMPT_TOKENIZERS at a time: each holds its
# encoding (hundreds of MB near the bound) while it is tokenized, and with no limit a burst of them could exhaust
# memory. Shorter prompts never wait for them.
LONG_PROMPT_CHARS = 64 * 1024
LONG_PROMPT_TOKENIZERS = 2
API_KEY_ENV = "TOKENROUTER_API_KEY"
# Routes answered without the API key: load balancers probe them and they reveal nothing.
OPEN_PATHS = frozenset({"/health"})
POST_ROUTES = ("/v1/completions", "/v1/chat/completions")
# A connection that sends nothing for this long is closed: between requests (keep-alive; nginx's default is 75 s)
# or in the middle of one (a request line, headers or body sent in part: each holds a thread, and a hostile trial
# kept 100 such connections open for good). A streamed reply the client stops reading for this long ends too.
IDLE_TIMEOUT_S = 75.0


def _is_get_route(path: str) -> bool:
    return path in ("/health", "/v1/models") or path.startswith("/v1/models/")


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end of `sock` has closed it (readable with nothing to read means EOF).

    Lets a request notice its HTTP client left while it is still waiting on Triton, before any write
    could fail. Pipelined request bytes make the socket readable too, but then the peek sees data.
    Readiness is asked first, with a zero wait: on a socket with a timeout (the handler's IDLE_TIMEOUT_S) Python's
    recv waits for data up to that timeout whatever its flags, and a live client then read as gone.
    """
    try:
        if hasattr(select, "poll"):  # poll, not select: select fails on descriptors above FD_SETSIZE (1024)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            readable = bool(poller.poll(0))
        else:  # (Windows)
            readable = bool(select.select([sock], [], [], 0)[0])
        return readable and sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False  # nothing to read: still connected
    except (OSError, ValueError):
        return True  # reset, or the socket is already closed


def body_limit(bound: PromptCharBound | None) -> int:
    """The largest request body worth reading: 6 bytes per prompt character (a \\uXXXX escape, the longest JSON
    spelling of a character outside the rare astral planes) plus `BODY_OVERHEAD_BYTES`, at most `MAX_BODY_BYTES`."""
    if bound is None:
        return MAX_BODY_BYTES
    return min(MAX_BODY_BYTES, 6 * bound.max_chars + BODY_OVERHEAD_BYTES)


class OpenAIFrontendServer(ThreadingHTTPServer):
    """The HTTP server plus what its handlers share: backend, tokenizer, served model name."""

    daemon_threads = True
    # Many short-lived connections from load generators; the default backlog of 5 drops some.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        backend: Backend,
        tokenizer: Any,
        model_name: str = DEFAULT_MODEL_NAME,
        api_key: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        # Before binding: a bind that fails calls server_close, which closes the backend.
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._api_key = api_key.encode("utf-8") if api_key else None
        self.created = int(time.time())
        # Prompts and output limits are refused by their token counts only against a limit the operator stated
        # (`check_context`): the tokenizer's guess may be above the deployment's (the router refuses or caps there)
        # or below it (a 400 for what the deployment serves).
        self.stated_max_model_len = max_model_len
        # The router's own character bound on prompts, so that one it would refuse is refused here before the
        # frontend tokenizes it (for its token count).
        max_model_len = max_model_len if max_model_len is not None else tokenizer_context_limit(tokenizer)
        self.prompt_bound: PromptCharBound | None = None
        if max_model_len:
            from tokenrouter.tokenizer import PromptCharBound

            self.prompt_bound = PromptCharBound.of(tokenizer, max_model_len)
        else:
            logger.warning("no context limit known (the tokenizer names none): prompts are bounded only by the "
                           "body size; pass --max-model-len")
        self.max_body_bytes = body_limit(self.prompt_bound)
        # No lock around the tokenizer, which the handler threads share. An HF fast tokenizer fails ("Already
        # borrowed", huggingface/tokenizers#537) only when a call changes its settings (truncation, padding,
        # special-token splitting) while another thread encodes; transformers changes them only when a call asks
        # for other settings than the last, and this server always calls it one way (`count_tokens`; the chat
        # template renders text without it). This first call makes any such change before a thread exists; after
        # it calls only read the Rust tokenizer, whose encode releases the GIL, so a long prompt holds up no other
        # request (behind one lock, three 15 MB prompts held a small request for 68 s).
        count_tokens(tokenizer, "warm-up")
        self.long_prompt_chars = LONG_PROMPT_CHARS
        self._long_prompts = threading.BoundedSemaphore(LONG_PROMPT_TOKENIZERS)
        super().__init__(address, _Handler)

    @property
    def requires_key(self) -> bool:
        return self._api_key is not None

    def authorized(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries the API key (always, when none is set)."""
        if self._api_key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        # http.server decodes headers as latin-1: encoding back gives the bytes the client sent.
        sent = token.strip().encode("latin-1", errors="replace")
        # compare_digest: the time taken does not tell how much of a guess was right.
        return scheme.lower() == "bearer" and hmac.compare_digest(sent, self._api_key)

    def count_tokens(self, text: str) -> int:
        return count_tokens(self.tokenizer, text)

    def prepare_prompt(self, req: GenerationRequest) -> tuple[str, int]:
        return prepare_prompt(req, self.tokenizer, self.prompt_bound, turn=self._tokenizing_turn)

    def _tokenizing_turn(self, chars: int) -> contextlib.AbstractContextManager:
        """A turn among LONG_PROMPT_TOKENIZERS for a prompt of `chars` characters as tokenized (the chat
        template's text included: many short messages can render into a long prompt); none for a short one."""
        return self._long_prompts if chars >= self.long_prompt_chars else contextlib.nullcontext()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """An exception that left a connection's handler: a client that reset or closed its connection is
        routine (a load generator's, a cancelled request's), not a traceback on stderr as socketserver prints
        it; anything else goes to the log with its traceback."""
        if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError):
            logger.debug("client %s closed its connection mid-request", client_address)
            return
        logger.exception("error while serving %s", client_address)

    def server_close(self) -> None:
        super().server_close()
        self.backend.close()


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 for keep-alive; streamed bodies use chunked transfer encoding so the connection survives.
    protocol_version = "HTTP/1.1"
    server: OpenAIFrontendServer
    server_version = "tokenrouter-openai/0.1"
    timeout = IDLE_TIMEOUT_S  # (StreamRequestHandler sets it on the connection)
    # A request line too broken to name its version is answered with a status line and headers (HTTP/0.9, the
    # default, has neither: the client would read a bare body).
    default_request_version = "HTTP/1.0"
    _sse_started = False  # set per request: once the 200 went out, errors can only be reported in-band

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """What http.server answers itself (a malformed request line 400, an over-long one 414, too many headers
        431, a method without a handler 501) in the OpenAI error shape every other answer has, not an HTML page."""
        self.close_connection = True  # (http.server's own errors leave the connection unusable)
        try:
            self._send_error_obj(OpenAIError(message or explain or self.responses.get(code, ("error",))[0], code))
        except OSError:
            pass  # the client is gone

    def _method_not_allowed(self) -> None:
        path = self._path()
        if not self._authorized(path, has_body=True):
            return
        self._answer_other_method(path)

    def _answer_other_method(self, path: str) -> None:
        """A method `path` does not take: 405 naming the one it takes (`Allow`), or 404 where it is no route. Any
        body is read first, to keep the connection in step (the answer is the same whatever it holds)."""
        if self.headers.get("Content-Length") is not None:
            with contextlib.suppress(OpenAIError):
                self._read_body()
        elif self.headers.get("Transfer-Encoding") is not None:  # a body this server does not delimit
            self.close_connection = True
        if path in POST_ROUTES:
            allowed = "POST"
        elif _is_get_route(path):
            allowed = "GET"
        else:  # no such route, whatever the method
            self._send_error_obj(OpenAIError(f"no route for {self.command} {path}", 404))
            return
        self._send_error_obj(OpenAIError(f"method {self.command} is not allowed for {path or '/'}; use {allowed}", 405),
                             {"Allow": allowed})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _method_not_allowed

    # ---- responses ----

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:  # e.g. a body refused unread: say so, rather than leave the client to find out
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # (a HEAD answer has no body)
            self.wfile.write(data)

    def _send_error_obj(self, err: OpenAIError, headers: dict[str, str] | None = None) -> None:
        if err.status >= 500:
            logger.warning("request failed (%d): %s", err.status, err.message)
        self._send_json(err.status, err.body(), headers)

    def _path(self) -> str:
        """The request's route: its path without the query or a trailing slash."""
        return self.path.split("?", 1)[0].rstrip("/")

    def _has_access(self, path: str) -> bool:
        return path in OPEN_PATHS or self.server.authorized(self.headers.get("Authorization"))

    def _authorized(self, path: str, has_body: bool = False) -> bool:
        """True when the request may go on; else it has been answered with 401."""
        if self._has_access(path):
            return True
        if has_body:
            # Read what the client sent, so the connection stays in step for its next request.
            with contextlib.suppress(OpenAIError):
                self._read_body()
        if self.headers.get("Authorization") is None:
            message = "no API key: send it in an 'Authorization: Bearer <key>' header"
        else:
            message = "incorrect API key provided"
        self._send_error_obj(OpenAIError(message, 401, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        return False

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
        path = self._path()
        srv = self.server
        if not self._authorized(path):
            return
        if path == "/health":
            ready = srv.backend.is_ready()
            self._send_json(200 if ready else 503, {"status": "ready" if ready else "unavailable"})
        elif path == "/v1/models":
            self._send_json(200, models_list(srv.model_name, srv.created))
        elif path == f"/v1/models/{srv.model_name}":
            self._send_json(200, model_object(srv.model_name, srv.created))
        elif path.startswith("/v1/models/"):
            self._send_error_obj(OpenAIError(f"the model '{path[len('/v1/models/') :]}' does not exist", 404))
        else:
            self._answer_other_method(path)

    def do_POST(self) -> None:
        path = self._path()
        if not self._authorized(path, has_body=True):
            return
        if path == "/v1/completions":
            self._generate(parse_completion_request)
        elif path == "/v1/chat/completions":
            self._generate(parse_chat_request)
        else:
            self._answer_other_method(path)

    def handle_expect_100(self) -> bool:
        """A client that waits for "100 Continue" before it sends its body (curl does for bodies over 1 KiB) is
        refused from its headers, rather than invited to upload a body that would not be read: 401 without the
        key (before anything about the server's limits), else 400/411/413 for a body it would not read."""
        if self.command != "POST":
            return super().handle_expect_100()
        path = self._path()
        if not self._has_access(path):
            self.close_connection = True  # its body is never read
            self._authorized(path)  # answers 401
            return False
        try:
            self._body_length()
        except OpenAIError as e:
            self._send_error_obj(e)
            return False
        return super().handle_expect_100()

    def _read_body(self) -> bytes:
        """The request body; OpenAIError 411/413 (and the connection marked to close) when it cannot be read."""
        return self.rfile.read(self._body_length())

    def _body_length(self) -> int:
        """The body's length from its headers; OpenAIError 400/411/413 (and the connection marked to close) when it
        has none, a bad one, or one over the server's cap."""
        length = self.headers.get("Content-Length")
        if length is None:
            # No body we can delimit (e.g. a chunked upload): refuse it and drop the connection,
            # since whatever bytes follow cannot be told apart from the next request.
            self.close_connection = True
            raise OpenAIError("a Content-Length header is required", 411)
        try:
            n = int(length)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise OpenAIError(f"bad Content-Length {length!r}", 400)
        limit = self.server.max_body_bytes
        if n > limit:
            # Refused from the header alone: the body is never read, and the connection is dropped.
            self.close_connection = True
            bound = self.server.prompt_bound
            why = f" (prompts are limited to {bound.max_chars} characters)" if bound is not None else ""
            raise OpenAIError(f"request body has {n} bytes, more than the {limit} this server accepts{why}", 413)
        return n

    def _generate(self, parse: Callable[[Any, str], GenerationRequest]) -> None:
        srv = self.server
        try:
            raw = self._read_body()
        except OpenAIError as e:
            self._send_error_obj(e)
            return
        stream: GenerationStream | None = None
        self._sse_started = False
        try:
            req = parse(parse_json_body(raw), srv.model_name)
            prompt, prompt_tokens = srv.prepare_prompt(req)
            check_context(req, prompt_tokens, srv.stated_max_model_len)
            arrays = triton_input_arrays(prompt, req.sampling, req.stream)
            stream = srv.backend.open_stream(arrays, req.request_id, should_cancel=lambda: peer_closed(self.connection))
            if req.stream:
                self._stream_reply(req, stream, prompt_tokens)
            else:
                self._send_json(200, assemble_response(req, stream.chunks(), prompt_tokens, srv.count_tokens))
        except (ClientDisconnected, BrokenPipeError, ConnectionResetError, TimeoutError):
            # The client is gone (or stopped reading for IDLE_TIMEOUT_S): cancel the gRPC stream so Triton aborts the
            # generation.
            logger.info("client disconnected; cancelling the Triton request")
            if stream is not None:
                stream.cancel()
            self.close_connection = True
        except (TritonRequestError, OpenAIError) as e:
            err = to_openai_error(e)
            if err.status >= 500:  # the server's side: the full cause for the operator (the client gets err)
                logger.warning("request failed with %d: %s", err.status, e.message)
            self._fail(err)
        except Exception as e:
            logger.exception("unexpected error while serving %s", self.path)
            self._fail(OpenAIError(f"internal error: {e}", 500))
        finally:
            if stream is not None:
                stream.close()

    def _fail(self, err: OpenAIError) -> None:
        if self._sse_started:
            # Mid-stream there is no status left to set and the chunked body cannot be closed
            # cleanly; dropping the connection is the only honest signal.
            self.close_connection = True
        else:
            self._send_error_obj(err)

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
            err = to_openai_error(e)
            if err.status >= 500:
                logger.warning("stream failed: %s", e.message)
            self._write_chunk(sse_event(err.body()))
        self._write_chunk(SSE_DONE)
        self._write_chunk(b"")  # zero-length chunk: end of the chunked body


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
    api_key: str | None = None,
    max_model_len: int | None = None,
) -> ThreadingHTTPServer:
    """A bound (not yet serving) OpenAI-compatible server; call `serve_forever()` on it.

    `model_name` is the id clients see in /v1/models and must send as `model`; `triton_model_name` is the
    Triton model it forwards to. `backend` and `tokenizer` replace the gRPC backend and the tokenizer
    loaded from `tokenizer_dir` (tests pass fakes). Port 0 picks a free port (`server.server_address`).
    With `api_key`, every route but /health answers 401 unless the request sends `Authorization: Bearer <key>`.
    `max_model_len` is the deployment's context limit (default: the tokenizer's `model_max_length`); prompts
    longer than the router's character bound for it are refused before they are tokenized. Given, a prompt of as many
    tokens or more, and a `max_tokens` it cannot hold after the prompt, are refused too (else the deployment answers
    against its own limit).
    """
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len}")
    if tokenizer is None:
        tokenizer = load_frontend_tokenizer(tokenizer_dir)
    if backend is None:
        backend = TritonGrpcBackend(triton_url, triton_model_name)
    return OpenAIFrontendServer((host, port), backend, tokenizer, model_name, api_key, max_model_len)


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
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV}; unset: no key needed)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the deployment's context limit in tokens, which bounds prompt length (default: the tokenizer's "
        "model_max_length); given, a prompt or a max_tokens it cannot hold is a 400",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG logs every HTTP request)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """Serve with options parsed by `build_arg_parser` until interrupted; returns a process exit code."""
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    # A no-op when the caller (e.g. the `tokenrouter` CLI) configured logging already; the package
    # logger's own level (its modules' loggers inherit it) still makes --log-level count.
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__package__).setLevel(level)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        server = build_server(
            args.triton_url,
            args.host,
            args.port,
            args.tokenizer,
            args.served_model_name,
            triton_model_name=args.triton_model_name,
            api_key=api_key,
            max_model_len=args.max_model_len,
        )
    except (OSError, ValueError) as e:
        logger.error("cannot start: %s", e)
        return 2
    host, port = server.server_address[:2]
    logger.info(
        "serving OpenAI API for %r on http://%s:%s/v1 (Triton %s)%s",
        args.served_model_name,
        host,
        port,
        args.triton_url,
        "; API key required" if api_key else "",
    )
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "no API key: anyone who can reach %s:%s can generate (set --api-key or $%s)", host, port, API_KEY_ENV
        )
    # SIGINT and SIGTERM stop it: a shell starts a background job with SIGINT ignored, and a container stops
    # with SIGTERM.
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # (only there can handlers be set)
        handlers = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: parse `argv` (default sys.argv[1:]) and serve until interrupted."""
    return run_from_args(build_arg_parser().parse_args(argv))
