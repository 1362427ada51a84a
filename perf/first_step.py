"""What a served model's first steps of a new shape cost on the host, after the warm-up (issue 11, point 4).

A fresh server's first 8 concurrent requests meet one eager step no warm-up batch had: one decoding row beside
seven 100-token prefills (701 tokens). This builds the entry model's subserver as a served one is built (its
warm-up included), then times that batch's forward pass (the host's part: inputs and kernel launches; and to its
tokens) three times, with prompts of 100, 101 and 100 tokens, fresh sequences each time.

    python perf/first_step.py --config config/random/qwen3-0.6b_qwen3-32b.yaml   # on a GPU machine
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tokenrouter.config import load_config
from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.warmup import GREEDY, _finish, _step
from tokenrouter.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--rows", type=int, default=7, help="prefills beside the decoding row")
    args = ap.parse_args()
    config = load_config(args.config)
    t0 = time.perf_counter()
    sub = Subserver.from_config(config, config.entry, lambda event: None, load_tokenizer(config.tokenizer_path))
    print(f"built and warmed up in {time.perf_counter() - t0:.1f} s (warm-up {sub.warmup_s} s)")
    sync = torch.cuda.synchronize if sub.runner.device.type == "cuda" else (lambda: None)
    rng = random.Random(1)
    vocab = sub.runner.arch.vocab_size
    for trial, length in enumerate((100, 101, 100)):
        seqs = [Sequence(f"p{trial}-{i}", [rng.randrange(vocab) for _ in range(length)], length, GREEDY)
                for i in range(args.rows + 1)]
        sub.scheduler.add(seqs[0])
        _step(sub)  # the first row's prefill: it decodes in the batch below
        for seq in seqs[1:]:
            sub.scheduler.add(seq)
        chunks = sub.scheduler.schedule()
        sync()
        start = time.perf_counter()
        with sub.runner.stream_context():
            sub.runner.forward(chunks)
            launched = time.perf_counter()
            sync()
        done = time.perf_counter()
        tokens = sum(c.num_new_tokens for c in chunks)
        print(f"trial {trial}: {len(chunks)} rows, {tokens} tokens: host {1000 * (launched - start):.2f} ms, "
              f"to its tokens {1000 * (done - start):.2f} ms")
        for c in chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
        _finish(sub, seqs)


if __name__ == "__main__":
    main()
