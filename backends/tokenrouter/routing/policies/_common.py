"""Shared helpers of the built-in policies: argument checks, model-set checks, seeded router networks.

Kept out of `policy.py` on purpose: these are conveniences of the built-in policies, not part of the
interface a policy author must know.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenrouter.routing.policy import Lease, Policy, RouteRequest

log = logging.getLogger(__name__)


def check_models(policy: Policy, *, exactly: int | None = None, at_least: int | None = None) -> None:
    """Clear errors for a model set the policy cannot route over (checked at construction, not mid-request)."""
    n = len(policy.models)
    if len(set(policy.models)) != n:
        raise ValueError(f"policy {policy.name!r}: model names must be distinct, got {policy.models}")
    if exactly is not None and n != exactly:
        what = " (models[0] = the small model, models[1] = the large one)" if exactly == 2 else ""
        raise ValueError(
            f"policy {policy.name!r} routes between exactly {exactly} models{what}; got {n}: {policy.models}"
        )
    if at_least is not None and n < at_least:
        raise ValueError(f"policy {policy.name!r} needs at least {at_least} models, got {n}: {policy.models}")
    if policy.model not in policy.models:
        raise ValueError(f"policy {policy.name!r}: this subserver's model {policy.model!r} is not in {policy.models}")


def number_arg(
    policy: Policy,
    key: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
) -> Any:
    """`policy.args[key]` as a float (or int), or a ValueError naming the argument and its allowed range."""
    value = policy.args[key]
    kind = "an integer" if integer else "a number"
    # bool is an int subclass; `threshold: true` in YAML is a mistake, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise ValueError(f"policy {policy.name!r}: argument {key!r} must be {kind}, got {value!r}")
    value = int(value) if integer else float(value)
    if not math.isfinite(value):
        raise ValueError(f"policy {policy.name!r}: argument {key!r} must be finite, got {value!r}")
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        left = "-inf" if lo is None else f"{lo:g}"
        right = "inf" if hi is None else f"{hi:g}"
        interval = f"{'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
        raise ValueError(f"policy {policy.name!r}: argument {key!r} must be in {interval}, got {value!r}")
    return value


class CheckpointMissing(FileNotFoundError, ValueError):
    """A router checkpoint that is not a file: a missing file, and a bad policy argument (the ValueError that
    the config check reports before any model loads)."""


def checkpoint_arg(policy: Policy, key: str = "checkpoint") -> str | None:
    """`policy.args[key]`, a router checkpoint file that must exist (null or "": none, random init)."""
    path = policy.args[key]
    if path is None or path == "":
        return None
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"policy {policy.name!r}: argument {key!r} must be a file path or null, got {path!r}")
    p = Path(path)
    if not p.is_file():
        # Relative paths resolve against the process's working directory: say which one that was.
        where = "" if p.is_absolute() else f" (resolved to {str(p.resolve())!r})"
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise CheckpointMissing(f"policy {policy.name!r}: argument {key!r}: router checkpoint {str(p)!r}{where} {what}")
    return str(path)


def choice_arg(policy: Policy, key: str, choices: tuple[str, ...]) -> str:
    value = policy.args[key]
    if value not in choices:
        raise ValueError(f"policy {policy.name!r}: argument {key!r} must be one of {list(choices)}, got {value!r}")
    return value


def prob_to_logit(p: float) -> float:
    """The logit x with sigmoid(x) = p, with p = 0 / 1 mapped to -inf / +inf."""
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p) - math.log1p(-p)


_OPS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<": operator.lt,
}


def sigmoid_rule(logits: torch.Tensor, op: str, threshold: float) -> torch.Tensor:
    """[S] bool `sigmoid(logits) <op> threshold`, on the logits' device.

    Inside (0, 1) the probability is compared as written (a naive reference computing torch.sigmoid gets
    bit-identical decisions). At the ends the comparison moves to logit space, where it is exact: sigmoid
    saturates in float32 (1.0 for x > ~17, 0.0 for x < ~-104), which would make e.g. "threshold 1 routes nothing"
    false for a very confident router, while mathematically sigmoid never reaches 0 or 1.
    """
    compare = _OPS[op]
    if 0.0 < threshold < 1.0:
        return compare(torch.sigmoid(logits), threshold)
    return compare(logits, prob_to_logit(threshold))


def home_or_default_receive(policy: Policy, req: RouteRequest, source: str) -> Lease:
    """R2R-style receive: on the small model (the home of the request) decoding continues until its own
    `route` says otherwise; on the large model the base default applies (one token, then back).

    The home branch matters if the engine calls `receive` when a lease hands a request back: the base
    default there would send the request straight back to the large model after one token.
    """
    if policy.model == policy.models[0]:
        return Lease(until_route=True)
    return Lease(return_to=source, max_tokens=1)


# -- router networks --------------------------------------------------------------------------------------


def seeded_init_(module: nn.Module, seed: int) -> None:
    """Initialize every Linear / LayerNorm of `module` from a private generator seeded with `seed`.

    Same distribution as PyTorch's defaults for Linear (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and
    bias), but drawn from `torch.Generator().manual_seed(seed)` in module order, on the CPU: every
    subserver, on any device, and a test's reference build bit-identical weights, and the global RNG (which
    the sampler may use) is left untouched.
    """
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.in_features)
                m.weight.uniform_(-bound, bound, generator=g)
                if m.bias is not None:
                    m.bias.uniform_(-bound, bound, generator=g)
            elif isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from a safetensors file or a torch .pt/.pth/.bin file (tensors only, loaded on the CPU).

    Accepts `{"state_dict": {...}}` wrappers and strips a `module.` prefix (DataParallel / DDP saves).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"router checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd: Any = load_file(str(path), device="cpu")
    else:
        # weights_only: a checkpoint is data, never code to run.
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"router checkpoint {str(path)!r} does not hold a state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def build_router(
    policy: Policy, factory: Callable[[], nn.Module], device: torch.device | str, checkpoint: str | None
) -> nn.Module:
    """The router network `factory()` on `device` in float32, eval mode, no grads: loaded from `checkpoint`,
    or seeded-random (`policy.seed`) when there is none."""
    # Built on the meta device first so construction does not draw from (or spend time on) the global RNG.
    with torch.device("meta"):
        net = factory()
    net = net.to_empty(device="cpu")
    if checkpoint:
        sd = load_state_dict_file(checkpoint)
        try:
            net.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ValueError(
                f"policy {policy.name!r}: checkpoint {checkpoint!r} does not fit the router network "
                f"(check the model's hidden size and the policy's size arguments): {e}"
            ) from e
    else:
        # Legitimate for benchmarks with dummy weights (which model produces a token only changes the figures
        # through the share routed), but a deployment that forgot its checkpoint would route arbitrarily.
        log.warning("policy %r has no checkpoint: its router network is randomly initialised (seed %s), so its "
                    "routing decisions are arbitrary; give the policy a trained `checkpoint`", policy.name,
                    policy.seed)
        seeded_init_(net, policy.seed)
    net = net.to(device=device, dtype=torch.float32).eval()
    net.requires_grad_(False)
    return net
