#!/usr/bin/env python3
"""Talk to `tokenrouter openai` with the official `openai` package: completions and chat, each
non-streaming and streaming. The `routing` extension field shows how tokens were split between models.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip())
    p.add_argument("--url", default="http://localhost:9000/v1", help="base URL of the OpenAI-compatible server")
    p.add_argument("--api-key", default=os.environ.get("TOKENROUTER_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="the key of a frontend started with --api-key (default: $TOKENROUTER_API_KEY, then "
                        "$OPENAI_API_KEY; none needed otherwise)")
    p.add_argument("--model", default="tokenrouter")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)

    try:
        from openai import APIConnectionError, APIStatusError, OpenAI
    except ImportError:
        print("this example needs the openai package: pip install openai", file=sys.stderr)
        return 1

    # The package insists on a key; a frontend started without --api-key checks none.
    client = OpenAI(base_url=args.url, api_key=args.api_key or "not-needed")
    try:
        demo(client, args)
    except APIConnectionError as e:
        # The package says only "Connection error." (after its retries); the exception it wraps says why.
        print(f"cannot reach the server at {args.url}: {e.__cause__ or e}", file=sys.stderr)
        return 1
    except APIStatusError as e:
        # `body` is the error object of the reply; its message alone, without the package's wrapping.
        message = e.body.get("message") if isinstance(e.body, dict) else None
        print(f"HTTP {e.status_code}: {message or e.message}", file=sys.stderr)
        return 1
    return 0


def demo(client: Any, args: argparse.Namespace) -> None:
    """Each call the server offers, printed as it comes."""
    common = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature}
    messages = [{"role": "user", "content": args.prompt}]

    print("== completions ==")
    c = client.completions.create(prompt=args.prompt, **common)
    print(c.choices[0].text)
    print(f"[{c.choices[0].finish_reason}, {c.usage}, routing={(c.model_extra or {}).get('routing')}]")

    print("== completions, streaming ==")
    for chunk in client.completions.create(prompt=args.prompt, stream=True, **common):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    print("== chat ==")
    r = client.chat.completions.create(messages=messages, **common)
    print(r.choices[0].message.content)
    print(f"[{r.choices[0].finish_reason}, {r.usage}]")

    print("== chat, streaming (with usage) ==")
    usage = None
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **common
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print(f"\n[{usage}]")


if __name__ == "__main__":
    sys.exit(main())
