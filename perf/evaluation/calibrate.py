"""Each algorithm's threshold, calibrated to a stated large-model token share.

With dummy weights a learned router is arbitrary, so "R2R at threshold 0.5" says nothing about how many
tokens reach the large model. Each policy therefore runs its real code path (its router network or
entropy, computed inside the step as in serving), and its threshold is set so that a stated share of the
tokens comes from the large model. The signal is measured by a probe deployment of the model that decides
(std_serving/probe_policy.py: the policy's own `step_tensors`, recorded per token), and the threshold's
quantile level is then bisected on routed generations of the deployment itself.

Calibration runs on the prompts the section will measure (every point's first turns, `CalibrationSet`):
with dummy weights the signal is dominated by the prompt, not the token (on Qwen3-0.6B's shape, R2R's
router value varied 0.47 (std) between prompts and 0.03-0.07 within one prompt's tokens), so a threshold
set on other prompts routes a different share of these (measured on the H200: calibrated to 9.9 % on 16
other prompts, then 0-4 % measured). The spread is kept in the results (`signal_spread`): where the
between-prompt spread dominates, the policy routes per request more than per token, and each row's own
measured share says how far its point is from the target. `random` (p = R2R's share, independent per
token) is the token-scattered pattern for comparison.

Shares (large-model tokens / all output tokens):
- r2r 10 %: R2R reports 5.6B average activated parameters for R1-1.5B + R1-32B (arXiv 2505.21600, which
  works out to ~13 % of tokens on the 32B) and finds 11 % of tokens differ between the models, 5 %
  diverge; issue 11 sets ~10 % for this comparison.
- citer 15 %, collm 15 %, rstitch 20 %: assumed. CITER and Co-LLM report cost or accuracy at a
  threshold they sweep, and R-Stitch reports speed-ups, not a token share in the summaries reachable here;
  these shares put each policy between R2R's and the mixture's large share.
- mixture (ME): no calibration, the weights 0.5 / 0.3 / 0.2 fix it (20 % on the 32B, 30 % on the 8B).
- random 10 %: no calibration, p = 0.10 is the share (each small-model token hands over independently).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluation.workloads import SAMPLING
from tokenrouter.config import EngineConfig

TARGETS: dict[str, tuple[float, str]] = {
    "r2r": (0.10, "R2R (arXiv 2505.21600): 5.6B average activated of 1.5B + 32B, ~13 %; issue 11 sets ~10 %"),
    "citer": (0.15, "assumed: CITER reports cost at swept thresholds, no token share found here"),
    "collm": (0.15, "assumed: Co-LLM sweeps its deferral threshold, no token share found here"),
    "rstitch": (0.20, "assumed: R-Stitch reports speed-ups, no token share found here"),
    "mixture": (0.20, "fixed by the weights 0.5 / 0.3 / 0.2 (ME): 20 % on the largest model"),
    "random": (0.10, "R2R's share, p = 0.10 per small-model token (independent per token: no calibration)"),
}
FIXED = ("mixture", "random")
# R-Stitch's large model keeps decoding until its own entropy falls below tau_low: a fraction RSTITCH_RETURN
# of its tokens end its stint (geometric stints, mean 1 / RSTITCH_RETURN = 4 tokens).
RSTITCH_RETURN = 0.25
CALIBRATION_TOKENS = 256  # per prompt at most (the workload's cap when smaller)
CALIBRATION_STEPS = 8  # trials on the quantile level (at most)
FIRST_STEP = 0.05  # the first move in quantile level away from the first guess
SHARE_TOLERANCE = 0.1  # stop within 10 % of the target share (relative)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


@dataclass
class CalibrationSet:
    """The prompts a threshold is calibrated on, and how many tokens each generates."""

    prompts: list[list[int]]
    tokens: list[int]
    description: str


def probe_values(cfg: EngineConfig, model: str, cal: CalibrationSet) -> list[np.ndarray]:
    """The policy's per-token signal on `model`, one array per prompt: a single-model engine with the probe
    policy generates each prompt's tokens (sampled as measured) and records the signal of every token."""
    from std_serving.probe_policy import ProbePolicy  # noqa: F401  (registers `probe`)

    from tokenrouter import Engine

    single = dataclasses.replace(
        cfg,
        models={model: cfg.models[model]},
        entry=model,
        policy={"name": "probe", "inner": dict(cfg.policy), "models": list(cfg.models)},
        batching=dataclasses.replace(cfg.batching, thresholds=1),
        tokenizer=cfg.tokenizer or cfg.entry_model.path,
    )
    engine = Engine(single)
    try:
        outs = engine.generate(cal.prompts, _params(cal))
        rows = [[r[0] for r in engine.entry.policy.take(o.request_id)] for o in outs]
    finally:
        engine.shutdown()
        del engine
        _free_gpu()
    return [np.array(r, dtype=np.float64) for r in rows]


def _params(cal: CalibrationSet) -> list[Any]:
    from tokenrouter import SamplingParams

    return [SamplingParams(max_new_tokens=n, ignore_eos=True, **SAMPLING) for n in cal.tokens]


def signal_spread(per_prompt: list[np.ndarray]) -> dict[str, float]:
    """How much of the signal's variation is between prompts (std of the per-prompt means) and how much is
    within one prompt's tokens (mean of the per-prompt stds)."""
    rows = [v for v in per_prompt if len(v)]
    return {
        "between_prompts_std": float(np.std([v.mean() for v in rows])),
        "within_prompt_std": float(np.mean([v.std() for v in rows])),
    }


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rstitch_entry_rate(share: float, back: float = RSTITCH_RETURN) -> float:
    """The fraction q of small-model steps that must hand over so that the large model writes `share`
    of the tokens, when each stint there lasts 1 / `back` tokens on average: every small step commits a
    token (1 - q) or hands over (q, its token dropped), so share = (q / back) / ((1 - q) + q / back)."""
    return share * back / (share * back + 1.0 - share)


@dataclass
class Probe:
    """The deciding model's signal on the calibration set (per prompt), and R-Stitch's tau_low."""

    per_prompt: list[np.ndarray]
    tau_low: float | None = None


def probe(algorithm: str, cfg: EngineConfig, cal: CalibrationSet) -> Probe | None:
    """The signals `calibrate` starts from, measured on single-model engines: run it before the routed
    deployment is loaded (a second copy of the large model does not fit beside it). None for FIXED."""
    if algorithm in FIXED:
        return None
    names = list(cfg.models)
    tau_low = None
    if algorithm == "rstitch":
        tau_low = float(np.quantile(np.concatenate(probe_values(cfg, names[-1], cal)), RSTITCH_RETURN))
    return Probe(probe_values(cfg, names[0], cal), tau_low)


def calibrate(algorithm: str, cfg: EngineConfig, cal: CalibrationSet, engine: Any, probed: Probe | None
              ) -> dict[str, Any]:
    """The policy mapping for `algorithm` at its target share, and how it was found.

    First guess: the quantile of the deciding model's signal on its own generations (`probed`). That guess
    is off once routing changes the context (the large model's tokens move the small model off its own
    path), so the quantile level is then bisected on routed generations of the real deployment (`engine`,
    an in-process Engine of `cfg`) until the measured share is the target."""
    share, source = TARGETS[algorithm]
    policy = dict(cfg.policy)
    record: dict[str, Any] = {"target_share": share, "source": source, "calibration_set": cal.description}
    if algorithm in FIXED:
        if algorithm == "random":
            policy["p"] = share
        record["params"] = {k: v for k, v in policy.items() if k != "name"}
        return {"policy": policy, "record": record}
    if probed is None:
        raise ValueError(f"calibrating {algorithm!r} needs its probe (calibrate.probe)")
    signal = np.concatenate(probed.per_prompt)
    if not len(signal):
        raise ValueError(f"calibrating {algorithm!r}: the probe recorded no signal (no token was generated)")
    record["signal_spread"] = signal_spread(probed.per_prompt)
    if algorithm == "rstitch":
        policy["tau_low"] = probed.tau_low
        first = 1.0 - rstitch_entry_rate(share)
    elif algorithm in ("r2r", "collm", "citer"):
        first = share if algorithm == "citer" else 1.0 - share
    else:
        raise SystemExit(f"error: no calibration rule for {algorithm!r}")

    def at(level: float) -> dict[str, Any]:
        value = float(np.quantile(signal, min(1.0, max(0.0, level))))
        key = "tau_high" if algorithm == "rstitch" else "threshold"
        # r2r routes when sigmoid(z) >= t, collm when > t, citer when < t: the quantile maps to t via sigmoid.
        return {**policy, key: value if algorithm == "rstitch" else _sigmoid(value)}

    # Routing more means a lower threshold quantile for r2r / collm / rstitch, a higher one for citer. From
    # the first guess, steps of FIRST_STEP in quantile level, doubling, until the target is bracketed; then
    # bisection. (Bisecting [0, 1] from the start jumped from 0.9 to 0.45 after one miss: 55-60 % routed.)
    more = 1.0 if algorithm == "citer" else -1.0
    lo, hi, found_lo, found_hi = 0.0, 1.0, False, False
    level, step, trials = first, FIRST_STEP, []
    for _ in range(CALIBRATION_STEPS):
        measured = routed_share(engine, at(level), cal)
        trials.append({"quantile": level, "share": round(measured, 4)})
        if abs(measured - share) <= SHARE_TOLERANCE * share:
            break
        # Too little routed: the target lies towards routing more.
        up = (measured < share) == (more > 0)
        if up:
            lo, found_lo = level, True
        else:
            hi, found_hi = level, True
        if found_lo and found_hi:
            level = (lo + hi) / 2
        else:
            level = min(hi, max(lo, level + (step if up else -step)))
            step *= 2
    best = min(trials, key=lambda t: abs(t["share"] - share))
    policy = at(best["quantile"])
    # Sampled tokens make every trial's share noisy: a best trial outside the tolerance is said so.
    record["converged"] = abs(best["share"] - share) <= SHARE_TOLERANCE * share
    small = list(cfg.models)[0]
    record["signal"] = f"{algorithm} signal on {small}: {len(signal)} tokens of {len(cal.prompts)} probe generations"
    record["trials"] = trials
    record["measured_share"] = best["share"]
    record["params"] = {k: v for k, v in policy.items() if k != "name"}
    return {"policy": policy, "record": record}


def apply(engine: Any, policy: dict[str, Any]) -> None:
    """Set `policy`'s thresholds on every subserver's policy object of a running engine."""
    for sub in engine.subservers.values():
        for key in ("threshold", "tau_high", "tau_low", "p"):
            if key in policy and hasattr(sub.policy, key):
                setattr(sub.policy, key, float(policy[key]))


def routed_share(engine: Any, policy: dict[str, Any], cal: CalibrationSet) -> float:
    """Large-model token share of routed generations of `cal` with `policy`'s thresholds set on every
    subserver's policy (the only change between trials: no model reloads)."""
    apply(engine, policy)
    outs = engine.generate(cal.prompts, _params(cal))
    large = list(engine.subservers)[-1]
    total = sum(len(o.token_ids) for o in outs)
    return sum(o.stats["tokens_per_model"].get(large, 0) for o in outs) / max(1, total)
