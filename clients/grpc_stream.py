#!/usr/bin/env python3
"""Stream a completion over Triton's gRPC streaming API (tritonclient.grpc) and print the deltas.

With --cancel-after N the client cancels the stream after N text responses (about one token each);
Triton then cancels the request and the model aborts the generation.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

try:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
except ImportError as e:  # one line, not a traceback: the stdlib-only HTTP clients run with any Python
    sys.exit(f"this client needs tritonclient[grpc] ({e.name} is missing): run it with the project's "
             ".venv/bin/python, or pip install 'tritonclient[grpc]'")


def make_input(name: str, value: str | bool) -> grpcclient.InferInput:
    """A [1]-shaped input: strings as BYTES, booleans as BOOL."""
    if isinstance(value, str):
        arr, datatype = np.array([value.encode()], dtype=np.object_), "BYTES"
    else:
        arr, datatype = np.array([value], dtype=np.bool_), "BOOL"
    inp = grpcclient.InferInput(name, [1], datatype)
    inp.set_data_from_numpy(arr)
    return inp


def text_of(result: grpcclient.InferResult, name: str) -> str | None:
    arr = result.as_numpy(name)
    if arr is None:
        return None
    return "".join(x.decode() if isinstance(x, bytes) else str(x) for x in arr.reshape(-1))


def failure(url: str, error: InferenceServerException) -> str:
    """One line for a failed stream; an unreachable server (gRPC status UNAVAILABLE) is named as such."""
    if str(error.status()) == "StatusCode.UNAVAILABLE":
        return f"cannot reach the server at {url}: {error.message()}"
    return f"error: {error.message()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    p.add_argument("--model", default="tokenrouter")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--cancel-after", type=int, default=0, metavar="N", help="cancel after N text responses")
    args = p.parse_args(argv)

    inputs = [
        make_input("text_input", args.prompt),
        make_input("stream", True),
        make_input("sampling_parameters", json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature})),
        make_input("return_finish_reason", True),
        make_input("return_num_output_tokens", True),
        make_input("return_routing_stats", True),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=args.url)
    # The callback runs on tritonclient's reader thread; hand everything to the main thread.
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        # The model may end with a flags-only response; ask Triton to deliver it so we see the end.
        client.async_stream_infer(args.model, inputs, request_id="grpc-stream-demo", enable_empty_final_response=True)
    except InferenceServerException as e:
        # A stream that broke before the send (e.g. nothing listens at the URL) is refused with a generic
        # message; the cause reaches only the callback, which has run once stop_stream joined its thread.
        client.stop_stream()
        cause = responses.get_nowait()[1] if not responses.empty() else e
        print(failure(args.url, cause), file=sys.stderr)
        client.close()
        return 1

    rc, n_text, cancelled = 0, 0, False
    while True:
        result, error = responses.get()
        if error is not None:
            print(("\n" if n_text else "") + failure(args.url, error), file=sys.stderr)
            rc = 1
            break
        text = text_of(result, "text_output") or ""
        print(text, end="", flush=True)
        n_text += bool(text)
        if result.get_response().parameters["triton_final_response"].bool_param:
            print()
            print(
                f"[finish_reason={text_of(result, 'finish_reason')} tokens={text_of(result, 'num_output_tokens')} "
                f"routing={text_of(result, 'routing_stats')}]",
                file=sys.stderr,
            )
            break
        if args.cancel_after and n_text >= args.cancel_after:
            client.stop_stream(cancel_requests=True)  # cancels the RPC; the server aborts the request
            cancelled = True
            print(f"\n[cancelled after {n_text} responses]", file=sys.stderr)
            break
    if not cancelled:
        client.stop_stream()
    client.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
