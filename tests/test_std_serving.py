"""Std. Serving (perf/std_serving) against a real tritonserver (CPU, tiny models): the dispatcher over plain
single-model servers writes the in-process routed Engine's greedy output with the same routing (a learned
router, a lease-until-route policy, a 3-model policy); bad input fails that request alone; afterwards the
servers' engines hold no requests and no KV blocks."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tokenrouter import Engine, SamplingParams, load_config
from triton_harness import metrics, tiny_deployment

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))
from std_serving.dispatcher import StdClient  # noqa: E402
from std_serving.repository import serving_std, std_name  # noqa: E402

CONFIGS = {
    "r2r": REPO / "config" / "r2r" / "tiny-small_tiny-large.yaml",
    "rstitch": REPO / "config" / "rstitch" / "tiny-small_tiny-large.yaml",
    "mixture": REPO / "config" / "mixture" / "tiny-small_tiny-medium_tiny-large.yaml",
}
MAX_TOKENS = 24
VOCAB = 1024  # the tiny models'
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 30)]


def _deployment(tmp: Path, name: str, tiny_dir: Path) -> Path:
    return tiny_deployment(tmp / f"{name}.yaml", tiny_dir, CONFIGS[name], kv_cache_tokens=4096)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def deployment(request, tiny_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"std-{request.param}")
    path = _deployment(tmp, request.param, tiny_dir)
    cfg = load_config(path)
    with Engine.from_config(cfg) as engine:
        params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = engine.generate(PROMPTS, params)
    with serving_std(path, tmp) as server:
        yield request.param, cfg, server, expected


def _generate_all(server, cfg) -> list[dict]:
    """Every prompt at once, one client (and gRPC stream) per thread, as a benchmark drives it."""
    results: list = [None] * len(PROMPTS)

    def run(i: int) -> None:
        client = StdClient(server.grpc_url, cfg)
        try:
            results[i] = client.generate(PROMPTS[i], MAX_TOKENS)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_outputs_and_routing_equal_engine(deployment) -> None:
    name, cfg, server, expected = deployment
    last = list(cfg.models)[-1]
    handoffs = 0
    for prompt, got, want in zip(PROMPTS, _generate_all(server, cfg), expected):
        assert "error" not in got, got
        assert got["output_ids"] == want.token_ids, f"{name}: prompt of {len(prompt)} tokens"
        assert got["tokens"] == MAX_TOKENS
        assert got["large_tokens"] == want.stats["tokens_per_model"].get(last, 0)
        assert got["handoffs"] == want.stats["handoffs"]
        assert 0 <= got["ttft"] <= got["e2e"] and got["end"] - got["start"] == pytest.approx(got["e2e"])
        handoffs += got["handoffs"]
    assert handoffs > 0, f"{name}: nothing was routed, so the test proves nothing about routing"


def _raw(server, model: str, input_ids: np.ndarray) -> tuple[object, object]:
    """One call straight to a std model on its own stream: (result, error)."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        t = grpcclient.InferInput("input_ids", list(input_ids.shape), "INT32")
        t.set_data_from_numpy(input_ids)
        client.async_stream_infer(model, [t])
        return answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()


def test_bad_request_fails_alone(deployment) -> None:
    name, cfg, server, expected = deployment
    entry = std_name(cfg.entry)
    _, error = _raw(server, entry, np.array([5, VOCAB + 7], dtype=np.int32))
    assert error is not None and "vocabulary" in str(error)
    _, error = _raw(server, entry, np.array([], dtype=np.int32))
    assert error is not None and "empty" in str(error)
    # The server answers the next call; the dispatcher reports a refused request as an error, not a crash.
    result, error = _raw(server, entry, np.array(PROMPTS[0], dtype=np.int32))
    assert error is None and result.as_numpy("output_ids").shape == (1,)
    assert result.as_numpy("finish_reason")[0] == b"length"
    client = StdClient(server.grpc_url, cfg)
    try:
        assert "error" in client.generate([], MAX_TOKENS)
        got = client.generate(PROMPTS[1], MAX_TOKENS)
    finally:
        client.close()
    assert got.get("output_ids") == expected[1].token_ids


def test_servers_idle_after_requests(deployment) -> None:
    name, cfg, server, expected = deployment
    client = StdClient(server.grpc_url, cfg)
    try:  # some traffic of its own, so the test stands alone
        assert client.generate(PROMPTS[2], MAX_TOKENS).get("output_ids") == expected[2].token_ids
    finally:
        client.close()
    names = [std_name(m) for m in cfg.models]
    deadline = time.monotonic() + 10
    while True:  # the gauges are refreshed every 0.25 s, off the decoding loop
        m = metrics(server)
        held = {k: v for k, v in m.items() if k.startswith(("tokenrouter_requests_held", "tokenrouter_kv_blocks_used"))}
        if held and all(v == 0 for v in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    # The update thread that sets these gauges runs: it counted the entry model's steps.
    assert m[f'tokenrouter_steps_total{{model="{std_name(cfg.entry)}"}}'] > 0
    for model in names:
        assert m[f'tokenrouter_requests_held{{model="{model}"}}'] == 0
        assert m[f'tokenrouter_kv_blocks_used{{model="{model}"}}'] == 0
