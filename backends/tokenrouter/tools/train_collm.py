"""Train Co-LLM's deferral head for a small/large pair by the paper's own objective.

    python -m tokenrouter.tools.train_collm --pair models/pair --out models/pair/collm_head.safetensors
    # then: policy: {name: collm, checkpoint: models/pair/collm_head.safetensors, threshold: 0.5}

Co-LLM (Shen et al., 2024, "Learning to Decode Collaboratively with Multiple Language Models") treats the
choice of model at each position as a latent variable: with z = Linear(h) on the small model's last hidden
state, the next token's probability is (1 - sigmoid(z)) p_small(x) + sigmoid(z) p_large(x), and the head is
trained to maximise that marginal likelihood of real text, both models frozen. The paper initialises the
head from pseudo-labels (1 where the large model predicts the token and the small one does not); so do we,
for --init-epochs, before the marginal-likelihood epochs. No generation is needed: both models run
teacher-forced on windows of the pair's training files (tools/train_pair.py's split; the held-out files
stay unseen for perf/routing_quality.py). Writes the head's state dict (safetensors) and `<out>.json` with
the validation likelihoods (small alone, large alone, the learned mixture), the deferral rate at the
threshold, and the policy settings that load it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3ForCausalLM

from tokenrouter.routing.policies.collm import DeferralHead
from tokenrouter.tools.train_router import checked_paths, load_pair, training_prompts


@torch.no_grad()
def teacher_forced(small: Qwen3ForCausalLM, large: Qwen3ForCausalLM, windows: list[list[int]],
                   batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: the small model's final hidden state, both models' log-probabilities of the true next
    token, whether each model's greedy choice is that token (small, large). Flattened over windows."""
    hs, lps, lpl, oks, okl = [], [], [], [], []
    for i in range(0, len(windows), batch):
        x = torch.tensor(windows[i : i + batch], device=small.device)
        inp, target = x[:, :-1], x[:, 1:]
        out = small(inp, output_hidden_states=True)
        logits_l = large(inp).logits.float()
        logits_s = out.logits.float()
        hs.append(out.hidden_states[-1].float().reshape(-1, small.config.hidden_size).cpu())
        for logits, lp, ok in ((logits_s, lps, oks), (logits_l, lpl, okl)):
            lp.append(torch.log_softmax(logits, -1).gather(-1, target[..., None]).reshape(-1).cpu())
            ok.append((logits.argmax(-1) == target).reshape(-1).cpu())
    return torch.cat(hs), torch.cat(lps), torch.cat(lpl), torch.cat(oks), torch.cat(okl)


def marginal_nll(z: torch.Tensor, lp_small: torch.Tensor, lp_large: torch.Tensor) -> torch.Tensor:
    """Mean -log((1 - sigmoid(z)) p_small + sigmoid(z) p_large), computed in log space."""
    mix = torch.stack([F.logsigmoid(-z) + lp_small, F.logsigmoid(z) + lp_large])
    return -torch.logsumexp(mix, dim=0).mean()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", required=True, help="folder with small/ and large/ model directories")
    p.add_argument("--out", required=True, help="head checkpoint to write (.safetensors)")
    p.add_argument("--windows", type=int, default=512, help="training-text windows (a tenth validate)")
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--init-epochs", type=int, default=3, help="epochs on the paper's pseudo-labels first")
    p.add_argument("--epochs", type=int, default=20, help="marginal-likelihood epochs")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--target-share", type=float, default=0.25,
                   help="the deferral rate the reported threshold gives on the validation positions: the "
                        "marginal likelihood alone defers nearly everything to a better large model, so the "
                        "threshold is what sets the cost (as in the paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the pair runs (the head trains on the CPU)")
    args = p.parse_args(argv)
    pair, out = checked_paths(p, args.pair, args.out)
    for name in ("windows", "window_len", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 < args.target_share < 1.0:
        p.error("--target-share must be in (0, 1)")
    torch.manual_seed(args.seed)
    tokenizer, small, large = load_pair(pair, args.device)
    windows = training_prompts(tokenizer, pair, args.windows, args.window_len + 1, args.seed)
    n_val = max(1, len(windows) // 10)  # whole windows validate: neighbouring tokens never train
    val = teacher_forced(small, large, windows[:n_val], 16)
    train = teacher_forced(small, large, windows[n_val:], 16)
    print(f"{len(train[0]):,} training and {len(val[0]):,} validation positions", flush=True)

    head = DeferralHead(small.config.hidden_size)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01)
    h, lp_s, lp_l, ok_s, ok_l = train
    pseudo = (ok_l & ~ok_s).float()  # the paper's initialisation: the large model right, the small one wrong
    for epoch in range(args.init_epochs + args.epochs):
        order = torch.randperm(len(h))
        total = 0.0
        for b in range(0, len(order), 1024):
            idx = order[b : b + 1024]
            z = head(h[idx])
            if epoch < args.init_epochs:
                loss = F.binary_cross_entropy_with_logits(z, pseudo[idx])
            else:
                loss = marginal_nll(z, lp_s[idx], lp_l[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        phase = "pseudo-label BCE" if epoch < args.init_epochs else "marginal NLL"
        print(f"epoch {epoch + 1}: {phase} {total / len(h):.4f}", flush=True)

    vh, vlp_s, vlp_l, _, _ = val
    with torch.no_grad():
        vz = head(vh)
    prob = torch.sigmoid(vz)
    threshold = float(torch.quantile(prob, 1.0 - args.target_share))

    def at(t: float) -> dict[str, float]:
        deferred = prob > t
        routed = torch.where(deferred, vlp_l, vlp_s)  # what routing at t scores on the true tokens
        return {"threshold": round(t, 6), "deferral_rate": float(deferred.float().mean()), "nll": float(-routed.mean())}

    save_file({k: t.contiguous() for k, t in head.state_dict().items()}, str(out))
    report = {
        "pair": str(pair), "windows": args.windows, "window_len": args.window_len, "positions": len(h),
        "pseudo_label_share": float(pseudo.mean()),
        "validation": {
            "positions": len(vh),
            "nll_small": float(-vlp_s.mean()), "nll_large": float(-vlp_l.mean()),
            "nll_marginal": float(marginal_nll(vz, vlp_s, vlp_l)),
            "routed": [at(t) for t in sorted({0.5, 0.9, 0.99, threshold})],
        },
        "policy": {"name": "collm", "checkpoint": str(out), "threshold": round(threshold, 6)},
    }
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
