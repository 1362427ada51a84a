"""Many long prompts into a KV pool that cannot hold them all at once, in process on the CPU: the wall time and the
preemptions of one `Engine.generate` over all of them, against the same prompts one after another. Run with the
tree under test first on PYTHONPATH:

    PYTHONPATH=backends python3 perf/results/kv_admission_cpu_2026-12-05/pressure.py [N] [PROMPT_TOKENS] [KV_TOKENS]

The deployment is the default one's trained pair (models/pair, R2R, CPU float32) with both pools at KV_TOKENS.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import tokenrouter
from tokenrouter import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[3]


def main(n: int = 16, prompt_tokens: int = 1500, kv_tokens: int = 16384, output: int = 64) -> None:
    pair = REPO / "models" / "pair"
    cfg = {
        "models": {m: {"path": str(pair / m), "dtype": "float32", "device": "cpu", "kv_cache_tokens": kv_tokens}
                   for m in ("small", "large")},
        "entry": "small",
        "policy": {"name": "r2r", "threshold": 0.7, "checkpoint": str(pair / "r2r_router.safetensors"),
                   "hidden_dim": 64},
        "batching": {"thresholds": {"small": 1, "large": 1}, "max_wait_ms": 5.0},
    }
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=output, temperature=0.0, ignore_eos=True)
    with Engine.from_config(cfg) as engine:
        vocab = engine.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(n)]
        engine.generate(prompts[:1], params)  # warm
        t0 = time.perf_counter()
        alone = [engine.generate([p], params)[0].token_ids for p in prompts[:2]]
        one = (time.perf_counter() - t0) / 2
        before = {name: sub.scheduler.num_preemptions for name, sub in engine.subservers.items()}
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        together = time.perf_counter() - t0
        preempted = {name: sub.scheduler.num_preemptions - before[name] for name, sub in engine.subservers.items()}
        assert [o.token_ids for o in outs[:2]] == alone, "outputs differ from one at a time"
        engine.check_integrity()
    print(f"{tokenrouter.__file__}: {n} prompts of {prompt_tokens} tokens, {output} out, pools of {kv_tokens} "
          f"tokens: together {together:.1f} s, one alone {one:.2f} s (x{n} = {one * n:.1f} s); "
          f"preemptions {preempted}")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))
