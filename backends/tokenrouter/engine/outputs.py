"""What a client gets back, and the coordinator's record of a request across models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from tokenrouter.engine.detokenizer import Detokenizer
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.transport.messages import Commit


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    owner: str  # the model that decodes it now (or was last sent it)
    listener: Callable[[RequestOutput], None] | None = None
    models_order: list[str] | None = None  # config order: the last is "the large model" in stats
    output_ids: list[int] = field(default_factory=list)
    holders: set[str] = field(default_factory=set)  # models holding its state / KV
    # From the last handoff relayed: what each model had seen of it, and the routing state it carried (to take it
    # back where a model that went down had it: model_down: route_around).
    seen: dict[str, int] = field(default_factory=dict)
    route_state: dict[str, Any] = field(default_factory=dict)
    tokens_per_model: dict[str, int] = field(default_factory=dict)
    # The model whose token came first: where it is not the entry model, the time to the first token includes
    # that model's prefill of the whole prompt (perf/bench_served.py reports TTFT by it).
    first_token_model: str | None = None
    handoffs: int = 0
    forwarded: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_trim: int | None = None  # a matched stop string: characters to drop from the end of the text
    error: str | None = None
    finalized: bool = False
    result_taken: bool = False  # the final output was handed out directly (abort), not via step()
    # The text so far, decoded incrementally (never the whole output again): `decoded_text` is what the
    # detokenizer emitted for the first `num_decoded` output ids.
    detokenizer: Detokenizer | None = field(default=None, repr=False)
    num_decoded: int = 0
    decoded_text: str = ""
    # What has been sent to the listener already.
    sent_tokens: int = 0
    sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_commit(self, ev: Commit) -> None:
        if self.first_token_model is None and ev.token_ids:
            self.first_token_model = ev.model
        self.output_ids.extend(ev.token_ids)
        self.tokens_per_model[ev.model] = self.tokens_per_model.get(ev.model, 0) + len(ev.token_ids)
        if ev.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = ev.finish_reason
            self.stop_trim = ev.stop_trim

    def stats(self, models_order: list[str] | None = None) -> dict[str, Any]:
        produced = sum(self.tokens_per_model.values())
        last = models_order[-1] if models_order else None
        return {
            "tokens_per_model": dict(self.tokens_per_model),
            "first_token_model": self.first_token_model,
            "handoffs": self.handoffs,
            "large_token_share": (self.tokens_per_model.get(last, 0) / produced) if produced and last else 0.0,
            "num_cached_tokens": sum(self.cached.values()),
            "num_forwarded_tokens": sum(self.forwarded.values()),
            "forwarded_per_model": dict(self.forwarded),
            "cached_per_model": dict(self.cached),
        }

    def output(self, tokenizer: PreTrainedTokenizerBase | None, final: bool) -> RequestOutput:
        """The cumulative output plus the delta since the previous call (which it consumes).

        Text that a later token may still change is not sent yet: an incomplete UTF-8 character (see
        `Detokenizer`) and, while stop strings are set, the last (longest stop - 1) characters, which may
        be the start of a stop string the next token completes (its text is then cut before it)."""
        if self.detokenizer is None:
            self.detokenizer = Detokenizer(tokenizer)
        if len(self.output_ids) > self.num_decoded:
            self.decoded_text += self.detokenizer.push(self.output_ids[self.num_decoded :])
            self.num_decoded = len(self.output_ids)
        if final or self.stop_trim is not None:
            # No more tokens: the held characters are final (with a stop string, `stop_trim` counts them).
            self.decoded_text += self.detokenizer.flush()
        end = len(self.decoded_text)
        if self.stop_trim is not None:
            end -= self.stop_trim
        elif not final and self.params.stop:
            end -= max(map(len, self.params.stop)) - 1
        # Never take back what was sent; with the hold-back above, a stop string never starts before it.
        end = min(len(self.decoded_text), max(end, self.sent_chars))
        text = self.decoded_text[:end]
        delta_ids = self.output_ids[self.sent_tokens :]
        delta_text = text[self.sent_chars :]
        self.sent_tokens, self.sent_chars = len(self.output_ids), end
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            text=text,
            finished=final,
            finish_reason=self.finish_reason if final else None,
            delta_token_ids=delta_ids,
            delta_text=delta_text,
            error=self.error,
            stats=self.stats(self.models_order),
        )
