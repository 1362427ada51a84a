"""Typed messages between the coordinator and the subservers. Only what the receiver lacks travels:
a returning request carries the token suffix its target has not seen, never the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenrouter.sampling_params import SamplingParams

# -- to a subserver --------------------------------------------------------------------------------------


@dataclass
class Arrive:
    """A request comes to a model: on a first visit `tokens` is everything known (prompt + committed
    output, prefilled once); on a return it is exactly the suffix that model has not seen (an extend)."""

    request_id: str
    tokens: list[int]
    first_visit: bool
    num_prompt_tokens: int
    params: SamplingParams
    state: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # None: a new request from the client
    # Tokens each model has seen, so the next handoff can cut its suffix.
    seen: dict[str, int] = field(default_factory=dict)
    # The target's current delayed-batching threshold, for transports where the coordinator cannot set it
    # directly (piggybacked: no extra message per change).
    threshold: int | None = None
    # time.monotonic() when the source model handed the request off: the target measures the handoff's way
    # between the models (the tuner's transit). One clock for the processes of one machine; a link to another
    # machine drops it (transport/grpc_link.py).
    sent_at: float | None = None
    # On a new request's arrival at the entry model: the smallest KV pool, in tokens, of the other models whose
    # size the coordinator knows. Every request the entry model holds may come to hold KV on each of them, so it
    # admits new requests while what it holds fits this (scheduler); None: no limit but its own pool.
    kv_budget: int | None = None
    # The longest request the deployment holds (tokens): the smallest KV pool of all its models that the router
    # knows. A model stops a request there (finish reason "length") as at its own limit: a request grown past
    # another model's pool could not go back there. Stamped by the served router on every Arrive it sends (in
    # process the engine sets each model's limit itself).
    max_len: int | None = None
    # When the router took the request (time.time_ns(): comparable across routers and machines, to their clocks'
    # skew), carried on every visit. Under KV pressure a model lets a request take blocks only from younger ones,
    # so the oldest is never starved (scheduler). None: unknown (a message made outside a coordinator), ranked
    # after every stamped request.
    arrival: int | None = None


@dataclass
class Append:
    """Known tokens appended to a request owned by this model (extend without a model switch)."""

    request_id: str
    tokens: list[int]


@dataclass
class Release:
    """Drop the request's state and KV here (it finished elsewhere, or was cancelled)."""

    request_id: str
    reason: str = "finished"
    # Set by the model's own process when it refused a message for this request: the model reports it (Failed)
    # from its loop, in order with what it emitted for the request before.
    error: str | None = None


@dataclass
class Unavailable:
    """The models that are down now (their processes died, and their KV with them), sent to every model that is up
    when that set changes, with `model_down: route_around` only: route nothing to them, and forget what they had
    seen of each request (a later visit is a first one). Not about one request."""

    models: list[str]


# -- from a subserver ------------------------------------------------------------------------------------


@dataclass
class Commit:
    """Tokens committed to the response by `model`; `finish_reason` set on the last one."""

    request_id: str
    model: str
    token_ids: list[int]
    finish_reason: str | None = None
    # With a matched stop string: how many characters to drop from the end of the output text decoded
    # through this commit (the stop string and what follows it). Counted from the end, so a model that
    # only decodes the output's newest tokens can say it.
    stop_trim: int | None = None


@dataclass
class Handoff:
    """`model` parked the request and hands it to `target`."""

    model: str
    target: str
    arrive: Arrive


@dataclass
class Released:
    """`model` freed the request's KV; its counters for the request's stats."""

    request_id: str
    model: str
    num_forwarded_tokens: int
    num_cached_tokens: int
    held: bool = True  # False: the model had nothing for this request (already released, or never came)


@dataclass
class Failed:
    """The request failed on `model` (bad input discovered late, or an internal error)."""

    request_id: str
    model: str
    error: str


@dataclass
class StepStatsReport:
    """A model's step statistics so far (`StepStats.snapshot()`), for a threshold tuner in another process.
    Not about one request: it travels beside the events."""

    model: str
    stats: dict[str, Any]


@dataclass
class Heartbeat:
    """`model`'s process is alive: sent on a connection that has carried nothing else for a while, so that the
    router can tell a quiet model from a stopped one (serving/watchdog.py), and at once on each new connection.
    Not about one request. `kv_tokens`: its KV pool's size in tokens (the entry model's admission budget,
    Arrive.kv_budget)."""

    model: str
    kv_tokens: int | None = None


Event = Commit | Handoff | Released | Failed
