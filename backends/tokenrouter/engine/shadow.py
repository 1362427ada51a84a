"""Shadow decoding: a model decodes the next token of a request it has just handed back, in case it is sent back.

Under R2R-style routing the large model makes one token under a lease and hands the request back; the small model
runs that token, and its router decides whether the large model makes the next one too. When it does, the request
returns with nothing new (the small model's candidate is dropped), and its next token is the large model's decode
of the token it made itself: a step that depended on nothing the small model did. So the large model runs that
decode in its next step anyway, as a shadow row, while the request is away:

- The shadow row computes the KV of the request's last token (committed: valid whatever comes next) and the next
  token's logits. Its token is kept on the request, not committed.
- If the request comes back with nothing new and under a lease that decides (the token's route does not matter),
  that token commits at once, as the step would have made it: no step, no wait behind the model's step in flight,
  no delayed batching. Otherwise it is dropped, and the KV it wrote is the request's own (the next extend starts
  after it, one token shorter).
- Greedy rows only: the tokens are the ones the request would have got without it (a sampled row would move its
  generator).

Rows ride along in steps the model runs anyway; they cost a decode row each (bandwidth-bound steps: a row's KV
read, no weight read). A step of shadow rows alone is run only for requests in a run (their last arrival brought
nothing) and only while such requests come back with nothing again at least half the time
(`continue_p`): R2R's runs of tokens sent to the large model. Under random routing (p = 0.1) most shadows of
a step run alone would be waste, and that step would take the GPU from the small model's steps beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import SeqStatus, Sequence
from tokenrouter.runner.forward_batch import ScheduledChunk

# How fast the estimate of "a request in a run comes back with nothing again" follows what happens (per return).
_RATE = 0.05
# Above this estimate a model idle but for requests in a run steps for their shadows alone.
_ALONE_FROM = 0.5


class ShadowDecoder:
    """One model's shadow rows: which parked requests get one, and the token each may commit when it returns."""

    def __init__(self, enabled: bool, max_model_len: int) -> None:
        self.enabled = enabled
        self.max_model_len = max_model_len
        self.continue_p = _ALONE_FROM  # no evidence yet: a run is as likely to go on as not
        self.num_rows = 0  # shadow rows run
        self.num_hits = 0  # of them, committed on their request's return
        self.num_alone = 0  # steps of shadow rows alone

    def eligible(self, seq: Sequence) -> bool:
        """A decode of `seq`'s last token here would be the step its return with nothing new asks for."""
        return (seq.shadow_ok and seq.status is SeqStatus.PARKED and bool(seq.block_table) and seq.params.greedy
                and seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_tokens < self.max_model_len - 1)

    def due(self, parked: Iterable[Sequence]) -> bool:
        """Whether a model with nothing ready should step for shadow rows alone."""
        return (self.enabled and self.continue_p >= _ALONE_FROM
                and any(s.in_run and self.eligible(s) for s in parked))

    def rows(self, sched: Scheduler, bm: BlockManager, chunks: list[ScheduledChunk],
             graph_fits: Callable[[int, int], bool] | None) -> list[ScheduledChunk]:
        """Shadow rows for the step of `chunks` (none: a step of shadows alone, requests in a run only), within the
        step's sequence cap and token budget, without taking a step out of its CUDA graph, and without taking a KV
        block from requests waiting to run."""
        if not self.enabled or not sched.parked or sched.waiting_for_kv:
            return []
        alone = not chunks
        if alone and self.continue_p < _ALONE_FROM:
            return []
        seqs, tokens = len(chunks), sum(c.num_new_tokens for c in chunks)
        in_graph = bool(chunks) and graph_fits is not None and graph_fits(seqs, tokens)
        spare: int | None = None  # free blocks beyond what the running requests need for their next tokens
        out: list[ScheduledChunk] = []
        # Requests in a run first: theirs are the shadows most likely kept.
        for seq in sorted(sched.parked.values(), key=lambda s: not s.in_run):
            if (alone and not seq.in_run) or not self.eligible(seq):
                continue
            if seqs >= sched.max_num_seqs or tokens >= sched.max_num_batched_tokens:
                break
            if in_graph and not graph_fits(seqs + 1, tokens + 1):
                break
            need = bm.blocks_needed(seq, seq.num_tokens)
            if need:  # a block of its own: only one no running request needs, and never while requests wait
                if spare is None:
                    spare = 0 if sched.waiting else bm.num_free_blocks - sched.blocks_owed(ahead=1)
                if need > spare or not bm.ensure(seq, seq.num_tokens):
                    continue
                spare -= need
            out.append(ScheduledChunk(seq, 1))
            seqs, tokens = seqs + 1, tokens + 1
        self.num_rows += len(out)
        self.num_alone += bool(out) and alone
        return out

    def keep(self, seqs: list[Sequence], tokens: list[int], finite: list[bool]) -> None:
        """The shadow rows' tokens (their KV is counted computed by the step, as any row's)."""
        for seq, tok, ok in zip(seqs, tokens, finite):
            seq.shadow = (seq.num_tokens, tok) if ok else None

    def returned(self, seq: Sequence, tokens: list[int]) -> int | None:
        """`seq` is back here with `tokens` (called before they are appended): the token its shadow row made if that
        is its next token (None otherwise; whether its lease lets it commit without a step, the caller decides).
        Counts the return for `continue_p`."""
        shadow, seq.shadow = seq.shadow, None
        empty = not tokens
        if seq.shadow_ok and seq.in_run:
            self.continue_p += _RATE * (empty - self.continue_p)
        seq.in_run = seq.shadow_ok and empty
        seq.shadow_ok = False
        if (shadow is None or tokens or shadow[0] != seq.num_tokens or seq.num_computed_tokens != seq.num_tokens
                or not seq.block_table):
            return None
        return shadow[1]
