"""Owns one model on one device: weights, the paged KV pool, and the forward pass of a scheduled batch."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from tokenrouter.config import ModelConfig
from tokenrouter.runner.arch import ArchConfig
from tokenrouter.runner.attention import get_backend
from tokenrouter.runner.cuda_graph import CudaGraphRunner, GraphShape, StepHook, graph_shapes
from tokenrouter.runner.forward_batch import ForwardBatch, HostBatch, ScheduledChunk
from tokenrouter.runner.green import green_stream
from tokenrouter.runner.model import CausalLM
from tokenrouter.runner.weights import init_dummy, load_safetensors

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch.cuda.Stream priorities: lower is more urgent (CUDA clamps a value into the device's range).
_STREAM_PRIORITIES = {"normal": 0, "high": -1}


def _attention_for(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


@dataclass
class ForwardOutput:
    """Per sampling sequence (rows in batch order of the chunks that sample). After a CUDA-graph replay these
    are the graph's own buffers: valid until the next forward."""

    logits: torch.Tensor  # [S, vocab] float32
    hidden: torch.Tensor  # [S, hidden] final-norm hidden state of the last token
    greedy: torch.Tensor  # [S] int64 argmax of the logits
    step_values: torch.Tensor | None = None  # [S, ...] the step hook's output on (logits, hidden, greedy)
    finite: torch.Tensor | None = None  # [S] bool: every logit of the row is finite (inside the graph when one ran)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, default_kv_tokens: int) -> None:
        self.cfg = cfg
        self.arch = ArchConfig.from_dir(cfg.path)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"model {cfg.name!r} asks for {cfg.device} but CUDA is not available")
        self.dtype = _DTYPES[cfg.dtype]
        self.max_model_len = cfg.max_model_len or self.arch.max_position_embeddings
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.attn_backend = get_backend(_attention_for(cfg.attention, self.device))
        # The Triton attention path also gets the fused Triton kernels between the matmuls.
        self.model = self._load_model(fused=self.attn_backend.name == "triton")
        self.skinny_gemm = cfg.skinny_gemm and self.model.use_skinny_gemm(self.device)
        if self.skinny_gemm:
            log.info("model %s: skinny matmuls for batches of up to %d tokens", cfg.name, self.model.skinny_max_m)
        elif cfg.skinny_gemm and self.device.type == "cuda":
            log.info("model %s: matmuls on cuBLAS: %s", cfg.name, self.model.skinny_off)
        # What this model's weights took, whatever else shares the device (other models, other processes).
        self.weight_bytes = (torch.cuda.memory_allocated(self.device) - before) if self.device.type == "cuda" else 0
        self.block_size = cfg.block_size
        self.num_blocks = self._num_kv_blocks(default_kv_tokens)
        self._allocate_kv_cache()
        # The pool bounds a single sequence's length too.
        self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)
        self.num_forwarded_tokens = 0
        # time.monotonic() when the last forward's inputs were ready and its kernels (or graph) started going to the
        # GPU: the end of the host's preparation, for the timeline (engine/timeline.py).
        self.submitted_at = 0.0
        self.step_hook: StepHook | None = None
        self.graphs: CudaGraphRunner | None = None
        # Each model steps on its own stream: models sharing a GPU (threads of one process) then overlap on
        # the device instead of queueing behind each other on the default stream, and a step's synchronization
        # waits for this model's work only.
        self.stream_priority = _STREAM_PRIORITIES[cfg.stream_priority]
        self.green_context = None  # holds the SM partition alive while its stream is in use
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            if cfg.num_sms:
                self.green_context, self.stream = green_stream(self.device, cfg.num_sms)
            else:
                self.stream = torch.cuda.Stream(self.device, priority=self.stream_priority)

    def stream_context(self) -> contextlib.AbstractContextManager:
        """Run a step's device work (forward, sampling, policy tensors, copies to the host) inside this."""
        return OnStream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _load_model(self, fused: bool) -> CausalLM:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(self.arch, max_positions=self.max_model_len, fused=fused)
        finally:
            torch.set_default_dtype(prev)
        # RoPE tables stay float32 whatever the weights' dtype.
        rope = model.model.rotary_emb
        rope.cos, rope.sin = rope.cos.float(), rope.sin.float()
        if self.cfg.load_format == "dummy":
            init_dummy(model, self.cfg.seed)
        else:
            load_safetensors(model, self.cfg.path)
        return model.eval()

    def _bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * a.num_layers * self.cfg.block_size * a.num_kv_heads * a.head_dim * elem

    def _num_kv_blocks(self, default_tokens: int) -> int:
        if self.cfg.kv_cache_tokens is not None:
            return self.cfg.kv_cache_tokens // self.cfg.block_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # A fraction of the whole card for this model (weights + KV); models sharing one GPU split it
            # by giving fractions that sum to <= 1. Keep headroom for activations and CUDA graphs.
            budget = min(free - 2 * 2**30, int(total * self.cfg.kv_memory_fraction) - self.weight_bytes)
            blocks = budget // self._bytes_per_block()
            if blocks < 1:
                raise RuntimeError(f"model {self.cfg.name!r}: no GPU memory left for a KV cache")
            return int(blocks)
        return max(1, default_tokens // self.cfg.block_size)

    def _allocate_kv_cache(self) -> None:
        a = self.arch
        slots = self.num_blocks * self.block_size
        # [layers, 2, slots, Hkv, D]: one allocation, per-layer views bound into the attention modules.
        self.kv_cache = torch.zeros(
            a.num_layers, 2, slots, a.num_kv_heads, a.head_dim, dtype=self.dtype, device=self.device
        )
        self.model.bind_kv_cache(list(self.kv_cache[:, 0]), list(self.kv_cache[:, 1]))
        mib = self.kv_cache.numel() * self.kv_cache.element_size() / 2**20
        log.info("model %s: %d KV blocks of %d tokens (%.1f MiB)", self.cfg.name, self.num_blocks, self.block_size, mib)

    def prepare(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        bs = self.block_size
        h = HostBatch.from_chunks(chunks, bs)
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = [b for c in chunks for b in c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table))]
        # Two host-to-device copies (one per dtype) instead of seven; views split them on the device.
        B = len(chunks)
        # Every view starts on a 16-byte boundary: Triton compiles a kernel variant per pointer alignment, so
        # views at batch-dependent offsets would compile new variants on requests (seconds each).
        i64, (ids, pos, slots, logits) = _packed([h.input_ids, h.positions, h.slot_mapping, h.logits_indices],
                                                 torch.int64, self.device)
        i32, (cu, kv, tab) = _packed([h.cu_seqlens_q, h.kv_lens, tables], torch.int32, self.device)
        return ForwardBatch(
            input_ids=i64[ids],
            positions=i64[pos],
            slot_mapping=i64[slots],
            logits_indices=i64[logits],
            cu_seqlens_q=i32[cu],
            kv_lens=i32[kv],
            block_tables=i32[tab].view(B, max_blocks),
            q_lens_cpu=[b - a for a, b in zip(h.cu_seqlens_q, h.cu_seqlens_q[1:])],
            kv_lens_cpu=h.kv_lens,
            block_size=bs,
        )

    def precompile(self, chunks: list[ScheduledChunk]) -> int:
        """Compile every attention kernel variant a step can launch, for batches laid out like `chunks`'s,
        without running anything (engine/warmup.py calls it before serving); returns the variants' count."""
        batch = self.prepare(chunks)
        a = self.arch
        q = torch.empty(batch.input_ids.shape[0], a.num_heads, a.head_dim, dtype=self.dtype,
                        device=self.device)
        return self.attn_backend.precompile(q, self.kv_cache[0, 0], self.kv_cache[0, 1], batch, a.head_dim**-0.5)

    @property
    def cuda_graphs_possible(self) -> bool:
        cfg = self.cfg
        return (
            self.device.type == "cuda"
            and self.attn_backend.supports_cuda_graphs
            and not cfg.enforce_eager
            and (cfg.cuda_graph_max_batch > 0 or cfg.cuda_graph_max_tokens > 0)
        )

    def setup_step(self, step_hook: StepHook | None = None, capture: bool = True) -> None:
        """Set the tensor work that follows every forward pass (the routing policy's), then capture the CUDA
        graphs that include it, when the device and config allow. Call once, after the policy is built.

        `capture=False` on the CPU builds the graph runner without capturing (tests of the padded path)."""
        self.step_hook = step_hook
        if self.stream is not None:
            # The model's stream does not wait for the default stream by itself: order the steps after the
            # set-up work queued there (weight init, the KV pool's zero fill, the policy's network).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not (self.cuda_graphs_possible or (not capture and self.attn_backend.supports_cuda_graphs)):
            return
        cfg = self.cfg
        shapes = graph_shapes(cfg.cuda_graph_max_batch, cfg.cuda_graph_max_tokens, cfg.max_num_seqs)
        if not shapes:
            return
        self.graphs = CudaGraphRunner(
            self.model, self.attn_backend, self.device, self.block_size, self.max_model_len, shapes, step_hook,
            stream=self.stream,
        )
        if capture:
            carve = cfg.cublas_sm_carveout
            with carved_cublas(self.device, carve):
                pass  # a carve-out this torch or GPU cannot give fails here, before the first capture
            self.graphs.capture(lambda shape: carved_cublas(self.device, carve if carves(shape) else 0))

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk], eager: bool = False,
                fed: torch.Tensor | None = None) -> ForwardOutput:
        """Run one mixed batch; KV of the new tokens is written to the pool; counters are NOT advanced.
        `eager`: not through a CUDA graph even where one fits (the warm-up times both ways).
        `fed`: the input tokens on the device, one per chunk (a step launched before the tokens reach the host:
        every chunk is one token, whose id the host does not have yet)."""
        if fed is not None and any(c.num_new_tokens != 1 for c in chunks):
            raise ValueError("fed tokens need chunks of one token each")
        for c in chunks:
            c.seq.num_forwarded_tokens += c.num_new_tokens
        self.num_forwarded_tokens += sum(c.num_new_tokens for c in chunks)
        shape = self.graphs.fits(chunks) if self.graphs is not None and not eager else None
        if shape is not None:
            out = self.graphs.run(chunks, shape, fed)
            self.submitted_at = self.graphs.replayed_at
            return ForwardOutput(out.logits, out.hidden, out.greedy, out.step_values, out.finite)
        batch = self.prepare(chunks)
        if fed is not None:
            batch.input_ids[: len(chunks)].copy_(fed[: len(chunks)])
        self.attn_backend.prepare(batch)
        self.submitted_at = time.monotonic()
        hidden = self.model(batch, self.attn_backend)
        last = hidden[batch.logits_indices]
        logits = self.model.compute_logits(last)
        greedy = logits.argmax(dim=-1)
        values = None
        if self.step_hook is not None and len(last):
            values = self.step_hook(logits, last, greedy)
        return ForwardOutput(logits, last, greedy, values, logits.isfinite().all(dim=-1))


# The carve-out applies to graphs of up to this many tokens: their matmuls are bound by memory bandwidth, which
# 84 of an H200's 132 SMs still draw (the 32B's decode and short extends ran 2-10 % faster carved), where a
# prefill's are bound by compute (the 32B's 4 x 100-token prefill graph: 50.0 ms on every SM, 70.0 carved;
# perf/results/sm_carveout_h200_2026-12-04). The 32B alone on an H200 by graph size (2026-12-05,
# perf/results/large_extend_2026-12-05), carved 48 against every SM: 112 tokens 21.5 vs 21.9 ms, 128 tokens 23.9
# vs 22.0: compute starts to bind between the two.
CARVEOUT_MAX_TOKENS = 112


def carves(shape: GraphShape) -> bool:
    """Whether `cublas_sm_carveout` applies to the graph of `shape`."""
    return shape.num_tokens <= CARVEOUT_MAX_TOKENS


@contextlib.contextmanager
def carved_cublas(device: torch.device, carveout: int):
    """torch's matmuls inside go through cuBLASLt told to leave `carveout` SMs of `device` out
    (`ModelConfig.cublas_sm_carveout`); both settings are torch's process-wide state, restored on exit. Only
    cuBLASLt reads the carve-out (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), hence the library switch."""
    if not carveout or device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if carveout >= total:
        raise RuntimeError(f"cublas_sm_carveout: {carveout}: the GPU has only {total} SMs")
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):  # experimental: torch 2.11 and 2.13 have it
        raise RuntimeError(f"cublas_sm_carveout: {carveout}: this torch ({torch.__version__}) has no SM carve-out; "
                           "set cublas_sm_carveout: 0")
    prev_lib = torch.backends.cuda.preferred_blas_library()
    prev_carveout = getattr(torch._C, "_get_sm_carveout_experimental", lambda: None)()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except RuntimeError as exc:  # a torch built without cuBLASLt
        raise RuntimeError(f"cublas_sm_carveout: {carveout}: {exc}; set cublas_sm_carveout: 0") from exc
    try:
        torch._C._set_sm_carveout_experimental(carveout)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(prev_carveout)  # None (no carve-out) is taken by 2.11 and 2.13
        torch.backends.cuda.preferred_blas_library(prev_lib)


class OnStream:
    """`torch.cuda.stream(stream)` for a step, at a fraction of its host cost: the device is named by index, so
    no lookup of the current device runs (torch's context asks for it twice per use, each through an NVML
    availability check that reads the environment: ~0.1 ms of a small model's step under cProfile on the H200,
    perf/profile_loop.py), and a thread already on the stream switches nothing. A thread whose current device is
    another one gets torch's context, which also restores that device."""

    __slots__ = ("stream", "index", "prev", "other")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream, self.index = stream, stream.device_index
        self.prev: torch.cuda.Stream | None = None
        self.other: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> None:
        if torch.cuda.current_device() != self.index:
            self.other = torch.cuda.stream(self.stream)
            self.other.__enter__()
            return
        prev = torch.cuda.current_stream(self.index)
        self.prev = None if prev == self.stream else prev
        if self.prev is not None:
            torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        if self.other is not None:
            self.other.__exit__(*exc)
        elif self.prev is not None:
            torch.cuda.set_stream(self.prev)


def _packed(segments: list[list[int]], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[slice]]:
    """The segments in one host-to-device copy, each starting on a 16-byte boundary; their slices."""
    per = 16 // dtype.itemsize
    flat: list[int] = []
    where = []
    for seg in segments:
        where.append(slice(len(flat), len(flat) + len(seg)))
        flat += seg
        flat += [0] * (-len(flat) % per)
    return torch.tensor(flat, dtype=dtype).to(device, non_blocking=True), where
