#!/usr/bin/env python3
"""One non-streaming generation over HTTP: generate_stream with stream=false, reading its single response.

tritonclient.http's `infer` and Triton's `/generate` endpoint both refuse decoupled models such as
`tokenrouter`, so the non-streaming call goes through `/generate_stream` with `"stream": false`: the
model then sends exactly one event holding the whole text. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def error_text(raw: str) -> str:
    """The message in an error body: Triton sends `{"error": ...}` as JSON or as an SSE `data:` line."""
    for line in [raw, *raw.splitlines()]:
        line = line.strip().removeprefix("data:").strip()
        try:
            return str(json.loads(line)["error"])
        except (ValueError, KeyError, TypeError):
            continue
    return raw.strip()


def generate(url: str, model: str, body: dict) -> dict:
    """The single response object; raises SystemExit with the server's message on an error."""
    req = urllib.request.Request(
        f"{url}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req) as resp:
            raw = resp.read().decode()
    except urllib.error.HTTPError as e:
        raise SystemExit(f"HTTP {e.code}: {error_text(e.read().decode(errors='replace'))}") from None
    except urllib.error.URLError as e:  # (after HTTPError, its subclass) no connection: refused, unknown host
        raise SystemExit(f"cannot reach the server at {url}: {e.reason}") from None
    events = [json.loads(line[len("data:") :]) for line in raw.splitlines() if line.startswith("data:")]
    if not events:
        raise SystemExit(f"no response event in: {raw[:200]!r}")
    if "error" in events[-1]:
        raise SystemExit(f"error: {events[-1]['error']}")
    return events[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8000", help="Triton HTTP address")
    p.add_argument("--model", default="tokenrouter")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--include-prompt", action="store_true", help="let the model prepend the prompt to the text")
    args = p.parse_args(argv)

    base = args.url if "://" in args.url else f"http://{args.url}"
    body = {
        "text_input": args.prompt,
        "stream": False,
        "exclude_input_in_output": not args.include_prompt,
        "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature}),
        "return_finish_reason": True,
        "return_num_output_tokens": True,
        "return_routing_stats": True,
    }
    out = generate(base, args.model, body)
    print(out.get("text_output", ""))
    stats = out.get("routing_stats")
    print(
        f"[finish_reason={out.get('finish_reason')} tokens={out.get('num_output_tokens')} routing={stats}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
