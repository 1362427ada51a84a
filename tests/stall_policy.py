"""A routing policy for the watchdog's test (test_faults.py): `random`, except that on `stall_model` its `route`
blocks while the file `stall_file` exists, leaving that model's decoding loop stuck inside a step as a hung GPU
kernel or a deadlock would, while the process's other threads run on."""

from __future__ import annotations

import os
import time
from typing import Any

from tokenrouter.routing.policies.random_policy import RandomPolicy
from tokenrouter.routing.policy import RouteDecision, RouteRequest, StepResult, register


@register
class StallPolicy(RandomPolicy):
    name = "test_stall"
    ARGS = {**RandomPolicy.ARGS, "stall_model": "large", "stall_file": ""}

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        super().__init__(models, model, args)
        self.stall_model, self.stall_file = self.args["stall_model"], self.args["stall_file"]

    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        while self.model == self.stall_model and self.stall_file and os.path.exists(self.stall_file):
            time.sleep(0.05)
        return super().route(batch, result)
