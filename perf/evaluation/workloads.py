"""The three workloads of TokenRouter's evaluation, generated here (no data set can be downloaded).

- low-effort: single-turn requests, ~100-token prompts, output cap 2,048 tokens;
- high-effort: single-turn requests, ~100-token prompts, output cap 8,192 tokens;
- agentic: multi-turn sessions; the first turn carries a ~8,192-token context, every later turn is the
  previous turn's prompt + its output + a new ~100-token user message (so turns share their prefix and a
  prefix cache pays off), output cap 1,024 per turn.

Prompts are random token ids drawn (seeded) from the deployment's vocabulary without its special ids.
With dummy weights the text means nothing; what matters for serving cost is lengths and prefix sharing,
which these shapes fix. Every request generates exactly its cap (`ignore_eos`), so every system and every
algorithm decodes the same number of tokens. Tokens are sampled with Qwen3's recommended thinking-mode
settings (SAMPLING): greedy decoding of random weights falls into a short cycle within a few tokens, after
which a router's signal is constant per request, so a request routes always or never (measured on the
H200: a threshold calibrated to 9.4 % gave 0 % on the next prompts); sampled tokens keep it varying per
token, as with real weights. `--scale` shrinks the caps and the agentic context by one factor (prompt
lengths stay ~100 tokens; requests per point do not change), which keeps every workload's shape.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

PROMPT_LEN = 100
SAMPLING: dict[str, float | int] = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
USER_TURN_LEN = 100

# name -> (description, output cap, first-turn context, turns per session) at scale 1.
SHAPES: dict[str, tuple[str, int, int, int]] = {
    "low-effort": ("~100-token prompts, output cap 2,048 (single turn)", 2048, PROMPT_LEN, 1),
    "high-effort": ("~100-token prompts, output cap 8,192 (single turn)", 8192, PROMPT_LEN, 1),
    "agentic": ("sessions of 4 turns; ~8,192-token context shared turn to turn, cap 1,024 per turn", 1024, 8192, 4),
}


@dataclass
class Session:
    """One client's conversation: turn 0 sends `turns[0]`; turn k sends everything before it (previous
    prompts and outputs) followed by `turns[k]`."""

    turns: list[list[int]]
    max_tokens: int
    sampling: dict[str, float | int] = field(default_factory=lambda: dict(SAMPLING))


@dataclass
class Workload:
    name: str
    description: str
    max_tokens: int
    context_len: int
    turns: int
    scale: float
    sessions_per_point: dict[int, int] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "scale": self.scale,
            "output_cap": self.max_tokens,
            "first_turn_prompt_tokens": self.context_len,
            "turns_per_session": self.turns,
            "later_turn_new_tokens": USER_TURN_LEN if self.turns > 1 else None,
        }

    def sessions(self, concurrency: int, vocab: int, special: set[int], seed: int) -> list[Session]:
        """The sessions of one point: `sessions_for(concurrency)` of them, fresh ids per point (so the
        prefix cache never carries over between points), the same for every system at that point."""
        rng = random.Random(f"{self.name}|{concurrency}|{seed}")
        allowed = [t for t in range(vocab) if t not in special]

        def draw(n: int) -> list[int]:
            return [rng.choice(allowed) for _ in range(n)]

        out = []
        for _ in range(self.sessions_for(concurrency)):
            turns = [draw(self.context_len)] + [draw(USER_TURN_LEN) for _ in range(self.turns - 1)]
            out.append(Session(turns, self.max_tokens))
        return out

    def sessions_for(self, concurrency: int) -> int:
        """Single-turn: max(2C, 4) requests at full scale (a finished one is replaced at once, so each slot
        serves two or more); multi-turn: C sessions, each with all its turns in order."""
        if self.turns > 1:
            return concurrency
        return max(2 * concurrency, 4)


def make_workload(name: str, scale: float) -> Workload:
    if name not in SHAPES:
        raise SystemExit(f"error: unknown workload {name!r}; known: {', '.join(SHAPES)}")
    if not 0 < scale <= 1:
        raise SystemExit(f"error: --scale must be in (0, 1], got {scale}")
    description, cap, context, turns = SHAPES[name]
    cap = max(16, round(cap * scale))
    context = context if context == PROMPT_LEN else max(PROMPT_LEN, round(context * scale))
    return Workload(name, description, cap, context, turns, scale)
