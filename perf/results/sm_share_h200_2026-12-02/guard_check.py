"""The non-finite guard under the fault it was built for: the 32B loaded as a subserver (warm-up on) in a process
limited to 80 % of the SMs under MPS must refuse with a clear error, not die on a device-side assert.
Run from the repository root on the GPU machine: python3 perf/results/sm_share_h200_2026-12-02/guard_check.py"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "backends"))


def child() -> None:
    from tokenrouter.config import load_config
    from tokenrouter.engine.subserver import Subserver
    from tokenrouter.tokenizer import load_tokenizer

    cfg = load_config(str(ROOT / "config/random/qwen3-0.6b_qwen3-32b.yaml"))
    try:
        sub = Subserver.from_config(cfg, "large", lambda e: None, load_tokenizer(cfg.tokenizer_path))
        print(f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '100')} %: ready, warm-up {sub.warmup_s:.1f} s")
    except Exception as e:
        print(f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '100')} %: refused: {type(e).__name__}: {e}")


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        child()
        sys.exit(0)
    from tokenrouter.serving import mps

    mps.start()
    try:
        for pct in ("80", "80", "100"):
            env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=pct)
            proc = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True,
                                  timeout=150)
            lines = [ln for ln in proc.stdout.splitlines() if " %: " in ln]
            print(lines[-1] if lines else f"{pct} %: exit {proc.returncode}: {proc.stderr.strip()[-400:]}", flush=True)
    finally:
        mps.stop()
