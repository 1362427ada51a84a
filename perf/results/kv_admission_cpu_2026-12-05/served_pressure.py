"""Long prompts at once into a served deployment whose KV pools cannot hold them all (a new user's trial, served on
the CPU): N concurrent non-streaming HTTP requests of ~4,000 prompt tokens each, 90 tokens out; the wall time, each
request's finish, and the preemptions the server counted. From the repository root, with the tree under test the
one the venv's editable path points at (`ab.sh` switches it):

    python perf/results/kv_admission_cpu_2026-12-05/served_pressure.py N KV_TOKENS

The deployment is the served default (`config/r2r/pair-small_pair-large.yaml`) with both pools at KV_TOKENS.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "perf"))

from _common import serving  # noqa: E402


def prompt(i: int) -> str:
    """About 4,000 tokens of the pair's tokenizer (its own file per request: no shared prefix)."""
    return f"# file {i}\n" + "".join(f"v{i}_{j} = {j}\n" for j in range(440))


def metric(server, name: str) -> float:  # noqa: ANN001
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def deployment(work: Path, kv_tokens: int, large_kv_tokens: int | None = None) -> Path:
    """The served default with both pools at `kv_tokens` (the large model's at `large_kv_tokens` if given), written
    into `work`."""
    cfg = yaml.safe_load((REPO / "config/r2r/pair-small_pair-large.yaml").read_text())
    base = REPO / "config/r2r"
    for m in cfg["models"].values():
        m["path"] = str((base / m["path"]).resolve())
        m["kv_cache_tokens"] = kv_tokens
    if large_kv_tokens is not None:
        cfg["models"]["large"]["kv_cache_tokens"] = large_kv_tokens
    cfg["policy"]["checkpoint"] = str((base / cfg["policy"]["checkpoint"]).resolve())
    path = work / "deployment.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def finish_of(server, i: int) -> str:  # noqa: ANN001
    """Request `i` (its prompt, 90 tokens out, non-streaming HTTP generate): its finish reason, or the failure."""
    url = f"http://127.0.0.1:{server.http_port}/v2/models/tokenrouter/generate"
    body = {"text_input": prompt(i), "exclude_input_in_output": True, "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": 90, "ignore_eos": True, "temperature": 0})}
    req = urllib.request.Request(url, data=json.dumps(body).encode())
    try:
        return json.loads(urllib.request.urlopen(req, timeout=1800).read()).get("finish_reason")
    except Exception as e:  # noqa: BLE001 (reported, not raised: one failure is a finding)
        return f"{type(e).__name__}: {e}"[:120]


def main(n: int, kv_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        path = deployment(Path(work), kv_tokens)
        with serving(str(path), Path(work)) as server:
            results: list = [None] * n

            def run(i: int) -> None:
                results[i] = finish_of(server, i)

            before = metric(server, "tokenrouter_preemptions_total")
            t0 = time.perf_counter()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.perf_counter() - t0
            preempted = metric(server, "tokenrouter_preemptions_total") - before
            held = metric(server, "tokenrouter_kv_blocks_used")  # as the last response came
            deadline = time.monotonic() + 15.0  # (the gauge is refreshed now and then, not with every step)
            idle = held
            while idle and time.monotonic() < deadline:
                time.sleep(0.5)
                idle = metric(server, "tokenrouter_kv_blocks_used")
    import tokenrouter
    print(f"{tokenrouter.__file__}: {n} requests, pools of {kv_tokens} tokens: {took:.1f} s, "
          f"finishes {dict(Counter(map(str, results)))}, preemptions {preempted:.0f}, KV blocks in use as the last "
          f"response came {held:.0f}, once idle {idle:.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
