"""CUDA graphs for the small forward passes that dominate token routing: decode at fixed batch sizes, and short
extends (the suffix a request brings back from another model; short prompts too) at fixed token counts.

A graph is captured per shape `GraphShape(num_seqs, num_tokens)`. A real batch replays the smallest graph it
fits: its sequences fill the first rows, the rest of the rows are padding sequences with no tokens (both
attention kernels skip them on the device), and tokens past the real ones belong to no sequence and write no
KV (slot -1). Each graph holds the whole step on the device: the model, the logits of every sequence's last
token, the greedy token, and the routing policy's tensor work on them (`step_hook`), so one replay plus one
device-to-host copy of its results is a step.

An extend graph is captured twice where the attention backend launches differently for short contexts
(`graph_context_bounds`; the Triton backend: one KV split, no reduce, for contexts of at most 384 tokens): once sized
for any context, once for that bound. The host knows every length when it fills the inputs and replays the graph
of the shortest bound that holds the batch's longest context.

All graphs are captured largest first into one memory pool, so the smaller ones reuse the largest one's
activation memory. Inputs go through static buffers: the host fills pinned mirrors and copies them with two
asynchronous copies (the lengths and indices in one, the block tables in the other); nothing synchronizes
before the replay.

On a CPU (tests under TRITON_INTERPRET=1) nothing is captured: `run` executes the same padded static batch
eagerly, so CI checks the padding and bucket logic against the unpadded path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenrouter.runner.attention import AttentionBackend
from tokenrouter.runner.forward_batch import ForwardBatch, HostBatch, ScheduledChunk
from tokenrouter.runner.model import CausalLM

log = logging.getLogger(__name__)

# Decode batch sizes that get a graph (capped by the config's cuda_graph_max_batch): powers of two up to 8,
# then steps of 8 up to 32 and 16 beyond, so padding wastes at most a quarter of a step's rows.
_DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Extend graphs: token counts in steps of 16 up to 256 (a matmul over M rows costs nearly the same for M within
# one 16-row MMA tile), then of 64: batches past 256 tokens mostly hold a prefill (new prompts, or requests' first
# visits to a model: a prompt and its suffix), and run eagerly they pay ~30 us of host time per kernel launch
# (perf/profile_host.py on an H200: 10-11 ms per step of the 0.6B against 1.9 ms for its graph, 23 ms of
# launches per step of the 32B), while padding up to 63 tokens costs a prefill little. Between 128 and 256 tokens
# are the 32B's steps when many requests return at once (8-13 requests of ~13 tokens at C=16), and there the 32B
# is bound by compute as much as by bandwidth: in steps of 64 such a step paid its padding (H200, 2026-12-05,
# perf/results/large_extend_2026-12-05: 144 tokens 24.4 ms, 160 25.4 ms, 192 28.8 ms). For each token count a
# few sequence counts, so a handful of returning requests does not run the grids of a 64-sequence graph; past
# 128 tokens at most 16 sequences: the extend kernel's grid covers the longest possible suffix of every sequence
# (64 x 512 tokens would be ~50,000 programs per layer, nearly all returning at once), and each graph keeps its
# own [sequences, vocab] float32 logits (39 MB at 64 sequences of Qwen3's vocabulary).
_EXTEND_TOKEN_STEPS = ((256, 16), (1 << 30, 64))  # (up to this many tokens, in steps of)
_EXTEND_SEQS = (4, 16, 64)
_FEW_SEQS = (4, 16)  # for graphs of more than _MANY_SEQS_MAX_TOKENS tokens
_MANY_SEQS_MAX_TOKENS = 128

# A captured graph: its shape and the context bound its attention launch is sized for.
GraphKey = tuple["GraphShape", int]

StepHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True, order=True)
class GraphShape:
    num_tokens: int
    num_seqs: int

    @property
    def has_extend(self) -> bool:
        return self.num_tokens > self.num_seqs


def graph_shapes(max_batch: int, max_tokens: int, max_seqs: int | None = None) -> list[GraphShape]:
    """Decode shapes up to `max_batch` sequences and extend shapes up to `max_tokens` tokens over at most
    `max_seqs` sequences (default: max_batch)."""
    max_seqs = max_batch if max_seqs is None else max_seqs
    shapes = {GraphShape(b, b) for b in _DECODE_SIZES if b <= min(max_batch, max_seqs)}
    for t in extend_token_counts(max_tokens):
        for b in _EXTEND_SEQS if t <= _MANY_SEQS_MAX_TOKENS else _FEW_SEQS:
            shapes.add(GraphShape(t, min(b, t - 1, max_seqs)))
    return sorted(s for s in shapes if s.num_seqs >= 1)


def extend_token_counts(max_tokens: int) -> list[int]:
    """The token counts of the extend graphs, up to `max_tokens`."""
    counts, t = [], 0
    for limit, step in _EXTEND_TOKEN_STEPS:
        while t + step <= min(limit, max_tokens):
            t += step
            counts.append(t)
    return counts


def pick_shape(shapes: list[GraphShape], num_seqs: int, num_tokens: int) -> GraphShape | None:
    """The cheapest captured shape that fits the batch; a pure decode batch only fits decode graphs (they
    launch no extend kernel), any other only extend graphs."""
    decode = num_tokens == num_seqs
    best = None
    for s in shapes:  # sorted by (tokens, seqs): the first fit is the smallest
        if s.has_extend == decode or s.num_tokens < num_tokens or s.num_seqs < num_seqs:
            continue
        best = s
        break
    return best


def fewest_tokens(shapes: list[GraphShape], shape: GraphShape) -> int:
    """The fewest tokens of a batch that replays `shape` (`pick_shape` over `shapes`): more than any smaller
    graph of its kind that holds as many sequences; an extend has at least one sequence of two tokens."""
    below = [s.num_tokens for s in shapes
             if s.has_extend == shape.has_extend and s.num_tokens < shape.num_tokens and s.num_seqs >= shape.num_seqs]
    return max(below, default=1 if shape.has_extend else 0) + 1


@dataclass
class GraphOutputs:
    """Static result tensors of one graph: rows past the batch's real sequences are padding."""

    logits: torch.Tensor  # [B, V] float32
    hidden: torch.Tensor  # [B, H]
    greedy: torch.Tensor  # [B] int64
    step_values: torch.Tensor | None  # [B, ...] from the step hook
    finite: torch.Tensor  # [B] bool: every logit of the row is finite (the subserver fails a row that is not)


class StaticInputs:
    """Device buffers every graph reads its batch from (views of the largest shape), and their pinned host
    mirrors. Layout of the int64 buffer: input_ids, positions, slots (T each), logits rows, kv_lens (B each),
    cu_seqlens (B + 1)."""

    def __init__(self, max_seqs: int, max_tokens: int, max_blocks: int, device: torch.device) -> None:
        self.T, self.B, self.max_blocks = max_tokens, max_seqs, max_blocks
        n = 3 * max_tokens + 3 * max_seqs + 1
        pin = device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.host_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.dev_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        T, B = max_tokens, max_seqs
        self._off = {"ids": 0, "pos": T, "slots": 2 * T, "logits": 3 * T, "kv_lens": 3 * T + B, "cu": 3 * T + 2 * B}
        self._copied: torch.cuda.Event | None = None
        self._host_np = self.host.numpy()  # views sharing the pinned memory
        self._tables_np = self.host_tables.numpy()
        self.clear()

    def _view(self, buf: torch.Tensor, name: str, n: int) -> torch.Tensor:
        o = self._off[name]
        return buf[o : o + n]

    def clear(self) -> None:
        """All padding: no sequence has tokens, no token writes KV."""
        self.host.zero_()
        self._view(self.host, "slots", self.T).fill_(-1)
        self.dev.copy_(self.host)
        self.dev_tables.zero_()

    def batch(self, shape: GraphShape, block_size: int) -> ForwardBatch:
        """The ForwardBatch of views a graph of `shape` is captured on (and replays)."""
        T, B = shape.num_tokens, shape.num_seqs
        return ForwardBatch(
            input_ids=self._view(self.dev, "ids", T),
            positions=self._view(self.dev, "pos", T),
            slot_mapping=self._view(self.dev, "slots", T),
            block_tables=self.dev_tables[:B],
            cu_seqlens_q=self._view(self.dev, "cu", B + 1),
            kv_lens=self._view(self.dev, "kv_lens", B),
            logits_indices=self._view(self.dev, "logits", B),
            block_size=block_size,
        )

    def feed(self, tokens: torch.Tensor) -> None:
        """The first input ids from a device tensor (a step whose tokens the host does not have yet)."""
        self._view(self.dev, "ids", len(tokens)).copy_(tokens)

    def fill(self, chunks: list[ScheduledChunk], shape: GraphShape, block_size: int) -> int:
        """Write the batch into the host mirrors (padded to `shape`) and start the copies to the device; returns
        the batch's longest context (cached + new tokens of its longest sequence)."""
        if self._copied is not None:
            # The previous step's copies read the mirrors asynchronously; they are long done when the caller
            # synchronized on that step's results, or, for a step launched ahead, on the results of the step
            # before it (queued behind those copies' predecessors), so this rarely waits.
            self._copied.synchronize()
        T, B = shape.num_tokens, shape.num_seqs
        h = HostBatch.from_chunks(chunks, block_size)  # every chunk samples: one logits row per sequence
        for i, c in enumerate(chunks):
            self._tables_np[i, : len(c.seq.block_table)] = c.seq.block_table
        pad_t, pad_b = T - len(h.input_ids), B - len(chunks)
        # Padding: tokens of no sequence (position 0, no KV write); sequences of no tokens (logits row 0).
        ids = h.input_ids + [0] * pad_t
        pos = h.positions + [0] * pad_t
        slots = h.slot_mapping + [-1] * pad_t
        rows = h.logits_indices + [0] * pad_b
        kv_lens = h.kv_lens + [0] * pad_b
        cu = h.cu_seqlens_q + [h.cu_seqlens_q[-1]] * pad_b
        # Through numpy views of the pinned mirrors: a list lands in one C loop, with no torch op per field (the
        # host's share of a small model's step is mostly this function).
        host, off = self._host_np, self._off
        for name, vals in (("ids", ids), ("pos", pos), ("slots", slots), ("logits", rows), ("kv_lens", kv_lens),
                           ("cu", cu)):  # fmt: skip
            host[off[name] : off[name] + len(vals)] = vals
        self.dev.copy_(self.host, non_blocking=True)
        # Only the rows this batch uses (whole rows: a contiguous pinned copy stays asynchronous); entries past
        # a sequence's length are stale but never read.
        if chunks:
            self.dev_tables[: len(chunks)].copy_(self.host_tables[: len(chunks)], non_blocking=True)
        if self.dev.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.dev.device))  # named: no current-device lookup
        return max(h.kv_lens, default=0)


class CudaGraphRunner:
    """Captures and replays the step graphs of one model (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        shapes: list[GraphShape],
        step_hook: StepHook | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot run in a CUDA graph")
        if not shapes:
            raise ValueError("no CUDA graph shapes to capture")
        self.model, self.backend, self.device = model, backend, device
        self.block_size, self.max_model_len = block_size, max_model_len
        # Context bounds an extend graph is captured for, longest first (decode graphs: max_model_len only). The
        # attention launch is sized for the bound; a batch replays the graph of the shortest bound that holds its
        # longest context (the host knows it when it fills the inputs).
        self.bounds = [max_model_len] + sorted(
            (b for b in backend.graph_context_bounds(max_model_len) if 0 < b < max_model_len), reverse=True)
        self.shapes = sorted(shapes)
        self.step_hook = step_hook
        # Captured on the stream the model steps on: its kernels keep that stream's priority, and (a green
        # context's stream) its SM partition.
        self.stream = stream
        max_blocks = -(-max_model_len // block_size)
        self.inputs = StaticInputs(
            max(s.num_seqs for s in shapes), max(s.num_tokens for s in shapes), max_blocks, device
        )
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, GraphOutputs] = {}
        self.batches: dict[GraphKey, ForwardBatch] = {}
        self.num_replays = 0
        self.last_bound = 0  # the context bound of the last run's graph
        # time.monotonic() when the last run's inputs were ready and its replay was called: the host's preparation
        # ends here; what `run`'s caller waits for after it is the launch, and the GIL back from other threads.
        self.replayed_at = 0.0

    def _step(self, batch: ForwardBatch) -> GraphOutputs:
        hidden = self.model(batch, self.backend)
        last = hidden[batch.logits_indices]
        logits = self.model.compute_logits(last)
        greedy = logits.argmax(dim=-1)
        values = self.step_hook(logits, last, greedy) if self.step_hook is not None else None
        return GraphOutputs(logits, last, greedy, values, logits.isfinite().all(dim=-1))

    def _batch(self, key: GraphKey, fresh: bool = False) -> ForwardBatch:
        """The static batch of `key` (a shape and a context bound); `fresh` renews its attention state, so that
        scratch the backend keeps there is allocated again (inside a capture: from the shared pool, not held by
        each graph)."""
        if key not in self.batches or fresh:
            shape, bound = key
            batch = self.inputs.batch(shape, self.block_size)
            batch.attn_state = self.backend.graph_state(
                shape.num_seqs, shape.num_tokens, shape.has_extend, bound,
                min_tokens=fewest_tokens(self.shapes, shape),
            )
            self.batches[key] = batch
        return self.batches[key]

    def keys(self) -> list[GraphKey]:
        """Every (shape, context bound) a graph is captured for, largest first."""
        return [(shape, bound) for shape in sorted(self.shapes, reverse=True)
                for bound in (self.bounds if shape.has_extend else self.bounds[:1])]

    def load(self, chunks: list[ScheduledChunk], shape: GraphShape) -> GraphKey:
        """Fill the static inputs with `chunks` (padded to `shape`); the key of the graph that runs them."""
        return shape, self.bound_for(shape, self.inputs.fill(chunks, shape, self.block_size))

    def bound_for(self, shape: GraphShape, context: int) -> int:
        """The context bound of the graph of `shape` that a batch whose longest context is `context` replays."""
        if not shape.has_extend:
            return self.max_model_len
        return min((b for b in self.bounds if b >= context), default=self.max_model_len)

    @torch.inference_mode()
    def capture(self, context: Callable[[GraphShape], contextlib.AbstractContextManager] | None = None) -> None:
        """Capture every shape, largest first, into one memory pool (CUDA only). `context(shape)`: entered around
        a shape's warm-up and capture (the runner's cuBLAS settings for it)."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = self.stream if self.stream is not None else torch.cuda.Stream(self.device)
        for key in self.keys():
            shape = key[0]
            with context(shape) if context is not None else contextlib.nullcontext():
                batch = self._batch(key)
                self.inputs.clear()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._step(batch)  # warm-up on the side stream: compiles the Triton kernels, sizes cuBLAS
                torch.cuda.current_stream(self.device).wait_stream(stream)
                batch = self._batch(key, fresh=True)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[key] = self._step(batch)
            self.graphs[key] = graph
            # The graph keeps raw addresses; dropping the batch's attention scratch returns it to the shared pool
            # for the next captures (its content is dead between replays). Only the outputs stay owned.
            del self.batches[key], batch
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - t0)

    def fits(self, chunks: list[ScheduledChunk]) -> GraphShape | None:
        """The shape to replay for this batch, or None when it must run eagerly: too big, or a chunk of a
        longer prompt that does not sample (only whole steps, each sequence sampling once, are captured)."""
        if not all(c.samples for c in chunks):
            return None
        return pick_shape(self.shapes, len(chunks), sum(c.num_new_tokens for c in chunks))

    def holds(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether a step of `num_seqs` sequences and `num_tokens` tokens, each sequence sampling, replays a
        graph (the scheduler's graph-aware admission asks)."""
        return pick_shape(self.shapes, num_seqs, num_tokens) is not None

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], shape: GraphShape, fed: torch.Tensor | None = None) -> GraphOutputs:
        """Replay `shape` for `chunks`; the returned tensors are the graph's own buffers, valid until the next
        run (callers copy what they keep). Rows are cut to the real sequences. `fed`: the input tokens, one per
        chunk of one token, on the device (copied in after the host's placeholders, in stream order)."""
        key = self.load(chunks, shape)
        if fed is not None:
            self.inputs.feed(fed[: len(chunks)])
        self.replayed_at = time.monotonic()
        if key in self.graphs:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            # No capture (CPU): the same padded static batch, executed directly.
            out = self._step(self._batch(key))
        self.last_bound = key[1]
        self.num_replays += 1
        n = len(chunks)
        values = None if out.step_values is None else out.step_values[:n]
        return GraphOutputs(out.logits[:n], out.hidden[:n], out.greedy[:n], values, out.finite[:n])
