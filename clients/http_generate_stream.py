#!/usr/bin/env python3
"""Stream a completion from Triton's HTTP generate_stream endpoint and print the text as it arrives.

Each server-sent event carries the newly committed text (a delta) of the `tokenrouter` model; the last
one also carries the finish reason and token count. Uses `requests` when installed, else urllib.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

try:
    import requests
except ImportError:  # the standard library is enough; requests is just nicer with proxies and TLS
    requests = None


def error_text(raw: str) -> str:
    """The message in an error body: Triton sends `{"error": ...}` as JSON or as an SSE `data:` line."""
    for line in [raw, *raw.splitlines()]:
        line = line.strip().removeprefix("data:").strip()
        try:
            return str(json.loads(line)["error"])
        except (ValueError, KeyError, TypeError):
            continue
    return raw.strip()


def root_cause(e: BaseException) -> BaseException:
    """The innermost error behind `e` (e.g. `[Errno 111] Connection refused` behind requests' and urllib3's
    wrappers, which keep it as `reason` or as the exception's cause)."""
    seen = {id(e)}
    while True:
        reason = getattr(e, "reason", None)
        inner = reason if isinstance(reason, BaseException) else e.__cause__ or e.__context__
        if inner is None or id(inner) in seen:
            return e
        seen.add(id(inner))
        e = inner


def post_sse(url: str, body: dict) -> Iterator[dict]:
    """POST `body` and yield each `data:` event as a dict. Raises SystemExit on an HTTP error or when the
    server cannot be reached (one line, not a traceback)."""
    base = url.split("/v2/", 1)[0]
    if requests is not None:
        try:
            resp = requests.post(url, json=body, stream=True, timeout=(10, None))
        except requests.ConnectionError as e:
            raise SystemExit(f"cannot reach the server at {base}: {root_cause(e)}") from None
        with resp:
            if resp.status_code != 200:
                raise SystemExit(f"HTTP {resp.status_code}: {error_text(resp.text)}")
            # chunk_size=None: hand over each chunk as it arrives (Triton sends one per event); the default
            # 512 would hold text back until 512 bytes had piled up.
            lines: Iterator[bytes] = resp.iter_lines(chunk_size=None)
            yield from _events(lines)
        return
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"HTTP {e.code}: {error_text(e.read().decode(errors='replace'))}") from None
    except urllib.error.URLError as e:  # (after HTTPError, its subclass) no connection: refused, unknown host
        raise SystemExit(f"cannot reach the server at {base}: {root_cause(e)}") from None
    with resp:
        yield from _events(resp)  # iterating the response yields lines as soon as they arrive


def _events(lines: Iterator[bytes]) -> Iterator[dict]:
    for line in lines:
        line = line.strip()
        if line.startswith(b"data:"):
            yield json.loads(line[len(b"data:") :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8000", help="Triton HTTP address")
    p.add_argument("--model", default="tokenrouter")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)

    base = args.url if "://" in args.url else f"http://{args.url}"
    body = {
        "text_input": args.prompt,
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature}),
        "return_finish_reason": True,
        "return_num_output_tokens": True,
    }
    last: dict = {}
    for event in post_sse(f"{base}/v2/models/{args.model}/generate_stream", body):
        if "error" in event:  # errors after the first event arrive in-band, under a 200
            print(f"\nerror: {event['error']}", file=sys.stderr)
            return 1
        print(event.get("text_output", ""), end="", flush=True)
        last = event
    print()
    print(f"[finish_reason={last.get('finish_reason')} tokens={last.get('num_output_tokens')}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
