"""Std. Serving's dispatcher: token-level routing done by a client over plain single-model servers.

Per token it asks the current model's server (Triton model `std_<model>`) for ONE greedy token, sending
the whole context (the server's prefix cache makes that cheap), and gets the routed policy's signal for
that token back (`step_values`, computed by the server's `probe`). Between calls it runs the SAME policy
code as the routed engine, one instance per model, with the engine's semantics mirrored line by line from
engine/subserver.py: `route` on every token, a lease decides while it lasts (`_postprocess`), `send`
decides whether a switching token is committed, `receive` sets the lease on arrival (`_arrive`), and
`StopChecker` ends the request (EOS of the entry model, max tokens, context limit). With greedy sampling
its output therefore equals the routed engine's; what differs is the cost: a network round trip and a
prefill of the uncached tail per token, instead of a decode step with routing inside it.

One `StdClient` per client thread: it holds one gRPC stream, and one request at a time is in flight on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from std_serving.repository import std_name
from tokenrouter.config import EngineConfig
from tokenrouter.engine.sequence import Sequence
from tokenrouter.engine.stop import StopChecker
from tokenrouter.routing.policies.learned import LearnedRouterPolicy
from tokenrouter.routing.policy import Lease, Policy, RouteRequest, StepResult, make_policy, resolve
from tokenrouter.runner.arch import ArchConfig, declared_context_limit
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.tokenizer import load_tokenizer


class ServerError(RuntimeError):
    """A model server refused or failed a call (its message is the server's)."""


def _prepare(policy: Policy, tokenizer: Any, arch: ArchConfig) -> None:
    """What the engine's `setup` gives a policy, minus the device work: the learned routers' networks run
    on the servers (in `probe`), so they are not built here; other policies' setup is host-side rule data
    (e.g. GlimpRouter's token texts) that `route` needs."""
    policy.tokenizer = tokenizer
    if not isinstance(policy, LearnedRouterPolicy):
        policy.setup(torch.device("cpu"), torch.float32, arch.hidden_size, arch.vocab_size)


def _step_values(row: list[float] | None) -> torch.Tensor | None:
    """One token's probe row as the engine's host copy of `step_tensors` for a batch of one: [1] for a
    scalar signal, [1, K] for a vector (the probe's [n, K] rows cannot tell [S] from [S, 1]; every built-in
    policy returns [S] for one value per row)."""
    if not row:
        return None
    return torch.tensor(row[:1] if len(row) == 1 else [row], dtype=torch.float32)


class StdClient:
    """One client's connection to Std. Serving (`url`: the gRPC address of `serving_std`'s server) routing
    with `policy` (default: `config.policy`). The servers compute the signal of the policy in the YAML their
    repository was written from, so `policy` may change a rule's parameters (thresholds), not the signal
    itself (a router's seed, checkpoint or sizes)."""

    def __init__(self, url: str, config: EngineConfig, policy: dict | None = None, timeout: float = 300.0) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self._grpc, self._grpc_error = grpcclient, InferenceServerException
        self.url, self.config, self.timeout = url, config, timeout
        self.models = list(config.models)
        cfg = dataclasses.replace(config, policy=dict(policy)) if policy is not None else config
        name, args = cfg.policy_spec()
        tokenizer = load_tokenizer(config.tokenizer_path)
        self.policies: dict[str, Policy] = {}
        for m in self.models:
            self.policies[m] = make_policy(name, self.models, m, args)
            _prepare(self.policies[m], tokenizer, ArchConfig.from_dir(config.models[m].path))
        entry = ArchConfig.from_dir(config.entry_model.path)
        self.max_model_len = declared_context_limit(config)
        # The engine's stop rules, with the entry model's EOS ids as the engine uses them.
        self.stop = StopChecker(tokenizer, set(entry.eos_token_ids), self.max_model_len)
        self._ids = itertools.count()
        self._one = self._input("max_tokens", np.array([1], dtype=np.int32), "INT32")
        # The server must not stop on its own model's EOS: the dispatcher applies the entry model's.
        self._no_eos = self._input("ignore_eos", np.array([True]), "BOOL")
        self.client = grpcclient.InferenceServerClient(url)
        self._open_stream()

    def _input(self, name: str, value: np.ndarray, dtype: str) -> Any:
        t = self._grpc.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    def _open_stream(self) -> None:
        # A fresh queue per stream: a late answer on an abandoned stream cannot be taken for a new one.
        responses: queue.Queue = queue.Queue()
        self._responses = responses
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))

    def _sampling_inputs(self, params: SamplingParams) -> list[Any]:
        """The request's sampling settings, sent with every one-token call (none when greedy)."""
        if params.greedy:
            return []
        return [
            self._input("temperature", np.array([params.temperature], dtype=np.float32), "FP32"),
            self._input("top_p", np.array([params.top_p], dtype=np.float32), "FP32"),
            self._input("top_k", np.array([params.top_k], dtype=np.int32), "INT32"),
        ]

    def _next_token(self, model: str, token_ids: list[int], sampling: list[Any] = ()) -> tuple[int, list[float]]:
        """One token of `model` after `token_ids` (greedy unless `sampling` says otherwise), and the policy's
        signal for it."""
        ids = self._input("input_ids", np.array(token_ids, dtype=np.int32), "INT32")
        rid = f"std-{next(self._ids)}"
        inputs = [ids, self._one, self._no_eos, *sampling]
        self.client.async_stream_infer(std_name(model), inputs, request_id=rid)
        try:
            result, error = self._responses.get(timeout=self.timeout)
        except queue.Empty:
            self.client.stop_stream(cancel_requests=True)
            self._open_stream()
            raise ServerError(f"{std_name(model)}: no response within {self.timeout:.0f} s") from None
        if error is not None:
            raise ServerError(f"{std_name(model)}: {error}")
        out = result.as_numpy("output_ids")
        values = result.as_numpy("step_values")
        if out is None or len(out) != 1:
            raise ServerError(f"{std_name(model)}: expected one token, got {out!r}")
        return int(out[0]), values[0].tolist() if values is not None and values.size else []

    def generate(
        self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True, sampling: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Generate with the routed policy (greedy, or `sampling`: temperature / top_p / top_k); timings
        (time.perf_counter seconds), output and routing counts, or {"error": message}."""
        start = time.perf_counter()
        try:
            sampling = sampling or {"temperature": 0.0}
            params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
            params.validate()
            if len(prompt_ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(prompt_ids)} tokens, but the context limit is {self.max_model_len}")
            return self._generate(list(prompt_ids), params, start)
        except (ValueError, ServerError, self._grpc_error) as e:
            return {"error": str(e)}

    def _generate(self, prompt_ids: list[int], params: SamplingParams, start: float) -> dict[str, Any]:
        entry = self.config.entry
        seq = Sequence(f"std-req-{next(self._ids)}", list(prompt_ids), len(prompt_ids), params)
        seq.state = self.policies[entry].initial_state(list(prompt_ids))
        model, first, handoffs, per_model = entry, None, 0, Counter()
        sampling = self._sampling_inputs(params)
        while True:
            tok, row = self._next_token(model, seq.token_ids, sampling)
            now = time.perf_counter()
            target, commit = self._decide(seq, model, tok, row)
            if commit:
                seq.token_ids.append(tok)
                per_model[model] += 1
                first = first if first is not None else now
                reason, _ = self.stop.check(seq, tok)
                if reason is not None:
                    break
            if target != model:
                handoffs += 1
                self._handoff(seq, model, target)
                model = target
        out = seq.output_token_ids
        return {
            "start": start,
            "ttft": first - start,
            "e2e": now - start,
            "end": now,
            "tokens": len(out),
            "output_ids": out,
            "large_tokens": per_model[self.models[-1]],
            "handoffs": handoffs,
        }

    def _view(self, seq: Sequence, model: str) -> RouteRequest:
        return RouteRequest(seq.request_id, model, seq.token_ids, seq.num_prompt_tokens, seq.state, seq.lease)

    def _decide(self, seq: Sequence, model: str, tok: int, row: list[float]) -> tuple[str, bool]:
        """Subserver._route + _postprocess for one request: (where it goes next, whether `tok` commits)."""
        policy = self.policies[model]
        view = self._view(seq, model)
        result = StepResult(None, None, torch.tensor([tok]), None, step_values=_step_values(row))
        # `route` sees every token, also under a lease (whose own rule then decides), as in the engine.
        target = model if len(policy.models) == 1 else resolve(policy, policy.route([view], result))[0]
        lease = seq.lease
        if lease is not None and lease.decides:
            done = lease.advance(lambda: self.stop.lease_done(seq, tok))
            return (lease.return_to if done else model), True
        return target, target == model or policy.send(view, target, tok)

    def _handoff(self, seq: Sequence, source: str, target: str) -> None:
        """Subserver._handoff on `source` then _arrive on `target` (only what routing sees: the whole
        context travels with every call, so there is no suffix to cut)."""
        seq.seen = {**seq.seen, source: len(seq.token_ids), target: len(seq.token_ids)}
        seq.lease = None
        lease: Lease | None = self.policies[target].receive(self._view(seq, target), source)
        if lease is not None:
            lease.begin(source, len(seq.token_ids))
        seq.lease = lease

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()
