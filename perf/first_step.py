"""A burst of new prompts on a served model after its warm-up (issue 11, point 4): graph-aware admission.

A fresh server's first 8 concurrent requests can meet one step no warm-up batch had: a decoding row beside seven
100-token prefills (701 tokens), more than the largest CUDA graph (512). Eagerly, its kernel launches cost the
small model 14-35 ms of host (perf/results/served_legs_h200_2026-12-03). This builds a model's subserver as a
served one is built (its warm-up included, which decides whether graph-aware admission is on: the log line
"graph-aware admission"), then runs that burst until every prompt has its first token: once each way unmeasured,
then three times with fresh sequences, with admission as the warm-up set it and with it off, alternating which
goes first. Each step's rows and tokens and the burst's time to its first tokens are printed.

    python perf/first_step.py --config config/random/qwen3-0.6b_qwen3-32b.yaml [--model large]   # on a GPU
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from tokenrouter.config import load_config
from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.warmup import GREEDY, _finish, run_chunks
from tokenrouter.tokenizer import load_tokenizer


def burst(sub: Subserver, rows: int, length: int, tag: str, rng: random.Random) -> tuple[list[tuple[int, int]], float]:
    """(rows, tokens) of each step until the burst's prompts all have a token, and the time that took (s)."""
    vocab = sub.runner.arch.vocab_size
    seqs = [Sequence(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(length)], length, GREEDY)
            for i in range(rows + 1)]
    sub.scheduler.add(seqs[0])
    run_chunks(sub, sub.scheduler.schedule())  # the first row's prefill: it decodes beside the burst
    for seq in seqs[1:]:
        sub.scheduler.add(seq)
    sync = torch.cuda.synchronize if sub.runner.device.type == "cuda" else (lambda: None)
    steps = []
    sync()
    start = time.perf_counter()
    while any(s.num_tokens == s.num_prompt_tokens for s in seqs[1:]):
        chunks = sub.scheduler.schedule()
        steps.append((len(chunks), sum(c.num_new_tokens for c in chunks)))
        run_chunks(sub, chunks)
    sync()
    took = time.perf_counter() - start
    _finish(sub, seqs)
    return steps, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", help="the model to build (default: the entry model)")
    ap.add_argument("--rows", type=int, default=7, help="prefills beside the decoding row")
    ap.add_argument("--prompt-len", type=int, default=100)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(args.config)
    t0 = time.perf_counter()
    sub = Subserver.from_config(config, args.model or config.entry, lambda event: None,
                                load_tokenizer(config.tokenizer_path))
    print(f"built and warmed up in {time.perf_counter() - t0:.1f} s (warm-up {sub.warmup_s} s); graph-aware "
          f"admission {'on' if sub.scheduler.graph_fits is not None else 'off'}")
    rng = random.Random(1)
    as_set = sub.scheduler.graph_fits
    modes = [("as the warm-up set it", as_set), ("off", None)]
    for mode, fits in modes:  # unmeasured: an eager step of a new shape costs more the first time
        sub.scheduler.graph_fits = fits
        burst(sub, args.rows, args.prompt_len, f"warm-{mode[:3]}", rng)
    for trial in range(3):
        for mode, fits in modes if trial % 2 else modes[::-1]:
            sub.scheduler.graph_fits = fits
            steps, took = burst(sub, args.rows, args.prompt_len, f"t{trial}-{mode[:3]}", rng)
            print(f"trial {trial}, admission {mode}: steps (rows, tokens) {steps}: first tokens after "
                  f"{1000 * took:.2f} ms")
    sub.scheduler.graph_fits = as_set


if __name__ == "__main__":
    main()
