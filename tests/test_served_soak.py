"""The served path under sustained load: a real tritonserver on the CPU default deployment, 1,000 streamed
gRPC requests at concurrency 8, a fifth of them cancelled at random points (perf/soak.py, the same soak
the GPU scripts run). Every request must end with exactly one final response and no error, the server
must count every request as finished, and once idle no model may hold a request or a KV block.

Before the router and subservers talked over local sockets, the router's stub process crashed under this
soak after about 700 to 1,000 requests in the runs tried (it survived one run of 500): Triton 2.51 frees
decoupled BLS response tensors without the GIL. Hence 1,000 rather than 500."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from triton_harness import running_server, server_state, tiny_deployment

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from soak import run_soak  # noqa: E402


def _config(tmp: Path, tiny_dir: Path, policy: dict, thresholds: object) -> Path:
    batching = {"thresholds": thresholds, **({"auto_interval_s": 0.5} if thresholds == "auto" else {})}
    return tiny_deployment(tmp / "soak.yaml", tiny_dir, kv_cache_tokens=4096, policy=policy, batching=batching)


@pytest.mark.slow
def test_served_soak_with_cancellations(tiny_dir: Path, tmp_path: Path) -> None:
    # Random routing at 30 % gives many handoffs per request: the path that used to crash.
    config = _config(tmp_path, tiny_dir, {"name": "random", "p": 0.3, "seed": 0}, {"small": 2, "large": 2})
    with running_server(config, tmp_path) as server:
        result = run_soak(server.grpc_url, requests=1000, concurrency=8, cancel_fraction=0.2, max_tokens=24,
                          metrics_url=server.metrics_url, seed=1)
        assert server.proc.poll() is None, server_state(server)
        assert result.problems() == [], result
        assert result.cancelled >= 100 and result.completed >= 700


@pytest.mark.slow
def test_served_auto_thresholds_are_solved_and_exported(tiny_dir: Path, tmp_path: Path) -> None:
    """`thresholds: auto` in the Triton deployment: the subservers report their step statistics, the router
    solves the thresholds online and exports them with the predicted throughput."""
    from triton_harness import metrics

    config = _config(tmp_path, tiny_dir, {"name": "random", "p": 0.2, "seed": 0}, "auto")
    with running_server(config, tmp_path) as server:
        results: list = []
        load = threading.Thread(target=lambda: results.append(run_soak(
            server.grpc_url, requests=600, concurrency=8, cancel_fraction=0.0, max_tokens=32,
            metrics_url=server.metrics_url, seed=2)))
        load.start()
        # The solve runs in a child process every auto_interval_s while requests are in flight.
        tuned: dict = {}
        deadline = time.monotonic() + 120
        while load.is_alive() and not tuned and time.monotonic() < deadline:
            time.sleep(0.5)
            m = metrics(server)
            tuned = {k: v for k, v in m.items() if k.startswith("tokenrouter_tuned_threshold")}
        load.join()
        assert results and results[0].problems() == [], results
        assert set(tuned) == {f'tokenrouter_tuned_threshold{{model="{m}"}}' for m in ("small", "large")}
        assert all(v >= 1 for v in tuned.values())
        assert metrics(server)['tokenrouter_predicted_throughput{model="tokenrouter"}'] > 0
