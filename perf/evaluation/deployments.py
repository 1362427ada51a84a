"""Which deployment YAML each algorithm runs, and that deployment with a calibrated policy written out.

Every algorithm uses the repository's own config (config/<algorithm>/<models>.yaml): Qwen3-0.6B + 32B with
dummy weights on the GPU (the mixture: 0.6B / 8B / 32B), or the tiny CPU models for a plumbing run. The
suite only replaces the `policy:` section (calibrated thresholds) and, for the ablation, named switches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tokenrouter.config import read_config_file

REPO_ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ("r2r", "citer", "rstitch", "collm", "mixture", "random")
MODEL_SETS = {
    "qwen3": ("qwen3-0.6b_qwen3-32b", "qwen3-0.6b_qwen3-8b_qwen3-32b"),
    "tiny": ("tiny-small_tiny-large", "tiny-small_tiny-medium_tiny-large"),
}


def config_path(algorithm: str, models: str) -> Path:
    if algorithm not in ALGORITHMS:
        raise SystemExit(f"error: unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    pair, triple = MODEL_SETS[models]
    return REPO_ROOT / "config" / algorithm / f"{triple if algorithm == 'mixture' else pair}.yaml"


def write_deployment(source: Path, out: Path, policy: dict[str, Any], overrides: dict[str, Any] | None = None) -> Path:
    """`source` with `policy` (and top-level `overrides`, e.g. batching, or per-model keys under
    `models_all`) written to `out`; relative paths are made absolute so the copy works from anywhere."""
    data = dict(read_config_file(source))
    base = source.resolve().parent

    def absolute(value: str) -> str:
        p = Path(os.path.expanduser(os.path.expandvars(value)))
        return str(p if p.is_absolute() else (base / p).resolve())

    data["models"] = {name: dict(m, path=absolute(m["path"])) for name, m in data["models"].items()}
    if data.get("tokenizer"):
        data["tokenizer"] = absolute(data["tokenizer"])
    data["policy"] = dict(policy)
    for key, value in (overrides or {}).items():
        if key == "models_all":
            for m in data["models"].values():
                m.update(value)
        else:
            data[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    # Model order matters (the entry first, the large model last): keep it.
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


