"""`probe`: a single-model deployment that computes another policy's per-token routing signal and reports it.

A plain single-model server has no peer to route to, but Std. Serving's dispatcher needs the signal the
routing policy decides on (R2R's router logit, R-Stitch's normalized entropy, ...). Rather than shipping
hidden states and logits to the dispatcher, the server computes the policy's own `step_tensors` beside
the model, inside the step's CUDA graph, exactly as the routed engine does: the most favourable setup for
the baseline. `route` never leaves this model; it records each sampled token's value under its request
id, where the serving process (std_serving/model.py) or a calibration run (perf/evaluation/calibrate.py)
reads it with `take`.

    policy: {name: probe, inner: {name: r2r, threshold: 0.5}, models: [small, large]}

`models` are the routed deployment's model names (in its order); this deployment's model is one of them.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenrouter.routing.policy import Policy, RouteDecision, RouteRequest, StepResult, make_policy, register


@register
class ProbePolicy(Policy):
    name = "probe"
    ARGS = {"inner": None, "models": None}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        inner, routed = self.args["inner"], self.args["models"]
        if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
            raise ValueError(f"policy 'probe': 'inner' must be a policy mapping with a 'name', got {inner!r}")
        if not isinstance(routed, list) or model not in routed or len(routed) < 2:
            raise ValueError(f"policy 'probe': 'models' must list the routed deployment's models, {model!r} among them")
        inner = dict(inner)
        self.inner = make_policy(inner.pop("name"), list(routed), model, inner)
        # The routed deployment's model list: the engine installs the step hook only when a policy has peers.
        self.models = list(routed)
        self.values: dict[str, list[list[float]]] = {}

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        self.inner.tokenizer = self.tokenizer
        self.inner.setup(device, dtype, hidden_size, vocab_size)

    def step_tensors(self, result: StepResult) -> torch.Tensor | None:
        return self.inner.step_tensors(result)

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        values = self.inner.host_step_values(result) if batch else None
        if values is not None:
            rows = values.reshape(values.shape[0], -1).tolist()
            for req, row in zip(batch, rows):
                self.values.setdefault(req.request_id, []).append(row)
        return [self.model] * len(batch)

    def take(self, request_id: str) -> list[list[float]]:
        """The values recorded for `request_id` (one row per sampled token), forgotten here."""
        return self.values.pop(request_id, [])
