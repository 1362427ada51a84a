"""Requests that together outgrow both KV pools, in process with a loop per model (as served): N greedy requests
with max_new_tokens 5000 and ignore_eos on the tiny co-LLM pair, both pools KV_TOKENS; every 5 s the tokens each
request has, its finish, and each model's KV reclaims and preemptions. From the repository root, with the tree under
test on the path:

    PYTHONPATH=TREE/backends python perf/results/kv_age_order_2026-12-06/pressure_in_process.py N KV_TOKENS SECONDS
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import yaml

from tokenrouter import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[3]


def main(n: int, kv_tokens: int, limit_s: float) -> None:
    cfg = yaml.safe_load((REPO / "config/collm/tiny-small_tiny-large.yaml").read_text())
    for m in cfg["models"].values():
        m["path"] = str((REPO / "config/collm" / m["path"]).resolve())
        m["kv_cache_tokens"] = kv_tokens
    engine = Engine.from_config(cfg)
    engine.start()
    params = SamplingParams(max_new_tokens=5000, temperature=0.0, ignore_eos=True)
    counts, done = [0] * n, [None] * n
    t0 = time.time()

    def run(i: int) -> None:
        async def go() -> None:
            async for out in engine.generate_stream([3 + i, 7, 9, 11 + i], params):
                counts[i] = len(out.token_ids)
                if out.finished:
                    done[i] = (round(time.time() - t0, 1), out.finish_reason)
        asyncio.run(go())

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    while time.time() - t0 < limit_s and any(t.is_alive() for t in threads):
        time.sleep(5)
        subs = engine.subservers.values()
        print(f"{time.time() - t0:5.1f} s tokens {counts} finished {done} reclaims "
              f"{[s.scheduler.num_reclaims for s in subs]} preemptions {[s.scheduler.num_preemptions for s in subs]}",
              flush=True)
    os._exit(0)  # (requests may still run: no orderly shutdown wait)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
