"""model_down: route_around with three models (the mixture policy over small, medium, large): the middle model
killed while it holds a request. Routing around was tested with two models only, where the one that goes down is
the last; here the entry model takes back what the medium model held while the large one stays in the routing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from triton_harness import (
    REPO,
    Streams,
    generate_stream,
    killed_while_holding,
    metrics,
    running_server,
    stubs_of,
    tiny_deployment,
    wait_metric,
)

sys.path.insert(0, str(REPO / "perf"))
from soak import wait_idle  # noqa: E402

MIXTURE = REPO / "config" / "mixture" / "tiny-small_tiny-medium_tiny-large.yaml"
N = 160


@pytest.mark.slow
def test_routing_around_the_middle_of_three_models(tiny_dir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "model_repository"
    config = tiny_deployment(tmp_path / "mixture.yaml", tiny_dir, MIXTURE, kv_cache_tokens=4096,
                             model_down="route_around")
    body = {"stream": True, "sampling_parameters": json.dumps({"max_tokens": N, "ignore_eos": True, "temperature": 0}),
            "return_finish_reason": True, "return_num_output_tokens": True, "return_routing_stats": True}

    def whole(prompt: str) -> dict[str, int]:
        """A request's tokens per model, once it ended normally with all its tokens and one final response."""
        status, events = generate_stream(server, {**body, "text_input": prompt}, timeout=120)
        assert status == 200 and not any("error" in e for e in events), events[-3:]
        finals = [e for e in events if "finish_reason" in e]
        assert len(finals) == 1 and finals[0] is events[-1], events[-3:]
        assert finals[0]["finish_reason"] == "length" and finals[0]["num_output_tokens"] == N, finals[0]
        return json.loads(finals[0]["routing_stats"])["tokens_per_model"]

    with running_server(config, tmp_path) as server:
        prompts = [f"def g{i}(y):" for i in range(6)]
        streams = Streams(whole, prompts)
        with killed_while_holding(server, repo, "medium") as medium:
            results = streams.join(180, "a stream hung after the medium model died")
            assert set(results) == set(prompts)
            down = metrics(server)
            assert down['tokenrouter_model_up{model="medium"}'] == 0.0
            assert down['tokenrouter_model_up{model="large"}'] == 1.0
            # Served meanwhile by the two models that are up: the large one stays in the routing.
            meanwhile = [whole(f"while it is down {i}") for i in range(3)]
            assert all("medium" not in m for m in meanwhile), meanwhile
            assert any(m.get("large", 0) > 0 for m in meanwhile), meanwhile
        assert wait_metric(server, 'tokenrouter_model_up{model="medium"}', 1.0, 180) == 1.0
        assert stubs_of(repo, "medium") != [medium]
        after = [whole(f"after it is back {i}") for i in range(3)]
        assert any(m.get("medium", 0) > 0 for m in after), after  # routed to again
        held = wait_idle(server.metrics_url)
        assert not any(held.values()), held  # every KV block and request released on all three models
        assert "goes on with it from its own KV" in (tmp_path / "tritonserver.log").read_text()  # one was taken back
