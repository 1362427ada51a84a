"""The evaluation suite (perf/evaluate.py) end to end on the tiny CPU models: every system of the main section
answers every request of every workload with exactly its output cap, routed systems route near the calibrated
share, and the ablation and the sweep produce their rows. A plumbing check: CPU figures mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCALE = 1 / 64  # caps 32 (low-effort), 16 (agentic); agentic context 128


def evaluate(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, str(REPO / "perf" / "evaluate.py"), *args, "--models", "tiny", "--scale", str(SCALE),
         "--out-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = args[0]
    assert (out / f"{section}.md").is_file()
    return json.loads((out / f"{section}.json").read_text())


@pytest.mark.slow
def test_main_section_every_system(tmp_path: Path) -> None:
    data = evaluate(tmp_path, "main", "--algorithms", "r2r", "--workloads", "low-effort,agentic",
                    "--concurrency", "2")
    assert not [n for n in data["notes"] if "failed" in n], data["notes"]
    cal = data["calibration"]["r2r"]
    # Sampled tokens (unseeded) make each trial's share noisy: the bisection's best lands near, not on, it.
    assert abs(cal["measured_share"] - cal["target_share"]) <= 0.3 * cal["target_share"], cal
    rows = {(r["workload"], r["system"]): r for r in data["rows"]}
    systems = {"in-process", "slm-only", "llm-only", "triton", "std-serving"}
    assert set(rows) == {(w, s) for w in ("low-effort", "agentic") for s in systems}
    caps = {w: data["workloads"][w]["output_cap"] for w in ("low-effort", "agentic")}
    for (workload, system), r in rows.items():
        assert r["errors"] == 0, (workload, system, r["first_error"])
        # Every request decodes exactly its cap (ignore_eos), whatever system serves it.
        assert r["output_tokens"] == r["requests"] * caps[workload], (workload, system, r)
        assert r["output_tok_s"] > 0
        share = r["large_share"]
        if system == "slm-only" or system == "llm-only":
            continue
        assert 0.0 < share < 0.6, (workload, system, share)  # routed: both models wrote tokens
    # agentic sessions: C sessions of 4 turns each
    assert rows[("agentic", "triton")]["requests"] == 2 * 4


@pytest.mark.slow
def test_ablation_and_sweep(tmp_path: Path) -> None:
    data = evaluate(tmp_path, "ablation", "--concurrency", "2")
    steps = [r["step"] for r in data["rows"]]
    assert steps == list(range(6))
    assert all(r["errors"] == 0 and r["output_tok_s"] > 0 for r in data["rows"]), data["rows"]
    assert data["rows"][0]["config"]["enforce_eager"] is True and data["rows"][-1]["config"]["thresholds"] == "auto"

    data = evaluate(tmp_path, "sweep", "--concurrency", "3", "--max-threshold", "2")
    vectors = {tuple(r["thresholds"].values()) for r in data["rows"]}
    # every feasible vector with B_i <= 2 at C=3: sum(B_i - 1) < 3
    assert {(1, 1), (1, 2), (2, 1), (2, 2)} <= vectors
    assert sum(r["auto"] for r in data["rows"]) == 1
    assert all(r["predicted_tok_s"] and r["measured_tok_s"] for r in data["rows"]), data["rows"]


def test_calibration_set_is_the_measured_prompts() -> None:
    """The threshold is calibrated on exactly the first turns `measure` sends at every point (with dummy
    weights the signal depends mostly on the prompt, so other prompts give another share)."""
    sys.path.insert(0, str(REPO / "perf"))
    from evaluation import calibrate, harness
    from evaluation.workloads import make_workload

    from tokenrouter.config import load_config

    cfg = load_config(REPO / "config" / "r2r" / "tiny-small_tiny-large.yaml")
    cal = harness.calibration_set(cfg, 5, ["low-effort", "agentic"], SCALE, [1, 4])
    vocab, special = harness.vocab_and_special(cfg)
    expected, tokens = [], []
    for name in ("low-effort", "agentic"):
        w = make_workload(name, SCALE)
        for c in (1, 4):
            firsts = [s.turns[0] for s in w.sessions(c, vocab, special, 5)]
            expected += firsts
            tokens += [min(w.max_tokens, calibrate.CALIBRATION_TOKENS)] * len(firsts)
    assert cal.prompts == expected and cal.tokens == tokens
    assert len(cal.prompts) == 4 + 8 + 1 + 4  # low-effort max(2C, 4) per point, agentic C sessions


def test_signal_spread() -> None:
    sys.path.insert(0, str(REPO / "perf"))
    import numpy as np
    from evaluation.calibrate import signal_spread

    per_prompt = [np.array([0.0, 2.0]), np.array([10.0, 10.0])]
    assert signal_spread(per_prompt) == {"between_prompts_std": 4.5, "within_prompt_std": 0.5}
