"""JSON encoding of the messages, for transports that cross a process boundary (the deployment's local socket)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tokenrouter.sampling_params import SamplingParams
from tokenrouter.transport.messages import (
    Append,
    Arrive,
    Commit,
    Failed,
    Handoff,
    Heartbeat,
    Release,
    Released,
    StepStatsReport,
    Unavailable,
)

_TYPES = {
    cls.__name__: cls for cls in (Arrive, Append, Release, Commit, Handoff, Released, Failed, StepStatsReport,
                                 Heartbeat, Unavailable)
}


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        d = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if not isinstance(obj, SamplingParams):
            d["type"] = type(obj).__name__
        return d
    return obj


def _from_plain(d: dict[str, Any]) -> Any:
    d = dict(d)
    cls = _TYPES.get(d.pop("type", ""))
    if cls is None:
        raise ValueError(f"unknown message type in {sorted(d)}")
    if cls is Arrive:
        d["params"] = SamplingParams(**d["params"])
    elif cls is Handoff:
        d["arrive"] = _from_plain(d["arrive"])
    return cls(**d)


def encode(messages: list[Any]) -> str:
    return json.dumps([_plain(m) for m in messages], separators=(",", ":"))


def decode(text: str | bytes) -> list[Any]:
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("expected a JSON list of messages")
    return [_from_plain(d) for d in data]
