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


def _filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # [R, V] -> probs [R, V]
    """`_filter` for many rows at once, each with its own settings: a handful of kernels for the whole batch
    instead of a handful per row (one full-vocabulary sort per row was most of a small model's step)."""
    vocab = logits.shape[-1]
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    logits = logits / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(logits, max(ks), dim=-1).values  # [R, kmax], descending
        idx = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)
        kth = top.gather(1, idx[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=dev)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays (see `_filter`)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor,  # [S, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [S] int64
    """Greedy rows take argmax together, unseeded sampled rows draw together from the global generator;
    seeded rows sample one by one so their draws depend only on their own generator, never on what they
    were batched with."""
    out = logits.argmax(dim=-1)
    free = [i for i, (p, g) in enumerate(zip(params, generators)) if not p.greedy and g is None]
    if free:
        rows = torch.tensor(free, device=logits.device)
        probs = _filter_rows(logits.index_select(0, rows), [params[i] for i in free])
        out[rows] = torch.multinomial(probs, 1).squeeze(1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy or g is None:
            continue
        probs = _filter(logits[i], p)
        out[i] = torch.multinomial(probs, 1, generator=g)[0]
    return out
