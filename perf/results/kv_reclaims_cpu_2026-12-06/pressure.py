"""Which KV is lost under pressure, served on the CPU: N concurrent non-streaming HTTP requests of ~4,000 prompt
tokens (../kv_admission_cpu_2026-12-05/served_pressure.py's prompts, 90 tokens out) into the served default with both
pools at KV_TOKENS; per model, the running requests preempted and the parked requests' KV taken back
(`tokenrouter_preemptions_total`, `tokenrouter_kv_reclaims_total`), sampled once a second. From the repository root,
with the tree under test the one the venv's editable path points at:

    python perf/results/kv_reclaims_cpu_2026-12-06/pressure.py N KV_TOKENS [LARGE_KV_TOKENS]

LARGE_KV_TOKENS: the large model's pool apart (by default KV_TOKENS too).
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "perf"))
sys.path.insert(0, str(REPO / "perf/results/kv_admission_cpu_2026-12-05"))

from _common import serving  # noqa: E402
from served_pressure import deployment, finish_of  # noqa: E402

COUNTERS = ("tokenrouter_preemptions_total", "tokenrouter_kv_reclaims_total", "tokenrouter_kv_blocks_used",
            "tokenrouter_requests_held")


def sample(server) -> dict[str, float]:  # noqa: ANN001
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'(\w+)\{model="(\w+)"\} (\S+)', line)
        if m and m[1] in COUNTERS:
            out[f"{m[1].removeprefix('tokenrouter_')}[{m[2]}]"] = float(m[3])
    return out


def main(n: int, kv_tokens: int, large_kv_tokens: int | None = None) -> None:
    with tempfile.TemporaryDirectory() as work:
        path = deployment(Path(work), kv_tokens, large_kv_tokens)
        with serving(str(path), Path(work)) as server:
            results: list = [None] * n
            ends = [0.0] * n  # when each response came (the wall time is the last; the sampling below is 1 s apart)

            def run(i: int) -> None:
                results[i] = finish_of(server, i)
                ends[i] = time.perf_counter()

            before = sample(server)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(1.0)
                now = sample(server)
                print(f"{time.perf_counter() - t0:6.1f} s " + " ".join(
                    f"{k}={v - before.get(k, 0) if 'total' in k else v:.0f}" for k, v in sorted(now.items())),
                    flush=True)
            took = max(ends) - t0
            time.sleep(1.0)
            after = sample(server)
    import tokenrouter
    print(f"{tokenrouter.__file__}: {n} requests, pools of {kv_tokens} tokens (large: {large_kv_tokens or kv_tokens}): "
          f"{took:.1f} s, "
          f"finishes {dict(Counter(map(str, results)))}; " + ", ".join(
              f"{k} {v - before.get(k, 0):.0f}" for k, v in sorted(after.items()) if "total" in k))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
