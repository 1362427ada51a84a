"""The in-process engine: `Engine.from_config(...).generate(prompts, params)`.

One model for now (the config's `entry`); the routing engine grows this into one subserver per model.
`step()` is schedule -> forward -> sample -> postprocess, with one host sync (the sampled ids).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenrouter.config import EngineConfig, load_config
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import SeqStatus, Sequence
from tokenrouter.engine.tokenizer import decode, find_stop, load_tokenizer
from tokenrouter.runner.model_runner import ModelRunner
from tokenrouter.runner.sampler import sample
from tokenrouter.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stats: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mcfg = config.entry_model
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.runner = ModelRunner(mcfg, default_kv_tokens=config.cpu_kv_cache_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, mcfg.block_size, mcfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, mcfg.max_num_seqs, mcfg.max_num_batched_tokens)
        self.eos_token_ids = set(self.runner.arch.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._closed = False

    @classmethod
    def from_config(cls, source: str | os.PathLike | dict[str, Any] | EngineConfig) -> Engine:
        return cls(load_config(source))

    # -- input ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.runner.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated against the vocabulary and the context limit."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty")
            self._check_token_ids(ids, "prompt")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, but the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        return ids

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{what} token at position {i} is not an integer: {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"{what} token id {t} at position {i} is out of the vocabulary (size {self.vocab_size})"
                )

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue one request; raises ValueError (and queues nothing) on bad input."""
        self._check_open()
        params = params or SamplingParams()
        params.validate()
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(rid, list(ids), len(ids), params, generator=gen)
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def append_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Append known tokens to a live request; its next step *extends* the KV by them (no recompute)."""
        seq = self._live(request_id)
        if not token_ids:
            raise ValueError("append_tokens needs at least one token")
        self._check_token_ids(list(token_ids), "appended")
        if seq.num_tokens + len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r} would exceed the context limit {self.max_model_len}")
        seq.token_ids.extend(token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; returns its final output, or None if it is unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
        return self._output(seq)

    # -- the loop -------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output for every request that gained a token this step."""
        self._check_open()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        out = self.runner.forward(chunks)
        sampling = [c.seq for c in chunks if c.samples]
        tokens = sample(out.logits, [s.params for s in sampling], [s.generator for s in sampling]).tolist()
        for c in chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            self.block_manager.register_full_blocks(c.seq)
        outputs = []
        for seq, tok in zip(sampling, tokens):
            seq.token_ids.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(self._output(seq))
        return outputs

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = decode(self.tokenizer, seq.output_token_ids)
            prev = decode(self.tokenizer, seq.output_token_ids[:-1])
            at = find_stop(text, p.stop, len(prev))
            if at is not None:
                seq.stop_text_end = at
                return "stop"
        if seq.num_output_tokens >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        text = decode(self.tokenizer, seq.output_token_ids)
        if seq.stop_text_end is not None:
            text = text[: seq.stop_text_end]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stats={
                "num_cached_tokens": seq.num_cached_tokens,
                "num_forwarded_tokens": seq.num_forwarded_tokens,
            },
        )

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; all inputs are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                params.validate()
                self.tokenize(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(ids):
                for o in self.step():
                    if o.finished:
                        results[o.request_id] = o
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return [results[rid] for rid in ids]

    # -- lifecycle ------------------------------------------------------------------------------------

    def _live(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            raise KeyError(f"no live request {request_id!r}")
        return seq

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def check_integrity(self) -> None:
        """KV accounting invariants; when idle, every block must be free."""
        live = [s for s in self.requests.values() if s.status is SeqStatus.RUNNING]
        self.block_manager.check_integrity(live)
        if not self.has_unfinished() and self.block_manager.num_free_blocks != self.block_manager.num_blocks:
            raise AssertionError(
                f"idle engine holds {self.block_manager.num_blocks - self.block_manager.num_free_blocks} KV blocks"
            )

    def shutdown(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self._closed = True
        self.runner = None  # type: ignore[assignment]  # drop weights and KV pool

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
