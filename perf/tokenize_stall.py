"""How long prompts near the router's length bound hold back another client's stream.

A greedy gRPC stream runs; meanwhile `--big` clients each send one prompt just under the router's character bound
(the default CPU deployment: 4 x 4,096 x 49 = 802,816 characters), which the router tokenizes before refusing it for
its token count. Reported: the stream's inter-token gaps before and while the big prompts are handled.

    python perf/tokenize_stall.py --url 127.0.0.1:8001 --kind cjk --big 2
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

TEXTS = {"cjk": "漢" * 802_000, "ascii": "def f(a, b):\n    return a + b\n" * 26_700}


def _input(name: str, value: str | bool) -> grpcclient.InferInput:
    if isinstance(value, bool):
        x = grpcclient.InferInput(name, [1], "BOOL")
        x.set_data_from_numpy(np.array([value]))
    else:
        x = grpcclient.InferInput(name, [1], "BYTES")
        x.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return x


def _stream(url: str, model: str, arrivals: list[float], stop: threading.Event) -> None:
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
    params = json.dumps({"max_tokens": 4000, "ignore_eos": True, "temperature": 0})
    client.async_stream_infer(model, [_input("text_input", "def main():"), _input("stream", True),
                                      _input("sampling_parameters", params)], enable_empty_final_response=True)
    while True:
        result, error, at = responses.get()
        arrivals.append(at)
        final = error is None and result.get_response().parameters["triton_final_response"].bool_param
        if error is not None or final or stop.is_set():
            break
    client.stop_stream(cancel_requests=True)
    client.close()


def _big(url: str, model: str, text: str, replies: list[tuple[float, str]]) -> None:
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put(error))
    t0 = time.monotonic()
    client.async_stream_infer(model, [_input("text_input", text),
                                      _input("sampling_parameters", json.dumps({"max_tokens": 4}))])
    error = responses.get(timeout=300)
    replies.append((time.monotonic() - t0, str(error)[:100]))
    client.stop_stream()
    client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--model", default="tokenrouter")
    p.add_argument("--kind", choices=sorted(TEXTS), default="cjk")
    p.add_argument("--big", type=int, default=2, help="clients sending a prompt near the bound at once")
    args = p.parse_args()
    arrivals: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=_stream, args=(args.url, args.model, arrivals, stop))
    streamer.start()
    time.sleep(3)
    replies: list[tuple[float, str]] = []
    big_start = time.monotonic()
    bigs = [threading.Thread(target=_big, args=(args.url, args.model, TEXTS[args.kind], replies))
            for _ in range(args.big)]
    for t in bigs:
        t.start()
    for t in bigs:
        t.join()
    big_end = time.monotonic()
    time.sleep(1)
    stop.set()
    streamer.join()
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    before = sorted(g for g, at in gaps if at < big_start)
    during = sorted(g for g, at in gaps if big_start <= at <= big_end)
    for seconds, reply in sorted(replies):
        print(f"big prompt ({len(TEXTS[args.kind]):,} chars) answered after {seconds:.2f} s: {reply}")
    print(f"stream gaps before: max {before[-1]:.3f} s, median {before[len(before) // 2]:.3f} s ({len(before)})")
    if during:
        print(f"stream gaps during: max {during[-1]:.3f} s, median {during[len(during) // 2]:.3f} s ({len(during)})")
    else:
        print("stream gaps during: no token arrived while the big prompts were handled")


if __name__ == "__main__":
    main()
