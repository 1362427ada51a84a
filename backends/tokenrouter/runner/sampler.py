"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator when seeded."""

from __future__ import annotations

import torch

from tokenrouter.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] -> probs [V]
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        # The most likely token always stays: a top_p below float32's smallest value (1e-46 passes as a
        # number in (0, 1]) rounds to 0 here and would otherwise drop every token.
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [S] int64
    """Greedy rows take argmax together; others sample one by one so a seeded request's draws depend
    only on its own generator, never on what it was batched with."""
    out = logits.argmax(dim=-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = _filter(logits[i], p)
        out[i] = torch.multinomial(probs, 1, generator=g)[0]
    return out
