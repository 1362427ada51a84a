"""The OpenAI frontend against oversized and hostile input: the router's prompt bound applied before tokenizing,
the body cap from the Content-Length alone, no tokenizer lock between requests, a string `max_tokens`, and the
client scripts facing a server that is not there. No tritonserver: the fake model of test_openai_unit.py."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from test_openai_unit import FakeTriton, WordTokenizer, _post
from tokenrouter.serving.openai import build_server, load_frontend_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 64
LONGEST_ENTRY = 4
BOUND = 4 * CONTEXT * LONGEST_ENTRY  # the router's rule (tokenizer.PromptCharBound): 1,024 characters


class CountingTokenizer(WordTokenizer):
    """WordTokenizer with a context limit and a vocabulary (so the frontend derives the bound), recording the
    length of every text it tokenizes; a text holding "SLOW" waits in the tokenizer until `release` is set."""

    model_max_length = CONTEXT

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.slow_entered = threading.Event()
        self.release = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b c": 1, "x" * LONGEST_ENTRY: 2}

    def __call__(self, text: str, verbose: bool = True) -> dict[str, list[int]]:
        self.calls.append(len(text))
        if "SLOW" in text:
            self.slow_entered.set()
            self.release.wait(30)  # bounded, so a broken test fails instead of hanging
        return super().__call__(text)


@pytest.fixture
def limited() -> Iterator[tuple[FakeTriton, Any, CountingTokenizer]]:
    fake = FakeTriton()
    tok = CountingTokenizer()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=tok)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    tok.calls.clear()  # the server's own warm-up call
    yield fake, server, tok
    tok.release.set()
    server.shutdown()
    server.server_close()
    fake.stop()


def _error(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)["error"]


def test_over_long_prompt_is_refused_before_tokenizing(limited) -> None:
    fake, server, tok = limited
    addr = server.server_address[:2]
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "x" * (BOUND + 1), "max_tokens": 2})
    err = _error(raw)
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == "prompt"
    assert f"prompt has {BOUND + 1} characters" in err["message"] and f"at most {BOUND} characters" in err["message"]
    assert f"context limit of {CONTEXT} tokens" in err["message"]

    # Chat: the messages' text (roles included) before the template, then the rendered prompt, since the template
    # adds text per message: 200 messages of 4 characters ("user", no content) render to 1,612.
    status, _, raw = _post(addr, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * BOUND}]})
    assert status == 400 and f"the messages' text has {BOUND + 4} characters" in _error(raw)["message"]
    status, _, raw = _post(addr, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 200})
    err = _error(raw)
    assert status == 400 and err["param"] == "messages" and "the chat prompt" in err["message"]
    assert tok.calls == [] and fake.requests == []

    # At the bound it goes through, tokenized once.
    status, _, raw = _post(addr, "/v1/completions", {"prompt": "x " * (BOUND // 2), "max_tokens": 2})
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == BOUND // 2
    assert tok.calls == [BOUND]


def test_oversized_body_is_refused_from_its_content_length(limited) -> None:
    _, server, tok = limited
    limit = server.max_body_bytes
    assert limit == 6 * BOUND + 64 * 1024  # 6 bytes per character (a \uXXXX escape) and room for the rest
    # Headers only: the answer must come without the server waiting for a body it would not read.
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (limit + 1))
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        err = _error(resp.read())
    assert resp.status == 413 and resp.getheader("Connection") == "close"
    assert f"{limit + 1} bytes, more than the {limit}" in err["message"] and f"{BOUND} characters" in err["message"]
    assert tok.calls == []


def _read_until_closed(sock: socket.socket) -> bytes:
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    return raw


def test_without_the_key_a_client_expecting_100_continue_gets_401_not_the_limits() -> None:
    fake = FakeTriton()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=CountingTokenizer(), api_key="secret")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                         b"Content-Length: %d\r\n\r\n" % (server.max_body_bytes + 1))
            raw = _read_until_closed(sock)
        assert raw.startswith(b"HTTP/1.1 401"), raw[:80]
        assert b"bytes" not in raw.split(b"\r\n\r\n", 1)[1]  # nothing about the server's limits
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()


def test_a_client_expecting_100_continue_is_refused_before_it_uploads(limited) -> None:
    """curl sends `Expect: 100-continue` for large bodies and waits: it must get the 413, not an invitation to
    upload megabytes that would not be read."""
    _, server, tok = limited
    limit = server.max_body_bytes
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % (limit + 1))
        raw = _read_until_closed(sock)  # raw: http.client would skip a 100 Continue
    assert raw.startswith(b"HTTP/1.1 413"), raw[:80]
    assert b"Connection: close" in raw and f"{limit + 1} bytes".encode() in raw
    # Within the cap the client is invited to send its body as before.
    body = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(64).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        resp.read()
    assert resp.status == 200
    assert tok.calls == [len("hello there")]


def test_a_small_request_does_not_wait_for_a_long_tokenization(limited) -> None:
    """Requests share the tokenizer without a lock: one stuck in it (here until released) holds up no other."""
    _, server, tok = limited
    addr = server.server_address[:2]
    slow: list[int] = []
    t = threading.Thread(target=lambda: slow.append(_post(addr, "/v1/completions", {"prompt": "SLOW a b"})[0]))
    t.start()
    assert tok.slow_entered.wait(10)
    try:
        status, _, _ = _post(addr, "/v1/completions", {"prompt": "a b", "max_tokens": 2})  # 10 s timeout
        assert status == 200
        assert slow == []  # the long one is still in the tokenizer
    finally:
        tok.release.set()
        t.join(10)
    assert slow == [200]


class _Turns:
    """Wraps the test tokenizer: counts how many "SLOW" texts are inside it at once (the most ever)."""

    def __init__(self, tok: CountingTokenizer) -> None:
        self.tok, self.inside, self.most = tok, 0, 0
        self.lock = threading.Lock()
        self.entered = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __call__(self, text: str, verbose: bool = True) -> dict[str, list[int]]:
        if "SLOW" not in text:
            return self.tok(text, verbose=verbose)
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        self.entered.release()
        try:
            return self.tok(text, verbose=verbose)
        finally:
            with self.lock:
                self.inside -= 1


def _three_at_once_take_turns(limited, long_prompt_chars: int, path: str, body: dict[str, Any],
                              meanwhile: Callable[[], None] | None = None) -> None:
    """Three copies of a "SLOW" request at once: two are tokenized, the third waits for a turn (`meanwhile` runs
    then, while the first two are held in the tokenizer); once released all three succeed, never more than two
    inside the tokenizer together."""
    _, server, tok = limited
    server.long_prompt_chars = long_prompt_chars
    server.tokenizer = turns = _Turns(tok)
    addr = server.server_address[:2]
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(_post(addr, path, body)[0])) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert turns.entered.acquire(timeout=10) and turns.entered.acquire(timeout=10)
        assert not turns.entered.acquire(timeout=0.5)  # the third waits for a turn
        if meanwhile is not None:
            meanwhile()
            assert done == []
    finally:
        tok.release.set()
        for t in threads:
            t.join(10)
    assert done == [200, 200, 200] and turns.most == 2


def test_long_prompts_are_tokenized_two_at_a_time_and_short_ones_pass(limited) -> None:
    """Without the lock, a burst of prompts near the bound would all be tokenized at once (hundreds of MB each):
    long ones take turns (LONG_PROMPT_TOKENIZERS), a short one never waits for them."""
    addr = limited[1].server_address[:2]

    def short_one_passes() -> None:
        status, _, _ = _post(addr, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
        assert status == 200

    _three_at_once_take_turns(limited, 10, "/v1/completions", {"prompt": "SLOW a b c d e f", "max_tokens": 2},
                              meanwhile=short_one_passes)


def test_chat_prompts_take_turns_by_their_rendered_length(limited) -> None:
    """The turn is decided on the text tokenized, the chat template's included: messages whose own text is short
    (20 characters, roles counted) render into a 48-character prompt, which takes a turn like any long one."""
    messages = [{"role": "user", "content": "SLOW"}] + [{"role": "user", "content": ""}] * 3
    assert sum(len(v) for m in messages for v in m.values()) < 30
    _three_at_once_take_turns(limited, 30, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})


def test_a_real_fast_tokenizer_shared_by_threads(tiny_dir: Path) -> None:
    """The no-lock decision, on the real thing: concurrent chat and completion requests of mixed lengths through
    one HF fast tokenizer all succeed ("Already borrowed" would be a 500) with the right token counts."""
    tok = load_frontend_tokenizer(str(tiny_dir / "tokenizer"))
    fake = FakeTriton()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=tok)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    addr = server.server_address[:2]
    failures: list[Any] = []

    def client(i: int) -> None:
        for k in range(12):
            text = "def f(x):\n    return x + 1\n" * (1 + (i * 7 + k * 131) % 400)
            body: dict[str, Any] = {"max_tokens": 1}
            path = "/v1/chat/completions" if k % 2 else "/v1/completions"
            body.update({"messages": [{"role": "user", "content": text}]} if k % 2 else {"prompt": text})
            status, _, raw = _post(addr, path, body)
            want = len(tok(text)["input_ids"]) if path == "/v1/completions" else None
            got = json.loads(raw).get("usage", {}).get("prompt_tokens") if status == 200 else None
            if status != 200 or (want is not None and got != want):
                failures.append((status, raw[:200], want, got))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()
    assert failures == []


@pytest.mark.parametrize(
    "path, key",
    [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
     ("/v1/chat/completions", "max_completion_tokens")],
)
def test_max_tokens_as_a_string_is_a_400_naming_the_field(limited, path: str, key: str) -> None:
    """Triton's own interface takes "16" for 16 (as vllm_backend does); the OpenAI API does not, and says so."""
    fake, server, _ = limited
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    status, _, raw = _post(server.server_address[:2], path, {**body, key: "16"})
    err = _error(raw)
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == key
    assert err["message"] == f"'{key}' must be an integer >= 1, got '16'"
    assert fake.requests == []


@pytest.mark.parametrize(
    "path, key",
    [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
     ("/v1/chat/completions", "max_completion_tokens")],
)
def test_an_output_limit_the_context_cannot_hold_is_a_400(path: str, key: str) -> None:
    """Told the deployment's context limit (`--max-model-len`), the frontend refuses a `max_tokens` that it cannot
    hold after the prompt (as OpenAI's API and vLLM's server refuse it), naming the field, with nothing sent to
    Triton; the largest that fits is served, and so is a request that sets no limit (the default is capped, not
    refused). Not told, it leaves the limit to the deployment: the tokenizer's limit is only a guess."""
    fake = FakeTriton()
    tok = CountingTokenizer()
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=tok, max_model_len=CONTEXT)
    guessing = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=tok)
    for s in (server, guessing):
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    try:
        _check_output_room(fake, server, tok, guessing, path, key)
    finally:
        for s in (server, guessing):
            s.shutdown()
            s.server_close()
        fake.stop()


def _check_output_room(fake: FakeTriton, server: Any, tok: CountingTokenizer, guessing: Any, path: str,
                       key: str) -> None:
    addr = server.server_address[:2]
    body = ({"prompt": "a a a a"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "a a a a"}]})
    tok.calls.clear()
    status, _, raw = _post(addr, path, {**body, key: 1})  # (the rendered prompt's token count, from the tokenizer)
    assert status == 200, raw
    prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    room = CONTEXT - prompt_tokens
    assert room > 0
    status, _, raw = _post(addr, path, {**body, key: room + 1})
    err = _error(raw)
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == key, raw
    assert err["message"] == (f"'{key}' is {room + 1}, but the prompt has {prompt_tokens} tokens and the context "
                              f"limit is {CONTEXT}: at most {room} tokens can follow it")
    assert len(fake.requests) == 1
    for ok in ({**body, key: room}, body):
        status, _, raw = _post(addr, path, ok)
        assert status == 200, raw
    assert len(fake.requests) == 3
    status, _, raw = _post(guessing.server_address[:2], path, {**body, key: room + 1})
    assert status == 200 and len(fake.requests) == 4, raw
    # A prompt the stated limit cannot hold with one token after it: refused here, as the router refuses it.
    words = " ".join(["a"] * CONTEXT)
    long = {"prompt": words} if path == "/v1/completions" else {"messages": [{"role": "user", "content": words}]}
    for body_ in (long, {**long, key: 1}):
        status, _, raw = _post(addr, path, body_)
        err = _error(raw)
        assert status == 400 and err["param"] == ("prompt" if path == "/v1/completions" else "messages"), raw
        assert err["message"].startswith("prompt has ") and f"the context limit is {CONTEXT}" in err["message"]
    assert len(fake.requests) == 4


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port that refuses connections: bound (so nothing else takes it) but not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "script, url",
    [
        ("http_generate_stream.py", "127.0.0.1:{port}"),
        ("http_infer.py", "127.0.0.1:{port}"),
        ("grpc_stream.py", "127.0.0.1:{port}"),
        ("openai_example.py", "http://127.0.0.1:{port}/v1"),
    ],
)
def test_client_scripts_say_the_server_is_unreachable(closed_port: int, script: str, url: str) -> None:
    if script == "openai_example.py" and importlib.util.find_spec("openai") is None:
        pytest.skip("the openai package is not installed")
    url = url.format(port=closed_port)
    proc = subprocess.run(
        [sys.executable, str(REPO / "clients" / script), "--url", url, "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cannot reach the server at "), proc.stderr
    assert f"127.0.0.1:{closed_port}" in lines[0] and "Connection refused" in lines[0]


def _raw(server: Any, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a new connection; the answer's status, headers and body (read to the connection's close or
    the answer's length)."""
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, dict(resp.getheaders()), resp.read()


@pytest.mark.parametrize("request_line, status", [
    (b"GARBAGE\r\n\r\n", 400),  # not a request line at all
    (b"GET /v1/models HTTP/9.9\r\n\r\n", 505),  # a version it does not speak
    (b"BREW /v1/models HTTP/1.1\r\nHost: t\r\n\r\n", 501),  # a method nobody handles
])  # fmt: skip
def test_what_http_server_refuses_itself_is_a_json_error(limited, request_line: bytes, status: int) -> None:
    """A hostile trial got http.server's HTML error page for these: every answer is in the OpenAI error shape."""
    _, server, _ = limited
    got, headers, body = _raw(server, request_line)
    assert got == status and headers["Content-Type"] == "application/json", (got, headers, body)
    assert _error(body)["message"], body


@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"), ("PATCH", "/v1/models", "GET"),
    ("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"), ("POST", "/health", "GET"),
])  # fmt: skip
def test_other_methods_get_405_naming_the_allowed_one_and_the_connection_stays_usable(
        limited, method: str, path: str, allow: str) -> None:
    _, server, _ = limited
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=5)
    try:
        conn.request(method, path, body=b'{"x": 1}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        err = _error(resp.read())
        assert resp.status == 405 and resp.getheader("Allow") == allow, (resp.status, err)
        assert f"method {method} is not allowed for {path}; use {allow}" == err["message"]
        conn.request("GET", "/v1/models")  # the same connection: the body was read, nothing is out of step
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["data"]
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "OPTIONS"])
def test_other_methods_on_no_route_get_404(limited, method: str) -> None:
    """A path that is no route is a 404 whatever the method, as for GET and POST (a hostile trial got 405 for
    PUT /unknown, telling it to use GET); /v1/models/{name} is a GET route."""
    _, server, _ = limited
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=5)
    try:
        conn.request(method, "/v1/unknown", body=b"{}", headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        err = _error(resp.read())
        assert resp.status == 404 and resp.getheader("Allow") is None, (resp.status, err)
        assert err["message"] == f"no route for {method} /v1/unknown"
        conn.request(method, "/v1/models/tokenrouter")
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("Allow") == "GET", resp.read()
        resp.read()
    finally:
        conn.close()


def test_a_head_request_gets_headers_only(limited) -> None:
    """No body after a HEAD answer: the next answer on the connection would start with it (a bad status line)."""
    _, server, _ = limited
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=5)
    try:
        conn.request("HEAD", "/v1/models")
        head = conn.getresponse()
        assert head.status == 405 and head.getheader("Allow") == "GET" and head.read() == b""
        conn.request("GET", "/v1/models")
        after = conn.getresponse()
        assert after.status == 200 and json.loads(after.read())["data"]
    finally:
        conn.close()


def test_a_connection_that_stalls_mid_request_is_closed(limited, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers sent in part and then nothing: the connection is closed after IDLE_TIMEOUT_S (0.5 s here), not
    kept with its thread for ever (a hostile trial held 100 such); an idle keep-alive connection alike."""
    from tokenrouter.serving.openai import http_server

    _, server, _ = limited
    monkeypatch.setattr(http_server._Handler, "timeout", 0.5)
    for sent in (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Len", b""):
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(sent)
            start = time.monotonic()
            assert _read_until_closed(sock) == b"" and time.monotonic() - start < 5


@pytest.mark.parametrize("stream", [True, False])
def test_a_generation_longer_than_the_idle_timeout_is_not_cut(monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """The idle timeout is about the client, not the generation: a request whose client waits quietly for 3 s of
    generation, past a 1 s timeout, gets every token. (The disconnect check once waited out the socket's timeout
    and then took the quiet client for gone: a review caught it before any release.)"""
    from tokenrouter.serving.openai import http_server

    monkeypatch.setattr(http_server._Handler, "timeout", 1.0)  # stands for IDLE_TIMEOUT_S
    fake = FakeTriton(token_delay=0.1)
    server = build_server(fake.url, "127.0.0.1", 0, "", tokenizer=CountingTokenizer())
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        status, _, raw = _post(server.server_address[:2], "/v1/completions",
                               {"prompt": "a", "max_tokens": 30, "stream": stream})
        assert status == 200 and not fake.cancelled.is_set(), raw[-300:]
        assert b"w29" in raw, raw[-300:]
    finally:
        server.shutdown()
        server.server_close()
        fake.stop()
