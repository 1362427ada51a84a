"""End to end against a real tritonserver (CPU, tiny models): HTTP generate_stream and gRPC streaming give
the in-process Engine's greedy output for two policies; concurrency; cancellation frees KV on every model;
bad input gets a clear per-request error and the server keeps serving; metrics; perf_analyzer."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tokenrouter import Engine, SamplingParams
from tokenrouter.serving import triton_install
from triton_harness import generate_stream, metrics, running_server, stream_text, tiny_deployment

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def main():", "import numpy as np", "class Stack:", "for i in range(10):", "Hello, world"]
MAX_TOKENS = 16

POLICIES = {
    "r2r": REPO / "config" / "r2r" / "tiny-small_tiny-large.yaml",
    "random": REPO / "config" / "random" / "tiny-small_tiny-large.yaml",
}


def _deployment(tmp: Path, policy: str, tiny_dir: Path) -> Path:
    """The shipped tiny config, with the test's model folder and (for `random`) a higher routing rate."""
    top = {"policy": {"name": "random", "p": 0.3, "seed": 0}} if policy == "random" else {}
    return tiny_deployment(tmp / f"{policy}.yaml", tiny_dir, POLICIES[policy], kv_cache_tokens=4096, **top)


@pytest.fixture(scope="module", params=sorted(POLICIES))
def deployment(request, tiny_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"triton-{request.param}")
    config = _deployment(tmp, request.param, tiny_dir)
    with Engine.from_config(config) as engine:
        params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = dict(zip(PROMPTS, engine.generate(PROMPTS, params)))
    with running_server(config, tmp) as server:
        yield request.param, server, expected


def _body(prompt: str, stream: bool = True, **params) -> dict:
    sp = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **params}
    return {
        "text_input": prompt,
        "stream": stream,
        "sampling_parameters": json.dumps(sp),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_output_tokens": True,
        "return_routing_stats": True,
    }


def test_http_generate_stream_equals_engine(deployment) -> None:
    policy, server, expected = deployment
    routed = 0
    ids = set()
    for prompt in PROMPTS:
        status, events = generate_stream(server, _body(prompt))
        assert status == 200, events
        text = stream_text(events)
        final = events[-1]
        assert text == expected[prompt].text
        assert final["finish_reason"] == "length" and final["num_output_tokens"] == MAX_TOKENS
        stats = json.loads(final["routing_stats"])
        assert stats["tokens_per_model"] == expected[prompt].stats["tokens_per_model"]
        assert stats["first_token_model"] == expected[prompt].stats["first_token_model"] in stats["tokens_per_model"]
        routed += stats["handoffs"]
        assert stats["request_id"].startswith("tr-") and stats["request_id"] not in ids  # the server's own id
        ids.add(stats["request_id"])
    assert routed > 0, f"{policy}: nothing was routed, so the test proves nothing about handoffs"


def test_http_non_streaming_includes_prompt(deployment) -> None:
    _, server, expected = deployment
    body = _body(PROMPTS[0], stream=False)
    del body["exclude_input_in_output"]
    status, events = generate_stream(server, body)
    assert status == 200 and len(events) == 1
    assert events[0]["text_output"] == PROMPTS[0] + expected[PROMPTS[0]].text


def _grpc_stream(server, prompt: str, cancel_after: int | None = None, **params):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value, dtype in (
        ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([True]), "BOOL"),
        ("sampling_parameters", np.array([json.dumps(
            {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **params}).encode()],
            dtype=np.object_), "BYTES"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.async_stream_infer("tokenrouter", inputs, enable_empty_final_response=True)
    text, reason, n = "", None, 0
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        out = result.as_numpy("text_output")
        if out is not None:
            text += b"".join(out).decode()
            n += 1
        fr = result.as_numpy("finish_reason")
        if fr is not None:
            reason = fr[0].decode()
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        if cancel_after is not None and n >= cancel_after:
            client.stop_stream(cancel_requests=True)
            client.close()
            return text, "cancelled"
    client.stop_stream()
    client.close()
    return text, reason


def test_grpc_stream_equals_engine(deployment) -> None:
    _, server, expected = deployment
    for prompt in PROMPTS[:3]:
        text, reason = _grpc_stream(server, prompt)
        assert text == expected[prompt].text and reason == "length"


def test_sixteen_concurrent_streams(deployment) -> None:
    _, server, expected = deployment
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    results: list = [None] * 16

    def run(i: int) -> None:
        results[i] = generate_stream(server, _body(prompts[i]), timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, (status, events) in zip(prompts, results):
        assert status == 200
        assert stream_text(events) == expected[prompt].text
        assert events[-1]["finish_reason"] == "length"


def _wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        held = [v for k, v in m.items() if k.startswith(("tokenrouter_kv_blocks_used", "tokenrouter_requests_held"))]
        if all(v == 0 for v in held) or time.monotonic() > deadline:
            return m
        time.sleep(0.3)


def test_cancel_frees_kv_everywhere_then_serves(deployment) -> None:
    _, server, expected = deployment
    text, reason = _grpc_stream(server, "while True:", cancel_after=5, max_tokens=400)
    assert reason == "cancelled"
    m = _wait_idle(server)
    for model in ("small", "large"):
        assert m[f'tokenrouter_kv_blocks_used{{model="{model}"}}'] == 0
        assert m[f'tokenrouter_requests_held{{model="{model}"}}'] == 0
    status, events = generate_stream(server, _body(PROMPTS[1]))
    assert status == 200 and stream_text(events) == expected[PROMPTS[1]].text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stream": True, "sampling_parameters": "{}"}, "text_input"),
        ({"text_input": "hi", "sampling_parameters": "{not json"}, "not valid JSON"),
        ({"text_input": "hi", "sampling_parameters": '{"max_tokens": -3}'}, "max_tokens"),
        ({"text_input": "hi", "sampling_parameters": '{"beam_width": 2}'}, "beam_width"),
        ({"text_input": "x " * 5000, "sampling_parameters": "{}"}, "context limit"),
    ],
    ids=["missing-text_input", "malformed-json", "negative-max_tokens", "unknown-parameter", "too-long"],
)
def test_bad_input_gets_clear_error_and_server_keeps_serving(deployment, body: dict, message: str) -> None:
    _, server, expected = deployment
    refused = 'tokenrouter_requests_finished_total{finish_reason="refused",model="tokenrouter"}'
    before = metrics(server).get(refused, 0)
    status, events = generate_stream(server, body)
    error = json.dumps(events)
    assert status >= 400 or "error" in events[-1], events
    assert message in error
    assert metrics(server).get(refused, 0) == before + 1  # every request the router answered is accounted for
    status, events = generate_stream(server, _body(PROMPTS[2]))
    assert status == 200 and stream_text(events) == expected[PROMPTS[2]].text


def test_metrics_after_routed_requests(deployment) -> None:
    _, server, _ = deployment
    generate_stream(server, _body(PROMPTS[0]))
    m = _wait_idle(server)
    for model in ("small", "large"):
        assert m[f'tokenrouter_tokens_total{{model="{model}"}}'] > 0
        assert m[f'tokenrouter_steps_total{{model="{model}"}}'] > 0
        assert m[f'tokenrouter_queue_wait_seconds_count{{model="{model}"}}'] > 0
        assert m[f'tokenrouter_kv_blocks_total{{model="{model}"}}'] > 0
        assert m[f'tokenrouter_preemptions_total{{model="{model}"}}'] >= 0  # exported (KeyError if not)
        assert m[f'tokenrouter_kv_reclaims_total{{model="{model}"}}'] >= 0
        assert m[f'tokenrouter_graph_waits_total{{model="{model}"}}'] == 0  # no CUDA graphs on the CPU
        assert m[f'tokenrouter_ahead_void_rows_total{{model="{model}"}}'] >= 0
    assert m['tokenrouter_handoffs_total{from="small",to="large"}'] > 0
    # The large model told the router its pool (its first heartbeat): new requests are admitted against it.
    assert m['tokenrouter_kv_budget_tokens{model="tokenrouter"}'] == 4096  # (kv_cache_tokens, every model)
    assert m['tokenrouter_time_to_first_token_seconds_count{model="tokenrouter"}'] > 0
    assert m['tokenrouter_inter_token_latency_seconds_count{model="tokenrouter"}'] > 0
    assert any(k.startswith("tokenrouter_batch_size") for k in m)


def test_perf_analyzer_streaming_writes_csv(deployment, tmp_path: Path) -> None:
    policy, server, _ = deployment
    if policy != "r2r":
        pytest.skip("one perf_analyzer run is enough")
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{
        "text_input": ["def main():"], "stream": [True],
        "sampling_parameters": [json.dumps({"max_tokens": 8, "temperature": 0, "ignore_eos": True})],
    }]}))
    csv = tmp_path / "perf.csv"
    cmd = [
        str(triton_install.perf_analyzer_path()), "-m", "tokenrouter", "-u", f"127.0.0.1:{server.grpc_port}",
        "-i", "grpc", "--streaming", "--input-data", str(data), "--concurrency-range", "2",
        "--measurement-mode", "count_windows", "--measurement-request-count", "8", "--stability-percentage", "100",
        "--max-trials", "4", "-f", str(csv),
    ]
    env = triton_install.perf_analyzer_env(tmp_path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("Concurrency") and len(lines) >= 2


@pytest.fixture(scope="module")
def openai_url(deployment, tiny_dir: Path):
    from tokenrouter.serving.openai import build_server

    _, server, _ = deployment
    http = build_server(f"127.0.0.1:{server.grpc_port}", "127.0.0.1", 0, str(tiny_dir / "tokenizer"))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def _post(url: str, body: dict) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_openai_completions_equal_engine(deployment, openai_url: str) -> None:
    _, _, expected = deployment
    prompt = PROMPTS[3]
    body = {"model": "tokenrouter", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, text = _post(f"{openai_url}/v1/completions", body)
    assert status == 200, text
    reply = json.loads(text)
    assert reply["choices"][0]["text"] == expected[prompt].text
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    # Streaming: the chunks add up to the same text.
    status, sse = _post(f"{openai_url}/v1/completions", {**body, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ") and "[DONE]" not in line]
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == reply["choices"][0]["text"]
    assert sse.rstrip().endswith("data: [DONE]")


def test_openai_chat_models_health_and_errors(openai_url: str) -> None:
    status, text = _post(f"{openai_url}/v1/chat/completions", {
        "model": "tokenrouter", "messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 8})
    assert status == 200, text
    reply = json.loads(text)
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["prompt_tokens"] > 0
    import urllib.request

    with urllib.request.urlopen(f"{openai_url}/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tokenrouter"
    with urllib.request.urlopen(f"{openai_url}/health", timeout=10) as r:
        assert r.status == 200
    status, text = _post(f"{openai_url}/v1/completions", {"model": "tokenrouter", "max_tokens": 4})
    assert status == 400 and "prompt" in json.loads(text)["error"]["message"]


def test_serve_command_end_to_end(tmp_path: Path) -> None:
    """The README's serve command (`tokenrouter serve`, the default deployment: the trained pair with its
    trained router) answers with the in-process engine's greedy text, then stops on SIGINT."""
    import signal
    import sys

    from tokenrouter.serving.server import DEFAULT_CONFIG, TritonServer
    from triton_harness import free_ports

    with Engine.from_config(DEFAULT_CONFIG) as engine:
        params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = engine.generate(["def main():"], params)[0].text

    http, grpc, metrics_port = free_ports(3)
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics_port), "--model-repository", str(tmp_path / "repo")]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    probe = TritonServer(tmp_path / "repo", http, grpc, metrics_port)
    try:
        deadline = time.monotonic() + 240
        while not probe.ready():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.5)
        status, events = generate_stream(probe, _body("def main():"))
        assert status == 200 and events[-1]["finish_reason"] == "length"
        assert stream_text(events) == expected
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        log.close()
