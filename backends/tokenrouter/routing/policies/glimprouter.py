"""`glimprouter` (GlimpRouter): step-level routing decided from a one-token "glimpse" of each step.

Rule: at the start of every reasoning step the small model (models[0]) samples one glimpse token. If the
entropy (nats) of its renormalized top-`top_k` distribution (softmax over the `top_k` largest logits) is
above `threshold`, the glimpse is dropped and the large model (models[1]) writes the whole step under
`Lease(return_to=small, stop_pattern=delimiter, max_tokens=max_step_tokens)`; otherwise the glimpse is
committed and the small model writes the step. Tokens that do not start a step are never routed.

A token starts a step when it is the first output token, when the large model just handed a step back
(tracked in `state["at_step_start"]`, set when a step is routed), or when the committed output ends with
`delimiter` (the small model ended a step itself). The last check needs token text, and a policy has no
tokenizer of its own, so it uses, in this order:

1. `tokenizer` (a tokenizer directory): each token's text, decoded once in `setup`; the output's tail text is
   the concatenation of its last tokens' texts (exact for ASCII delimiters such as "\\n\\n", also when the
   delimiter is split over several tokens);
2. `delimiter_token_ids` (a list of ids): token-id approximation, a step ends when the last committed output
   token is one of these ids (list every id whose text ends with the delimiter, e.g. ".\\n\\n" merges);
3. neither: steps start only at the beginning of the output and after a hand-back (a coarse fallback that
   never routes inside a small-model stretch; configure one of the above for the published behaviour).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenrouter.routing.policies._common import check_models, number_arg
from tokenrouter.routing.policy import Lease, Policy, RouteDecision, RouteRequest, StepResult, register

STATE_KEY = "at_step_start"
# How many trailing tokens the text check looks at: enough for any delimiter split into per-char tokens.
MAX_TAIL_TOKENS = 32


def top_k_entropy(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[S] entropy (nats) of softmax over the k largest logits of each row, computed on the logits' device."""
    top = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1).values
    lp = torch.log_softmax(top, dim=-1)
    return -(lp.exp() * lp).sum(-1)


@register
class GlimpRouterPolicy(Policy):
    """Route a whole step to the large model when its first token's top-k entropy is above `threshold`."""

    HOST_ROUTE = True
    PURE_LEASED_ROUTE = True
    name = "glimprouter"
    ARGS = {
        "threshold": 1.0,
        "top_k": 20,
        "delimiter": "\n\n",
        "max_step_tokens": 64,
        "tokenizer": None,
        "delimiter_token_ids": None,
    }

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        check_models(self, exactly=2)
        self.threshold: float = number_arg(self, "threshold", lo=0.0)
        self.top_k: int = number_arg(self, "top_k", lo=1, integer=True)
        self.max_step_tokens: int = number_arg(self, "max_step_tokens", lo=1, integer=True)
        delimiter = self.args["delimiter"]
        if not isinstance(delimiter, str) or not delimiter:
            raise ValueError(f"policy 'glimprouter': 'delimiter' must be a non-empty string, got {delimiter!r}")
        self.delimiter: str = delimiter
        ids = self.args["delimiter_token_ids"]
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ValueError(f"policy 'glimprouter': 'delimiter_token_ids' must be a list of token ids, got {ids!r}")
        self.delimiter_token_ids: frozenset[int] | None = None if ids is None else frozenset(ids)
        tok = self.args["tokenizer"]
        if tok is not None and not isinstance(tok, str):
            raise ValueError(f"policy 'glimprouter': 'tokenizer' must be a directory path, got {tok!r}")
        self.token_texts: list[str] | None = None

    # -- step boundaries ------------------------------------------------------------------------------

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        # Only the small model checks step boundaries; the large model's step end is the engine's
        # stop-pattern check on the lease.
        if self.model != self.models[0]:
            return
        tokenizer = self.tokenizer  # the deployment's, unless the config names another
        if self.args["tokenizer"] is not None:
            from tokenrouter.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.args["tokenizer"])
            if tokenizer is None:
                raise ValueError(f"policy 'glimprouter': no tokenizer in {self.args['tokenizer']!r}")
        if tokenizer is not None:
            # Same skip_special_tokens as the engine's decode, so both agree on what the text is.
            self.set_token_texts(tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True))

    def set_token_texts(self, texts: list[str]) -> None:
        """Use `texts[id]` as each token's text for the delimiter check (what `setup` derives from `tokenizer`)."""
        self.token_texts = list(texts)

    def output_ends_step(self, req: RouteRequest) -> bool:
        """Whether the committed output (not the prompt) ends with the delimiter."""
        out_start = req.num_prompt_tokens
        if req.output_len <= 0:
            return False
        if self.token_texts is not None:
            texts, need, tail, i = self.token_texts, len(self.delimiter), "", len(req.token_ids)
            while i > out_start and len(tail) < need and len(req.token_ids) - i < MAX_TAIL_TOKENS:
                i -= 1
                tid = req.token_ids[i]
                tail = (texts[tid] if 0 <= tid < len(texts) else "") + tail
            return tail.endswith(self.delimiter)
        if self.delimiter_token_ids is not None:
            return req.token_ids[-1] in self.delimiter_token_ids
        return False

    def at_step_start(self, req: RouteRequest) -> bool:
        return req.output_len == 0 or bool(req.state.get(STATE_KEY, False)) or self.output_ends_step(req)

    # -- the three functions --------------------------------------------------------------------------

    def initial_state(self, prompt_ids: list[int]) -> dict[str, Any]:
        return {STATE_KEY: True}

    def step_tensors(self, result: StepResult) -> torch.Tensor | None:
        return top_k_entropy(result.logits, self.top_k) if self.model == self.models[0] else None

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        small, large = self.models
        if self.model != small:
            return [self.model] * len(batch)
        starts = [i for i, req in enumerate(batch) if self.at_step_start(req)]
        decisions: list[RouteDecision] = [small] * len(batch)
        if not starts:
            return decisions
        # One batched entropy over all rows, computed with the step (cheaper than gathering the start rows).
        hard = (self.host_step_values(result) > self.threshold).tolist()
        for i in starts:
            # A routed step comes back as a hand-back, which starts the next step; an accepted glimpse is
            # the first token of a step the small model now writes.
            batch[i].state[STATE_KEY] = bool(hard[i])
            if hard[i]:
                decisions[i] = large
        return decisions

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        # The glimpse only measured difficulty; the large model writes the step from its first token.
        return False

    def receive(self, req: RouteRequest, source: str) -> Lease:
        if self.model == self.models[1]:
            return Lease(return_to=source, stop_pattern=self.delimiter, max_tokens=self.max_step_tokens)
        return Lease(until_route=True)
