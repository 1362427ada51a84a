"""Routing quality against cost: for each policy at several settings, the share of tokens the large model
wrote next to how close the routed output is to what the large model would write.

    python perf/routing_quality.py --pair models/pair --out perf/results/routing_quality_pair
    python perf/routing_quality.py --pair models/tiny --prompts 8 --max-tokens 16 --out /tmp/rq  # plumbing

`--pair` is a folder with `small/` and `large/` model directories sharing a tokenizer (tools/train_pair.py
writes one; models/tiny works for plumbing). Prompts are windows of `--prompt-len` tokens from the Python
standard library files that tools/train_pair.py holds out (so a trained pair has not seen them), drawn with
`--seed`. Every setting decodes them greedily, in process, through the routed engine (`Engine`, CPU), and is
scored with the large model (transformers, float32), teacher-forced on the routed output:
- large share: large-model tokens / all output tokens (the cost);
- large log-likelihood: the large model's mean log-probability of the routed output tokens;
- agreement: the fraction of output positions where the routed token is the large model's own greedy
  choice given the routed prefix (1 for always-large);
- prefix match: the fraction of the output equal to the large model's own greedy continuation before the
  first difference.
Writes OUT/results.json, OUT/results.md and, with matplotlib, OUT/quality_vs_share.png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
from _common import command_line, machine_info, machine_line, now_iso
from transformers import AutoTokenizer, Qwen3ForCausalLM

from tokenrouter import Engine, SamplingParams
from tokenrouter.routing.policy import make_policy
from tokenrouter.tools.bpe import read_sources
from tokenrouter.tools.train_pair import pair_split

# What tools/train_router.py and tools/train_collm.py write beside their checkpoints.
R2R_REPORT = "r2r_router.safetensors.json"
CITER_REPORT = "citer_router.safetensors.json"
COLLM_REPORT = "collm_head.safetensors.json"


def default_grid(pair: Path) -> list[dict[str, Any]]:
    """Each policy's settings, from routing least to most: the baselines, random, R-Stitch (no training),
    and R2R / CITER / Co-LLM where the pair has their trained routers (PAIR/r2r_router.safetensors and
    PAIR/citer_router.safetensors from tools/train_router.py, PAIR/collm_head.safetensors from
    tools/train_collm.py).
    Untrained learned routers are left out: their decisions say nothing about the pair."""
    grid: list[dict[str, Any]] = [
        {"name": "always", "model": "small"},
        *({"name": "random", "p": p, "seed": 0} for p in (0.1, 0.25, 0.5)),
        *({"name": "rstitch", "tau_high": h, "tau_low": h / 2} for h in (0.9, 0.7, 0.5)),
    ]
    if (pair / R2R_REPORT).is_file():
        trained = json.loads((pair / R2R_REPORT).read_text())["policy"]
        grid += [{**trained, "threshold": t} for t in (0.9, 0.8, 0.7, 0.5, 0.3)]
    if (pair / CITER_REPORT).is_file():  # CITER routes when its score is *below* the threshold
        trained = json.loads((pair / CITER_REPORT).read_text())["policy"]
        grid += [{**trained, "threshold": t} for t in (0.1, 0.2, 0.3, 0.5, 0.7)]
    if (pair / COLLM_REPORT).is_file():
        report = json.loads((pair / COLLM_REPORT).read_text())
        thresholds = sorted({r["threshold"] for r in report["validation"]["routed"]}, reverse=True)
        grid += [{**report["policy"], "threshold": t} for t in thresholds]
    return grid + [{"name": "always", "model": "large"}]


def held_out_prompts(tokenizer: Any, pair: Path, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` windows of `length` tokens from the pair's held-out stdlib files, one per file where possible."""
    _, held, _ = pair_split(pair)
    tokenizer.model_max_length = sys.maxsize  # whole files are tokenized, then cut into windows
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in read_sources(held)]
    docs = [d for d in docs if len(d) > length]
    if not docs:
        raise SystemExit(f"error: no held-out file has more than {length} tokens")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = docs[i % len(docs)] if n <= len(docs) else rng.choice(docs)
        start = rng.randrange(0, len(d) - length)
        out.append(d[start : start + length])
    return out


def route(pair: Path, policy: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> list[Any]:
    cfg = {
        "models": {m: {"path": str(pair / m), "dtype": "float32", "device": "cpu", "kv_cache_tokens": 8192}
                   for m in ("small", "large")},
        "entry": "small",
        "policy": policy,
        "batching": {"thresholds": 1},
    }
    engine = Engine.from_config(cfg)
    try:
        return engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    finally:
        engine.shutdown()


@torch.no_grad()
def score(large: Qwen3ForCausalLM, prompt: list[int], output: list[int], reference: list[int]) -> dict[str, float]:
    ids = torch.tensor([prompt + output])
    logits = large(ids).logits[0, len(prompt) - 1 : -1].float()  # the predictions of every output token
    target = torch.tensor(output)
    logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).squeeze(1)
    prefix = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))
    return {
        "loglik": float(logp.mean()),
        "agreement": float((logits.argmax(-1) == target).float().mean()),
        "prefix_match": prefix / max(1, len(output)),
    }


def evaluate(pair: Path, grid: list[dict[str, Any]], prompts: list[list[int]], max_tokens: int) -> list[dict]:
    large = Qwen3ForCausalLM.from_pretrained(pair / "large", dtype=torch.float32).eval()
    reference = [o.token_ids for o in route(pair, {"name": "always", "model": "large"}, prompts, max_tokens)]
    rows = []
    for policy in grid:
        outs = route(pair, policy, prompts, max_tokens)
        total = sum(len(o.token_ids) for o in outs)
        scores = [score(large, p, o.token_ids, r) for p, o, r in zip(prompts, outs, reference)]
        row = {
            "policy": policy["name"],
            "params": {k: v for k, v in policy.items() if k != "name"},
            "large_share": sum(o.stats["tokens_per_model"].get("large", 0) for o in outs) / max(1, total),
            **{k: sum(s[k] for s in scores) / len(scores) for k in ("loglik", "agreement", "prefix_match")},
        }
        rows.append(row)
        print(f"{row['policy']:8s} {json.dumps(row['params']):60s} share {row['large_share']:6.1%}  "
              f"loglik {row['loglik']:7.3f}  agreement {row['agreement']:6.1%}  prefix {row['prefix_match']:6.1%}",
              flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Routing quality against cost ({report['pair']})", "", f"```\n{report['command']}\n```", "",
             f"- date: {report['date']}", f"- machine: {report['machine']}", f"- held-out files: {report['held_out']}",
             f"- prompts: {report['prompts']} held-out windows of {report['prompt_len']} tokens, "
             f"{report['max_tokens']} output tokens each, greedy", "",
             "| policy | settings | large share | large log-lik / token | agreement with large | prefix match |",
             "|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"| {r['policy']} | {params} | {100 * r['large_share']:.1f} % | {r['loglik']:.3f} | "
                     f"{100 * r['agreement']:.1f} % | {100 * r['prefix_match']:.1f} % |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["large_share"], r["agreement"]) for r in rows if r["policy"] == name)
        ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=name)
    ax.set_xlabel("large-model token share (%)")
    ax.set_ylabel("agreement with the large model's greedy choice (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", required=True, help="folder with small/ and large/ model directories")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", action="append", type=json.loads, default=None,
                   help='a policy mapping as JSON (repeatable), e.g. \'{"name": "random", "p": 0.2}\'; '
                        "default: always / random / rstitch, and r2r when the pair has a trained router")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    pair = Path(args.pair)
    for m in ("small", "large"):
        if not (pair / m / "config.json").is_file():
            p.error(f"--pair {pair}: no {m}/config.json (a folder with small/ and large/ model directories)")
    for name in ("prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    grid = args.policy or default_grid(pair)
    if any(not isinstance(g, dict) or "name" not in g for g in grid):
        p.error("--policy must be a JSON mapping with a 'name'")
    for g in grid:  # before any model runs: a bad setting must not cost the reference run first
        try:
            make_policy(g["name"], ["small", "large"], "small", {k: v for k, v in g.items() if k != "name"})
        except (ValueError, KeyError) as e:
            p.error(f"--policy {json.dumps(g)}: {e}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: {e.strerror or e}")
    tokenizer = AutoTokenizer.from_pretrained(pair / "small")
    prompts = held_out_prompts(tokenizer, pair, args.prompts, args.prompt_len, args.seed)
    rows = evaluate(pair, grid, prompts, args.max_tokens)
    report = {"pair": str(pair), "held_out": pair_split(pair)[2], "command": command_line(), "date": now_iso(),
              "machine": machine_line(machine_info()),
              "prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rows": rows}
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results.md").write_text(markdown(report))
    drawn = plot(rows, out / "quality_vs_share.png")
    print(f"wrote {out / 'results.md'}" + (f", {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
