"""Train R2R's (or CITER's) token router for a small/large pair from the pair's own divergence labels.

    python -m tokenrouter.tools.train_router --pair models/pair --out models/pair/r2r_router.safetensors
    # then: policy: {name: r2r, checkpoint: models/pair/r2r_router.safetensors, hidden_dim: 256, threshold: ...}
    python -m tokenrouter.tools.train_router --policy citer --pair models/pair --out models/pair/citer.safetensors

Labels (R2R routes the tokens where the small model would take the response somewhere the large one would
not): the small model continues training-set prompts greedily; at every output position the large model's
greedy token is computed on the same prefix (teacher-forced). Where both agree the label is 0. Where they
differ, the large model continues both variants greedily for `--lookahead` tokens and the two texts are
compared: if the small model's token only spelled the same text differently (e.g. `ret` + `urn` against
`return`), the texts agree and the label is 0; if they differ, the token diverges: label 1. (R2R judges
divergence with a verifier model; continuing with the large model is this project's stand-in, stated.)

Features are exactly what the policy reads inside the step (routing/policies/r2r.py): the small model's
final-norm hidden state of the position that predicted the token, its top-k logits sorted, and the token's
input embedding. The network is R2RRouter; loss: binary cross-entropy weighted for the class balance.

`--policy citer`: CITER's router (routing/policies/citer.py: an MLP on the hidden state alone, scoring
whether the small model's token is good enough). CITER learns from token-level preferences decided by the
outcome of routing each token either way (the small model's token is preferred where the response reaches
the same result as with the large model's, and where both models choose the same token, with no rollout);
with no task answers to check here, the outcome is the same continuation test as above, so its target is
1 - the divergence label (stated stand-in; the preference loss on one binary preference is this
cross-entropy).
Prompts come from the training files of tools/train_pair.py (the held-out files stay unseen for
perf/routing_quality.py). Writes the state dict (safetensors) and `<out>.json` with the label statistics,
validation metrics and the policy settings that load it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3ForCausalLM

from tokenrouter.routing.policies.citer import CiterRouter
from tokenrouter.routing.policies.r2r import R2RRouter
from tokenrouter.tools.bpe import read_sources
from tokenrouter.tools.train_pair import pair_split

TOP_K = 100  # R2R's top-k logits (the policy's default `top_k_logits`), clamped to the vocabulary


def checked_paths(p: argparse.ArgumentParser, pair: str, out: str) -> tuple[Path, Path]:
    """--pair (a folder with small/ and large/) and --out (a .safetensors file in a writable place), checked
    before minutes of work; `p.error` otherwise."""
    pair_dir, out_file = Path(pair), Path(out)
    for m in ("small", "large"):
        if not (pair_dir / m / "config.json").is_file():
            p.error(f"--pair {pair}: no {m}/config.json (a folder with small/ and large/ model directories)")
    if out_file.suffix != ".safetensors":
        p.error("--out must end in .safetensors")
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.with_suffix(".write-test").write_text("")
        out_file.with_suffix(".write-test").unlink()
    except OSError as e:
        p.error(f"--out {out}: {e.strerror or e}")
    return pair_dir, out_file


def load_pair(pair: Path, device: str) -> tuple[Any, Qwen3ForCausalLM, Qwen3ForCausalLM]:
    """The pair's tokenizer and both models in float32 on `device`, for inference."""
    tokenizer = AutoTokenizer.from_pretrained(pair / "small")
    small = Qwen3ForCausalLM.from_pretrained(pair / "small", dtype=torch.float32).to(device).eval()
    large = Qwen3ForCausalLM.from_pretrained(pair / "large", dtype=torch.float32).to(device).eval()
    return tokenizer, small, large


def training_prompts(tokenizer: Any, pair: Path, n: int, length: int, seed: int) -> list[list[int]]:
    train, _, _ = pair_split(pair)
    tokenizer.model_max_length = sys.maxsize  # whole files are tokenized, then cut into windows
    rng = random.Random(seed)
    files = rng.sample(train, min(len(train), 4 * n))
    docs = [d for d in (tokenizer(t, add_special_tokens=False)["input_ids"] for t in read_sources(files))
            if len(d) > length]
    if not docs:
        raise SystemExit(f"error: no training file has more than {length} tokens")
    out = []
    for i in range(n):
        d = docs[i % len(docs)]
        start = rng.randrange(0, len(d) - length)
        out.append(d[start : start + length])
    return out


@torch.no_grad()
def greedy(model: Qwen3ForCausalLM, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def greedy_batch(model: Qwen3ForCausalLM, seqs: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of n tokens for sequences of different lengths (left-padded, masked)."""
    if not seqs:
        return []
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=model.device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


@torch.no_grad()
def label_prompt(small: Qwen3ForCausalLM, large: Qwen3ForCausalLM, tokenizer: Any, prompt: list[int],
                 gen_len: int, lookahead: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Features (hidden, top-k logits, token embedding) and labels of one prompt's small continuation."""
    cont = greedy(small, prompt, gen_len)
    seq = torch.tensor([prompt + cont], device=small.device)
    out = small(seq, output_hidden_states=True)
    pos = slice(len(prompt) - 1, len(prompt) - 1 + len(cont))  # positions that predicted each output token
    hidden = out.hidden_states[-1][0, pos].float()
    top = torch.topk(out.logits[0, pos].float(), k, dim=-1, sorted=True).values
    tokens = torch.tensor(cont, device=small.device)
    emb = small.get_input_embeddings()(tokens).float()
    large_choice = large(seq).logits[0, pos].argmax(-1).tolist()
    differ = [t for t, (s_tok, l_tok) in enumerate(zip(cont, large_choice)) if s_tok != l_tok]
    # Both variants of every differing position continue in one left-padded batch (one generate call per
    # prompt, not two per position: generate's per-call cost dominates with models this small).
    variants = [prompt + cont[:t] + [tok] for t in differ for tok in (cont[t], large_choice[t])]
    conts = greedy_batch(large, variants, lookahead)
    labels = [0] * len(cont)
    for i, t in enumerate(differ):
        a, b = conts[2 * i], conts[2 * i + 1]
        a, b = tokenizer.decode([cont[t]] + a), tokenizer.decode([large_choice[t]] + b)
        n = min(len(a), len(b))
        labels[t] = int(a[:n] != b[:n])
    return hidden.cpu(), top.cpu(), emb.cpu(), labels


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Probability that a random positive scores above a random negative (ties count half)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).float().mean()
    ties = (pos[:, None] == neg[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=("r2r", "citer"), default="r2r", help="whose router network to train")
    p.add_argument("--pair", required=True, help="folder with small/ and large/ model directories")
    p.add_argument("--out", required=True, help="router checkpoint to write (.safetensors)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--lookahead", type=int, default=8)
    p.add_argument("--hidden-dim", type=int, default=256, help="R2R's router width (the policy's hidden_dim)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the pair runs to label (the router trains on the CPU)")
    args = p.parse_args(argv)
    pair, out = checked_paths(p, args.pair, args.out)
    for name in ("prompts", "prompt_len", "gen_len", "lookahead", "hidden_dim", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.manual_seed(args.seed)
    tokenizer, small, large = load_pair(pair, args.device)
    k = min(TOP_K, small.config.vocab_size)

    feats: list[tuple[torch.Tensor, ...]] = []
    labels: list[int] = []
    owner: list[int] = []  # the prompt of each token: validation is split by prompt, not by token
    for i, prompt in enumerate(training_prompts(tokenizer, pair, args.prompts, args.prompt_len, args.seed)):
        h, top, emb, lab = label_prompt(small, large, tokenizer, prompt, args.gen_len, args.lookahead, k)
        feats.append((h, top, emb))
        labels += lab
        owner += [i] * len(lab)
        if (i + 1) % 32 == 0:
            print(f"labelled {i + 1} prompts: {sum(labels)} of {len(labels)} tokens diverge", flush=True)
    h, top, emb = (torch.cat([f[j] for f in feats]) for j in range(3))
    y = torch.tensor(labels, dtype=torch.float32)
    n = len(y)
    if y.min() == y.max():
        print(f"error: all {n} labels are {int(y[0])}: nothing to learn (the models agree everywhere, or nowhere: "
              "random weights diverge on every token)", file=sys.stderr)
        return 2
    # A tenth of the prompts (at least one) validate; their neighbouring tokens never train.
    prompts_perm = torch.randperm(len(feats), generator=torch.Generator().manual_seed(args.seed)).tolist()
    val_prompts = set(prompts_perm[: max(1, len(feats) // 10)])
    is_val = torch.tensor([o in val_prompts for o in owner])
    val, train = is_val.nonzero().flatten(), (~is_val).nonzero().flatten()

    if args.policy == "r2r":
        net: torch.nn.Module = R2RRouter(small.config.hidden_size, k, args.hidden_dim)
        inputs = lambda idx: (h[idx], top[idx], emb[idx])  # noqa: E731
        policy = {"name": "r2r", "checkpoint": str(out), "hidden_dim": args.hidden_dim, "top_k_logits": TOP_K}
    else:  # CITER's score means "the small model's token is fine": the opposite target, routed below threshold
        net = CiterRouter(small.config.hidden_size)
        inputs = lambda idx: (h[idx],)  # noqa: E731
        policy = {"name": "citer", "checkpoint": str(out)}
        y = 1.0 - y
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    positives = float(y[train].sum())
    pos_weight = torch.tensor((len(train) - positives) / max(1.0, positives))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    history = []
    for _ in range(args.epochs):
        net.train()
        order = train[torch.randperm(len(train))]
        total = 0.0
        for b in range(0, len(order), 256):
            idx = order[b : b + 256]
            loss = loss_fn(net(*inputs(idx)), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        history.append(total / len(train))
    net.eval()
    with torch.no_grad():
        scores = torch.sigmoid(net(*inputs(val)))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in net.state_dict().items()}, str(out))
    report = {
        "pair": str(pair), "prompts": args.prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "lookahead": args.lookahead, "tokens": n, "divergent": sum(labels), "divergent_share": sum(labels) / n,
        "target": "divergent" if args.policy == "r2r" else "small token fine (1 - divergent)",
        "train_loss_first_epoch": history[0], "train_loss_last_epoch": history[-1],
        "validation": {"tokens": len(val), "auc": auc(scores, y[val]),
                       "accuracy_at_0.5": float(((scores >= 0.5).float() == y[val]).float().mean())},
        "policy": policy,
    }
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
