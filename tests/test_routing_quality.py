"""perf/routing_quality.py on the tiny models: the scores mean what they say at the ends of the cost axis
(always-large agrees with the large model everywhere, always-small writes no large tokens) and a policy in
between lands in between; the report files are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quality_against_cost_on_the_tiny_pair(tiny_dir: Path, tmp_path: Path) -> None:
    policies = [{"name": "always", "model": "small"}, {"name": "random", "p": 0.5, "seed": 0},
                {"name": "always", "model": "large"}]
    cmd = [sys.executable, str(REPO / "perf" / "routing_quality.py"), "--pair", str(tiny_dir), "--prompts", "4",
           "--prompt-len", "24", "--max-tokens", "12", "--out", str(tmp_path)]
    for p in policies:
        cmd += ["--policy", json.dumps(p)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    small, mixed, large = rows
    assert small["large_share"] == 0.0 and large["large_share"] == 1.0
    assert 0.0 < mixed["large_share"] < 1.0
    # The routed engine's greedy output is the large model's own when it writes everything (transformers
    # scores it): full agreement and prefix match.
    assert large["agreement"] == 1.0 and large["prefix_match"] == 1.0
    assert small["agreement"] <= mixed["agreement"] <= large["agreement"]
    assert large["loglik"] > small["loglik"]
    assert "| always | model=large | 100.0 % |" in (tmp_path / "results.md").read_text()
