"""A request as one model sees it: its tokens, its KV blocks here, and how far this model has computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenrouter.routing.policy import Lease
from tokenrouter.sampling_params import SamplingParams

if TYPE_CHECKING:  # stop.py imports this module
    from tokenrouter.engine.stop import TextTail


# Arrival of a request whose router's stamp is unknown (a message made outside a coordinator): it ranks after every
# stamped request.
UNKNOWN_ARRIVAL = 1 << 62


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no KV blocks held (new, or preempted)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PARKED = "parked"  # decoding on another model; KV kept here (unless preempted) for its return
    FINISHED = "finished"


@dataclass
class Sequence:
    """Counters, not copies: a returning request only appends tokens; `num_computed_tokens` shows what
    still needs a forward pass (prefill, extend or decode are all `token_ids[num_computed_tokens:]`)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache at admission.
    num_cached_tokens: int = 0
    # Tokens this model actually ran through a forward pass (the no-recompute tests count these).
    num_forwarded_tokens: int = 0
    # Prefix-cache bookkeeping: how many leading blocks are registered, and the chain hash of the last.
    num_hashed_blocks: int = 0
    last_block_hash: bytes = b""
    status: SeqStatus = SeqStatus.WAITING
    # The output's newest text for stop strings, kept incrementally (created at the first check here, only
    # for requests with stop strings), and the same for the current lease's stop pattern.
    stop_text: TextTail | None = None
    lease_text: tuple[Lease, TextTail] | None = None
    generator: torch.Generator | None = None
    # Routing: the policy's per-request state, the lease it resumes under here, tokens each model has seen.
    state: dict = field(default_factory=dict)
    lease: Lease | None = None
    seen: dict[str, int] = field(default_factory=dict)
    ready_since: float | None = None  # when it last became ready to be scheduled here (queue-wait metric)
    waited_for_graph: bool = False  # admission held it back one step to keep a step in a CUDA graph (scheduler)
    # A new request, held by no model yet: admitting it never takes parked requests' blocks (scheduler).
    new_request: bool = False
    # When the router took it (Arrive.arrival). Under KV pressure a request takes blocks only from younger ones.
    arrival: int = UNKNOWN_ARRIVAL
    # Shadow decoding (engine/shadow.py): it left here under a lease that decided, having committed its last token
    # here; its last arrival here brought no tokens (the model it went to sent it straight back); and the token
    # a step here decoded for it while it was away, with the number of tokens it then held.
    shadow_ok: bool = False
    in_run: bool = False
    shadow: tuple[int, int] | None = None

    @property
    def age(self) -> tuple[int, str]:
        """Smaller is older; the same order on every model (a request's id is unique on each), so that no two
        requests each rank older on the model where the other runs (each would wait for the other for ever)."""
        return self.arrival, self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
