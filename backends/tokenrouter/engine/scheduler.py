"""Continuous batching with chunked prefill: decides which tokens of which sequences run next.

Never touches a tensor. Every scheduled sequence runs a chunk `token_ids[num_computed : num_computed + n]`:
a whole prompt (prefill), its next piece (chunked prefill), a suffix appended from elsewhere (extend) or
the last sampled token (decode). Running sequences go first, oldest first; then waiting ones are
admitted while the token budget, the sequence cap and the KV pool allow (room for a newcomer's whole prompt beside
what the running sequences still need; a new request, held by no model yet, waits rather than take the blocks of
requests parked here).

Age order under KV pressure. A request's age is when the router took it, then its id (`Sequence.age`): the same
order on every model. A request takes blocks only from younger ones. Growing, it takes them from the youngest
younger request here, parked (in flight on another model; it prefills again on return) or running (preempted,
recomputed later), or else preempts itself. Waiting to come in (a first visit from another model, a return whose
blocks were taken), it takes back younger parked requests' blocks where that makes room, and waits for running
ones to free theirs. So the oldest request is never starved: it waits at most for younger requests running here to
hand off, finish or fill the pool. Before, any request out of blocks took the longest-parked request's, and
requests that together outgrew a pool took each other's blocks on every return and each prefilled again: of four
long greedy requests on two 2,048-token pools, two crawled at ~5 tokens/s with ~9 reclaims/s per model (in
process; perf/results/kv_age_order_2026-12-06, tests/test_kv_age_order.py).

Graph-aware admission (`graph_fits`, set where a model's eager steps cost more than its graph replays): when a
newcomer would turn a step that a CUDA graph holds into one that runs eagerly (too many tokens or sequences for
any graph), it and the prompts behind it wait for the next step, once, if they all fit one graph there. On the
H200 a small model's burst of seven 100-token prompts beside a decoding row (701 tokens, graphs up to 512) ran
eagerly for 35 ms of kernel launches (perf/results/served_legs_h200_2026-12-03); as a 501-token and a 206-token
step it replays two graphs (perf/results/graph_admission_h200_2026-12-03).
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from itertools import islice
from operator import attrgetter

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.sequence import SeqStatus, Sequence
from tokenrouter.runner.forward_batch import ScheduledChunk

_AGE = attrgetter("age")


def _may_take(taker: Sequence, holder: Sequence) -> bool:
    """Whether `taker` may take `holder`'s blocks: only a younger request's, and a new request (held by no model yet)
    none."""
    return not taker.new_request and holder.age > taker.age


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # In-system requests (preempted, returned without blocks, first visits from another model) oldest first, then
        # new requests in arrival order.
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        # Requests decoding elsewhere, longest parked first.
        self.parked: OrderedDict[str, Sequence] = OrderedDict()
        self.num_preemptions = 0  # running sequences whose blocks were freed (recomputed later)
        self.num_reclaims = 0  # parked requests whose blocks were taken back (prefilled again on return)
        # (number of sequences, number of tokens) -> whether a step of them replays a CUDA graph; None: admission
        # does not look at graphs.
        self.graph_fits: Callable[[int, int], bool] | None = None
        self.num_graph_waits = 0
        # The last `schedule` left the queue's head waiting for KV blocks (its room, or kv_budget), not for its token
        # budget, its sequence cap or a CUDA graph: the next step takes it in only once blocks are freed.
        self.waiting_for_kv = False
        # Tokens that the requests this (entry) model holds must fit, for the other models' pools (Arrive.kv_budget).
        self.kv_budget: int | None = None

    def add(self, seq: Sequence, new_request: bool = False) -> None:
        """`new_request`: held by no model yet (a request's first arrival at the entry model), which makes its
        admission wait for room rather than take parked requests' blocks."""
        seq.new_request = new_request
        seq.status = SeqStatus.WAITING
        if new_request:
            self.waiting.append(seq)
        else:
            self._queue_in_system(seq)

    def _queue_in_system(self, seq: Sequence) -> None:
        """Queue a request in the system by age, ahead of every new request: a new one at the head that the budget
        holds back must not stop it, for the budget waits on exactly such requests to finish (a deadlock a hostile
        trial found, 2026-12-06)."""
        i = next((i for i, s in enumerate(self.waiting) if s.new_request or s.age > seq.age), len(self.waiting))
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_ready(self) -> int:
        """Requests a step would serve now (the delayed-batching count)."""
        return len(self.waiting) + sum(1 for s in self.running if s.num_pending_tokens > 0)

    def park(self, seq: Sequence) -> None:
        """The request left for another model: stop scheduling it but keep its KV for its return."""
        self.running.remove(seq)
        seq.status = SeqStatus.PARKED
        self.parked[seq.request_id] = seq

    def resume(self, seq: Sequence) -> None:
        """The request is back (its new suffix already appended): extend where its KV is."""
        del self.parked[seq.request_id]
        if seq.block_table:
            seq.status = SeqStatus.RUNNING
            insort(self.running, seq, key=_AGE)
        else:  # its blocks were reclaimed while parked: prefill again
            self.add(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            if n > 0 and self._grow(seq, n):
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
            if seq.status is SeqStatus.RUNNING:
                i += 1  # (a preempted `seq` left the list: index i already holds the next one)
        # Blocks the running sequences still need for the tokens they hold (the rest of a chunked prompt, a suffix
        # beyond this step's budget): promised to them, not free for a newcomer. (Summed only where one waits: every
        # step of a model passes here.)
        owed = self.blocks_owed() if self.waiting else 0
        live: set[int] | None = None  # blocks of the requests in the system (kv_budget), once one needs them
        owing = 0  # and the blocks they still need for the tokens they hold
        self.waiting_for_kv = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.bm.match_prefix(seq.token_ids) if not seq.block_table else []
            cached = len(prefix) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget)
            # A request in the system takes the blocks of younger parked requests (by age: the oldest progresses;
            # a younger one waits for it, and evicts nothing older on its return, so no two requests take each
            # other's blocks in turn). A new request, held nowhere yet, takes none: it waits while the requests in
            # the system finish (they progress without it), so the entry model admits no more requests than its pool
            # holds, and those are all that any model then holds.
            # (Only where all that it may take makes room, and once it goes in this step: blocks taken for nothing,
            # or before a wait for a CUDA graph, would cost their owners a prefill.)
            take_back = False
            if not self._room_for(seq, prefix, cached + n, owed):
                take_back = self._can_make_room(seq, prefix, cached + n, owed)
                if not take_back:
                    self.waiting_for_kv = True
                    break
            if seq.new_request and self.kv_budget is not None:
                if live is None:
                    live, owing = self._live_blocks()
                need = self.bm.blocks_for(seq.num_tokens) - sum(b in live for b in prefix)
                if (live or owing) and len(live) + owing + need > self.kv_budget // self.bm.block_size:
                    self.waiting_for_kv = True
                    break  # the other models' pools could not hold it beside them: it waits for one to finish
                live.update(prefix)
                owing += need
            if self._wait_for_graph(chunks, seq, cached, n, budget):
                break
            while take_back and not self._room_for(seq, prefix, cached + n, owed):
                take_back = self._reclaim_parked(seq)
            self.waiting.popleft()
            seq.waited_for_graph = seq.new_request = False  # (in the system now: preempted, it may reclaim)
            self.bm.allocate_prefix(seq, prefix)
            ok = self.bm.ensure(seq, seq.num_computed_tokens + n)
            assert ok
            seq.status = SeqStatus.RUNNING
            insort(self.running, seq, key=_AGE)
            owed += self.bm.blocks_needed(seq, seq.num_tokens)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def blocks_owed(self, ahead: int = 0) -> int:
        """New blocks the running sequences need for the tokens they hold, and for `ahead` more tokens each."""
        return sum(self.bm.blocks_needed(s, s.num_tokens + ahead) for s in self.running)

    def _wait_for_graph(self, chunks: list[ScheduledChunk], seq: Sequence, cached: int, n: int, budget: int) -> bool:
        """Whether `seq` (the head of the queue, `n` new tokens after `cached`; `budget`: this step's tokens left)
        and the prompts behind it that this step would admit should all wait for the next step: only where
        admitting `seq` takes a step that a CUDA graph holds out of every graph, and the whole group then fits one
        graph beside this step's rows decoding.
        So a burst runs as two graph steps instead of one eager step, and a wait never saves nothing (a group no
        graph holds is admitted at once, eager as before) nor repeats (each prompt of the group waits once, and
        the next step admits it whatever that does to the graphs, as far as KV, budget and sequence cap allow)."""
        if self.graph_fits is None or not chunks or seq.waited_for_graph:
            return False
        # Every chunk so far samples: one that does not is cut by the budget, which then admits nobody.
        tokens = self.max_num_batched_tokens - budget
        if not self.graph_fits(len(chunks), tokens):
            return False  # eager already: one more chunk costs no graph
        if cached + n == seq.num_tokens and self.graph_fits(len(chunks) + 1, tokens + n):
            return False  # it keeps the step in a graph
        # Next step: this step's rows decode a token each, beside the group that would wait: whole prompts from the
        # head on within that step's budget and the sequence cap (their prefix-cache hits left out: an upper bound
        # on their tokens). A head that would still be cut into chunks runs eagerly then too: no wait.
        left = self.max_num_batched_tokens - len(chunks) - (seq.num_tokens - cached)
        if left < 0:
            return False
        group, group_tokens = [seq], seq.num_tokens - cached
        room = self.max_num_seqs - len(self.running) - 1
        for other in islice(self.waiting, 1, 1 + max(0, room)):
            if other.num_tokens > left:
                break
            group.append(other)
            group_tokens += other.num_tokens
            left -= other.num_tokens
        if not self.graph_fits(len(chunks) + len(group), len(chunks) + group_tokens):
            return False
        for other in group:
            other.waited_for_graph = True
        self.num_graph_waits += 1
        return True

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for `n` more tokens of `seq`, taken from the youngest request younger than it: parked here (its
        KV taken back) or running (preempted from the back of the running list), or else `seq` itself goes.

        The back holds sequences not yet scheduled this step (running is walked front to back, oldest first), so a
        chunk already in the batch never loses its blocks. False if `seq` itself had to go: at once where all that
        it may take would not make room (a suffix longer than that, beside an older request's KV; taken one by one,
        they all went for nothing, and then waited behind it in the queue)."""
        need = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
        if need > self.bm.num_free_blocks:
            younger = self._takeable_parked(seq) + self.running[self.running.index(seq) + 1:]
            if need > self.bm.num_free_blocks + self._held_only_by(younger):
                self._preempt(seq)
                return False
        while not self.bm.ensure(seq, seq.num_computed_tokens + n):
            parked, running = self._youngest_parked(seq), self.running[-1]
            if parked is not None and parked.age > running.age:
                self._take_back(parked)
                continue
            self._preempt(running)
            if running is seq:
                return False
        return True

    def _room_for(self, seq: Sequence, prefix: list[int], chunk_tokens: int, owed: int, more_free: int = 0) -> bool:
        """Whether the pool takes `seq` now (with `more_free` blocks more free), over `prefix` (cached blocks it takes
        over): its whole prompt, beside the `owed` blocks the running sequences still need. Admitted on their first
        chunk alone, long prompts that could not all finish their prefill together preempted each other (in process
        on the CPU, 24 prompts of ~4,000 tokens into pools of 65,536: 10 preemptions, none with this rule;
        perf/results/kv_admission_cpu_2026-12-05). Where nothing runs here, only what this step computes
        (`chunk_tokens`, the prefix included): a prompt larger than the pool still makes progress; so only where no
        request it may not take from is parked here either (it could not grow, and would start again each time; a
        new request takes from none)."""
        free = self.bm.num_free_blocks + more_free
        if not self.running and not any(s.block_table and not _may_take(seq, s) for s in self.parked.values()):
            return self._admission_cost(prefix, chunk_tokens) <= free
        return self._admission_cost(prefix, seq.num_tokens) + owed <= free

    def _live_blocks(self) -> tuple[set[int], int]:
        """The blocks the requests in the system hold here (a prefix they share counted once, as a model caching
        prefixes holds it), and the blocks they still need for the tokens they hold (running, parked, or waiting
        to run again): what any model holding them all would. New requests not admitted yet are not in it.
        Alone in the system, a new request goes in whatever its size (a prompt no pool holds fails where it does
        not fit)."""
        held: set[int] = set()
        owing = 0
        for s in (*self.running, *self.parked.values(), *(s for s in self.waiting if not s.new_request)):
            held.update(s.block_table)
            owing += self.bm.blocks_needed(s, s.num_tokens)
        return held, owing

    def _admission_cost(self, prefix: list[int], num_tokens: int) -> int:
        new_blocks = max(0, self.bm.blocks_for(num_tokens) - len(prefix))
        return self.bm.cost_of_prefix(prefix) + new_blocks

    def _can_make_room(self, seq: Sequence, prefix: list[int], chunk_tokens: int, owed: int) -> bool:
        """Whether taking back the parked requests younger than `seq`, a request in the system, would make room for
        it: first a bound (their tables' sizes), then the blocks only they hold, outside `prefix` (a block of its own
        cached prefix, freed, it would take again at once: no room)."""
        younger = self._takeable_parked(seq)
        if not younger or not self._room_for(
                seq, prefix, chunk_tokens, owed, sum(len(s.block_table) for s in younger)):
            return False
        return self._room_for(seq, prefix, chunk_tokens, owed, self._held_only_by(younger, set(prefix)))

    def _held_only_by(self, seqs: list[Sequence], but: frozenset[int] | set[int] = frozenset()) -> int:
        """Blocks that releasing `seqs` would free (a block another request shares stays), outside `but`."""
        holds = Counter(b for s in seqs for b in s.block_table)
        return sum(1 for b, k in holds.items() if k == self.bm.ref_count[b] and b not in but)

    def _takeable_parked(self, taker: Sequence) -> list[Sequence]:
        """The requests parked here holding blocks that `taker` may take back."""
        return [s for s in self.parked.values() if s.block_table and _may_take(taker, s)]

    def _youngest_parked(self, taker: Sequence) -> Sequence | None:
        """The youngest request parked here holding blocks that `taker` may take back."""
        return max(self._takeable_parked(taker), key=_AGE, default=None)

    def _reclaim_parked(self, taker: Sequence) -> bool:
        """Free the blocks of the youngest parked request younger than `taker` that holds some (it re-prefills on
        return)."""
        victim = self._youngest_parked(taker)
        if victim is None:
            return False
        self._take_back(victim)
        return True

    def _take_back(self, parked: Sequence) -> None:
        self.bm.release(parked)
        self.num_reclaims += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.status = SeqStatus.WAITING
        self._queue_in_system(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.request_id, None)
        self.bm.release(seq)
        seq.status = SeqStatus.FINISHED
