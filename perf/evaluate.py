"""TokenRouter's evaluation, reproducible on one GPU: routed serving against Std. Serving and single models.

    # one H200, quick scale (caps / 16), R2R on every system at C = 1..16, low-effort workload
    python perf/evaluate.py main --models qwen3 --scale 0.0625 --algorithms r2r --workloads low-effort
    # the same suite on the tiny CPU models (plumbing: figures mean nothing)
    python perf/evaluate.py main --models tiny --scale 0.03125 --concurrency 1,4

Sections (one call each; each writes `<section>.json` + `.md` (+ plots) under --out-dir as it goes, so a
run cut short keeps what it measured):
- main: workloads (evaluation/workloads.py) x algorithms (calibrated, evaluation/calibrate.py) x systems
  (evaluation/systems.py) x concurrency; throughput, per-user tok/s, TTFT, end-to-end latency.
- ablation: R2R at one concurrency, in process, switching the engine's optimizations on one by one.
- sweep: R2R at C = 8 and 16, in process, every feasible threshold vector measured next to the Markov
  model's prediction, and where `auto` lands.
perf/README.md explains the figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, parse_concurrency  # noqa: E402
from evaluation import deployments, sections, systems  # noqa: E402
from evaluation.workloads import SHAPES  # noqa: E402

DEFAULT_CONCURRENCY = {"main": "1,2,4,8,16", "ablation": "8", "sweep": "8,16"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("section", choices=["main", "ablation", "sweep"])
    p.add_argument("--models", choices=sorted(deployments.MODEL_SETS), default="qwen3",
                   help="qwen3: Qwen3-0.6B/8B/32B dummy weights on the GPU; tiny: the CPU test models")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink output caps and the agentic context by this factor (0, 1]; requests per point stay "
                        "max(2C, 4) (single-turn) or C sessions (agentic)")
    p.add_argument("--algorithms", default="r2r,citer,rstitch,collm,mixture,random")
    p.add_argument("--workloads", default=",".join(SHAPES))
    p.add_argument("--systems", default=",".join(systems.SYSTEMS))
    p.add_argument("--concurrency", help="comma-separated; default: main 1,2,4,8,16, ablation 8, sweep 8,16")
    p.add_argument("--max-threshold", type=int, default=4, help="sweep: the largest B_i measured (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--execution-env", type=Path,
                   help="Python environment (venv) for the servers' model stubs, e.g. `tokenrouter stub-env`'s")
    p.add_argument("--out-dir", help="default: perf/results/eval_<models>_scale<scale>")
    p.add_argument("--note", action="append", default=[], help="a line for the results' notes (repeatable)")
    args = p.parse_args(argv)
    args.concurrency = parse_concurrency(p, args.concurrency or DEFAULT_CONCURRENCY[args.section])
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in systems.SYSTEMS:
            p.error(f"unknown system {s!r}; known: {', '.join(systems.SYSTEMS)}")
    for a in args.algorithms:  # before any model loads: a typo must not cost a calibration first
        if a not in deployments.ALGORITHMS:
            p.error(f"unknown algorithm {a!r}; known: {', '.join(deployments.ALGORITHMS)}")
    for w in args.workloads:
        if w not in SHAPES:
            p.error(f"unknown workload {w!r}; known: {', '.join(SHAPES)}")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale:g}")
    if args.max_threshold < 1:
        p.error(f"--max-threshold must be >= 1, got {args.max_threshold}")
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR / f"eval_{args.models}_scale{args.scale:g}"
    try:  # the results are written after every point: a folder that cannot be written must fail now
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        p.error(f"--out-dir {out_dir}: cannot write there ({e.strerror or e})")
    with tempfile.TemporaryDirectory(prefix="evaluate-") as work:
        getattr(sections, f"run_{args.section}")(args, out_dir, Path(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
