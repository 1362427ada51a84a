"""The Triton attention kernels against the torch reference, on the CPU through Triton's interpreter.

CI has no GPU, so TRITON_INTERPRET=1 must be in effect when triton is imported (triton decorates its own
standard library, tl.max, tl.sum, ..., at import, as compiled or interpreted functions). Shapes are tiny and tile
sizes small so that tile edges, KV splits, partial pages and GQA packing are all crossed cheaply. On a GPU machine
`TRITON_INTERPRET=0 pytest tests/test_triton_attention.py` runs the same checks compiled, on CUDA tensors.
"""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET, compile_for_hopper  # first: before anything here imports triton
# isort: on

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the Triton attention backend cannot be tested")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tokenrouter.runner import triton_attention as ta  # noqa: E402
from tokenrouter.runner.attention import TorchAttention  # noqa: E402
from tokenrouter.runner.forward_batch import ForwardBatch  # noqa: E402
from tokenrouter.runner.triton_attention import (  # noqa: E402
    TritonAttention,
    _extend_grid_work,
    _extend_launch_bound,
    _extend_num_splits,
)

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

RTOL = 1e-3
_TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q", "kv_lens", "logits_indices")


def make_case(
    lens: list[tuple[int, int]],  # (q_len, kv_len) per sequence
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """A random paged pool with shuffled block tables; slots no sequence owns hold NaN to catch stray reads."""
    g = torch.Generator().manual_seed(seed)
    nblks = [-(-kv // block_size) for _, kv in lens]
    num_blocks = sum(nblks) + 3  # spare blocks stay unowned (poisoned)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    num_slots = num_blocks * block_size
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)  # [num_slots, Hkv, D]
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    owned = torch.zeros(num_slots, dtype=torch.bool)
    max_blocks = max(nblks)
    tables, slots, positions = [], [], []
    for (q_len, kv_len), n in zip(lens, nblks):
        blocks, perm = perm[:n], perm[n:]
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(kv_len)]
        owned[seq_slots] = True
        slots.extend(seq_slots[kv_len - q_len :])
        positions.extend(range(kv_len - q_len, kv_len))
        tables.append(blocks + [0] * (max_blocks - n))  # padded with 0 like the runner does
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    q_lens = [ql for ql, _ in lens]
    kv_lens = [kl for _, kl in lens]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    q = torch.randn(T, num_heads, head_dim, generator=g)  # [T, Hq, D]
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),  # [B, max_blocks]
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),  # [B + 1]
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),  # [B]
        logits_indices=torch.tensor([c - 1 for c in cu[1:]], dtype=torch.int64),
        q_lens_cpu=q_lens,
        kv_lens_cpu=kv_lens,
        block_size=block_size,
    )
    batch = dataclasses.replace(batch, **{f: getattr(batch, f).to(DEVICE) for f in _TENSOR_FIELDS})
    return q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), batch


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """TorchAttention in float32 on its own copy of the batch (prepare overwrites attn_state)."""
    b = dataclasses.replace(batch, attn_state=None)
    ref = TorchAttention()
    ref.prepare(b)
    return ref.forward(q.float(), k_cache.float(), v_cache.float(), b, q.shape[-1] ** -0.5)


def run_triton(
    backend: TritonAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    b = dataclasses.replace(batch, attn_state=None)
    backend.prepare(b)
    return backend.forward(q, k_cache, v_cache, b, q.shape[-1] ** -0.5)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# (block_size, Hq, Hkv, head_dim): page sizes 4 and 16, GQA ratios 1, 2, 4 (and 3, which does not divide the
# row tile), head_dim 16 and 64 (and 24, which pads to 32).
SHAPES = [
    (4, 2, 2, 16),
    (16, 4, 2, 64),
    (4, 8, 2, 16),
    (16, 4, 1, 16),
    (4, 6, 2, 24),
]


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_decode_matches_torch(shape: tuple[int, int, int, int], num_splits: int | None) -> None:
    block_size, hq, hkv, d = shape
    # kv_len 1, single partial page, exact page multiples and lengths spanning several key tiles and splits.
    lens = [(1, kv) for kv in (1, 5, 16, 37, 70)]
    q, k, v, batch = make_case(lens, block_size, hq, hkv, d, seed=hash(shape) % 1000)
    backend = TritonAttention(decode_block_n=16, num_kv_splits=num_splits)
    out = run_triton(backend, q, k, v, batch)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, reference(q, k, v, batch)) <= RTOL


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_matches_torch(shape: tuple[int, int, int, int], num_splits: int) -> None:
    block_size, hq, hkv, d = shape
    lens = [
        (7, 7),  # pure prefill shorter than one key tile
        (1, 9),  # a decode row inside a mixed batch
        (5, 23),  # extend over a cached prefix that ends mid-page
        (21, 21),  # pure prefill over several query and key tiles
        (3, 40),  # short extend, long prefix
        (18, 35),  # query tiles whose causal frontier crosses key tiles
    ]
    q, k, v, batch = make_case(lens, block_size, hq, hkv, d, seed=hash(shape) % 1000 + 1)
    # The decode rows of this mixed batch go to the decode kernel while the rest go to the extend kernel. With
    # KV splits, late query rows of (18, 35) see no key in some splits (the reduce must drop those).
    backend = TritonAttention(extend_block_m=16, extend_block_n=16, decode_block_n=16, num_kv_splits=num_splits)
    out = run_triton(backend, q, k, v, batch)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, reference(q, k, v, batch)) <= RTOL


def test_decode_launches_its_splits_rounded_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode path asks for the count rounded down: with 4 "SMs" (16 programs), 3 sequences x 2 KV heads
    launch 2 splits (12 programs), not 3 (18, a partial last round); the output equals torch's."""
    q, k, v, batch = make_case([(1, 600), (1, 700), (1, 520)], 16, 4, 2, 16, seed=12)
    backend = TritonAttention(decode_block_n=16)
    backend._num_sms[q.device] = 4  # (on a GPU too)
    launched = []
    real_scratch = ta._split_scratch
    monkeypatch.setattr(ta, "_split_scratch", lambda *a: (launched.append(a[4]), real_scratch(*a))[1])
    assert rel_err(run_triton(backend, q, k, v, batch), reference(q, k, v, batch)) <= RTOL
    assert launched == [2]


def test_default_tiles_and_split_heuristic() -> None:
    """The GPU defaults (big tiles, heuristic splits) also give the right answer."""
    backend = TritonAttention()
    q, k, v, batch = make_case([(1, 300), (1, 600)], 16, 4, 2, 64, seed=7)
    if INTERPRET:
        assert backend._pick_num_splits(q.device, 2, 2, 600) == 3  # 4 "SMs" on the CPU: 16 programs wanted
    assert rel_err(run_triton(backend, q, k, v, batch), reference(q, k, v, batch)) <= RTOL
    q, k, v, batch = make_case([(30, 30), (9, 50), (1, 12)], 16, 4, 2, 64, seed=8)
    assert rel_err(run_triton(backend, q, k, v, batch), reference(q, k, v, batch)) <= RTOL


def test_split_heuristic() -> None:
    backend = TritonAttention()
    dev = torch.device("cuda", 0)
    backend._num_sms[dev] = 132  # an H100/H200
    for round_down in (False, True):
        assert backend._pick_num_splits(dev, 1, 8, 32768, round_down) == 64  # one long sequence: as far as allowed
        assert backend._pick_num_splits(dev, 1, 8, 300, round_down) == 2  # short context: splits would be too small
        assert backend._pick_num_splits(dev, 128, 8, 32768, round_down) == 1  # a big batch already fills the GPU
    # Decode: no more programs than the target (4 a SM), 528 // (sequences x 8 KV heads), not rounded up into a
    # partial last round; eager extends round up.
    assert [backend._pick_num_splits(dev, n, 8, 8192, True) for n in (4, 8, 16, 32, 64)] == [16, 8, 4, 2, 1]
    assert [backend._pick_num_splits(dev, n, 8, 8192) for n in (4, 8, 16, 32, 64)] == [17, 9, 5, 3, 2]


@triton.jit
def _split_rule_kernel(args_ptr, out_ptr, Q_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_extend_num_splits` for one case per program."""
    a = args_ptr + tl.program_id(0) * 6
    used = _extend_num_splits(tl.load(a), tl.load(a + 1), tl.load(a + 2), tl.load(a + 3), tl.load(a + 4),
                              tl.load(a + 5), Q_PER_PROG, BLOCK_N)  # fmt: skip
    tl.store(out_ptr + tl.program_id(0), used)


def extend_splits(cases: list[tuple[int, int, int]], q_per_prog: int, kv_heads: int = 8, max_splits: int = 16,
                  target: int = 2 * 132, block_n: int = 64) -> list[int]:
    """The KV splits each (q_len, kv_len, batch tokens) case uses, as the extend kernel decides on the device."""
    args = torch.tensor([[q, kv, t, kv_heads, max_splits, target] for q, kv, t in cases], dtype=torch.int32,
                        device=DEVICE)  # fmt: skip
    out = torch.empty(len(cases), dtype=torch.int32, device=DEVICE)
    _split_rule_kernel[(len(cases),)](args, out, Q_PER_PROG=q_per_prog, BLOCK_N=block_n)
    return out.tolist()


def test_extend_split_rule_fills_the_gpu_with_the_batch_it_sees() -> None:
    """On an H200 (target 2 programs x 132 SMs), a batch of requests returning with 10 tokens over a 1k context:
    fewer splits the more sequences the batch has (estimated on the device as batch tokens / q_len), never
    more than the launch has or than the context has key tiles."""
    # Qwen3-32B: 8 query heads per KV head in 64-row tiles -> 8 queries per program, two programs per suffix.
    batches = [(10, 1034, 10 * n) for n in (1, 4, 8, 12)]
    assert extend_splits(batches, q_per_prog=8) == [16, 4, 2, 1]
    # Qwen3-0.6B: 2 query heads per KV head -> 32 queries per program, one program per suffix.
    assert extend_splits(batches, q_per_prog=32) == [16, 8, 4, 2]
    # A short context has fewer key tiles than splits; the launch's split count caps the rest.
    assert extend_splits([(10, 200, 10), (10, 8192, 10)], q_per_prog=8, max_splits=5) == [4, 5]
    # A long prompt's chunk fills the GPU alone; a lone token in a big mixed batch still gets one split.
    assert extend_splits([(2048, 2048, 2048), (2, 512, 2000)], q_per_prog=8) == [1, 1]


@pytest.mark.parametrize("q_per_prog", [8, 32])
def test_extend_launch_bound_covers_every_sequence(q_per_prog: int) -> None:
    """The splits a graph launches for batches of at least `tokens` new tokens (`_extend_launch_bound`): no
    sequence of such a batch uses more on the device."""
    target, kv_heads = 2 * 132, 8
    cases = [(q, 4096, t) for t in range(2, 130, 3) for q in range(2, t + 1, max(1, t // 12))]
    used = extend_splits(cases, q_per_prog=q_per_prog, kv_heads=kv_heads, max_splits=1 << 10, target=target)
    for (q, _, t), u in zip(cases, used):
        assert u <= _extend_launch_bound(target, kv_heads, t, q_per_prog), (q, t, u)


@pytest.mark.parametrize("q_per_prog", [8, 32])
def test_extend_grid_covers_every_sequences_work(q_per_prog: int) -> None:
    """A graph's split extend launches _extend_grid_work programs per (sequence, KV head): every sequence of a
    batch it replays (at least `t` tokens, a suffix of q <= t) has no more (query tile, split) pairs than that,
    and for the 32B's short extends on an H200 that is ~2.5x fewer programs than its longest suffix times the
    launched splits."""
    target, kv_heads = 2 * 132, 8
    for t in range(2, 130, 3):
        splits = _extend_launch_bound(target, kv_heads, t, q_per_prog)
        max_m = triton.cdiv(t, q_per_prog)
        work = _extend_grid_work(max_m, splits, target, kv_heads)
        assert work <= max_m * splits
        cases = [(q, 4096, t) for q in range(2, t + 1, max(1, t // 12))]
        used = extend_splits(cases, q_per_prog=q_per_prog, kv_heads=kv_heads, max_splits=splits, target=target)
        for (q, _, _), u in zip(cases, used):
            assert triton.cdiv(q, q_per_prog) * u <= work, (q, t, u, work)
    # 64 tokens of the 32B (8 queries a tile): 11 splits launched, 33 pairs at most instead of 88.
    assert (_extend_launch_bound(target, kv_heads, 49, 8), _extend_grid_work(8, 11, target, kv_heads)) == (11, 33)
    # Eager launches use every split they launch: the whole product.
    assert _extend_grid_work(8, 11, ta._EVERY_SPLIT, kv_heads) == 88


@pytest.mark.parametrize("padded", [False, True])
def test_extend_splits_decided_per_sequence_match_torch(monkeypatch: pytest.MonkeyPatch, padded: bool) -> None:
    """In a CUDA graph's launch (lengths unknown on the host), one sequence splits its keys and another does not:
    the reduce merges exactly the splits each sequence's programs wrote. On the CPU (4 "SMs", 8 programs
    wanted): the 8-token suffix is alone in its estimate (2 programs -> 4 splits), the 2-token one is one of five
    (10 programs -> 1 split); the decode row goes to the decode kernel. The launch has 4 programs per (sequence,
    KV head), not 2 query tiles x 4 splits: the 8-token suffix's 4 splits take them all. `padded`: laid out as a
    graph replays it, with a padding sequence (no tokens) and padding tokens (NaN queries) past every sequence,
    which no kernel may touch: their output rows must keep what the output held, even with the lengths' buffers
    poisoned past their end (a program that took a padding token for a sequence would read them and merge NaN
    scratch into its row)."""
    q, k, v, batch = make_case([(8, 200), (2, 40), (1, 60)], 16, 4, 2, 16, seed=5)
    real = q.shape[0]
    if padded:
        pad = 5
        q = torch.cat([q, torch.full_like(q[:pad], float("nan"))])
        cu = batch.cu_seqlens_q.long()
        # Views whose storage goes on past the batch: after the padding sequence, an 11-token "sequence" over a
        # 4k context, which would split.
        cu_poisoned = torch.cat([cu, cu[-1:], cu[-1:] + 11])
        kv_poisoned = torch.cat([batch.kv_lens.long(), cu[:1] * 0, cu[:1] * 0 + 4096])
        batch = dataclasses.replace(
            batch, cu_seqlens_q=cu_poisoned[:-1], kv_lens=kv_poisoned[:-1],
            block_tables=torch.cat([batch.block_tables, batch.block_tables[:1] * 0]))
        sentinel = 7.0
        real_empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(sentinel))
    backend = TritonAttention(decode_block_n=16, extend_block_m=16, extend_block_n=16)
    # Split scratch full of NaN: a partial the reduce read without the extend kernel having written it shows.
    real_scratch = ta._split_scratch
    monkeypatch.setattr(ta, "_split_scratch", lambda *a: tuple(t.fill_(float("nan")) for t in real_scratch(*a)))
    if INTERPRET:
        assert extend_splits([(8, 200, 11), (2, 40, 11)], q_per_prog=8, kv_heads=2, max_splits=4, target=8,
                             block_n=16) == [4, 1]  # fmt: skip
    # The state a graph of this batch's shape launches with (graph_state): sized for contexts past the bound under
    # which graphs launch on one split (its own lengths would replay that graph instead).
    bound = ta._UNSPLIT_EXTEND_CONTEXT + 1
    b = dataclasses.replace(batch, attn_state=backend.graph_state(batch.num_seqs, q.shape[0], True, bound,
                                                                  min_tokens=11))
    out = backend.forward(q, k, v, b, q.shape[-1] ** -0.5)
    assert b.attn_state.scratch, "the extend did not take its split path"
    if padded:
        monkeypatch.setattr(torch, "empty_like", real_empty_like)
        assert bool((out[real:] == sentinel).all()), "a kernel wrote a padding token's output row"
    unpadded = dataclasses.replace(batch, cu_seqlens_q=batch.cu_seqlens_q[:4], kv_lens=batch.kv_lens[:3],
                                   block_tables=batch.block_tables[:3])
    assert rel_err(out[:real], reference(q[:real], k, v, unpadded)) <= RTOL


def test_extend_reduce_finds_sequences_past_the_first_64() -> None:
    """The reduce finds a token's sequence 64 sequences at a time (`_SEQ_CHUNK`): extends after the 64th sequence,
    between decode rows, split and merged like the first ones."""
    extends = {3: (5, 40), 64: (5, 40), 66: (3, 50), 69: (6, 37)}
    lens = [extends.get(i, (1, 20)) for i in range(70)]
    q, k, v, batch = make_case(lens, 16, 2, 1, 16, seed=13)
    backend = TritonAttention(decode_block_n=16, extend_block_m=16, extend_block_n=16, num_kv_splits=2)
    assert rel_err(run_triton(backend, q, k, v, batch), reference(q, k, v, batch)) <= RTOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_forward_without_prepare(dtype: torch.dtype) -> None:
    """16-bit in, 16-bit out (float32 softmax inside); forward also works when prepare was not called."""
    if INTERPRET and dtype == torch.bfloat16:
        # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584, "not supported yet"); bf16 is covered by the TRITON_INTERPRET=0 GPU run.
        pytest.skip("Triton's interpreter does not support bfloat16 tl.dot")
    backend = TritonAttention(decode_block_n=16, extend_block_m=16, extend_block_n=16, num_kv_splits=2)
    for lens in ([(1, 20), (1, 45)], [(6, 6), (4, 30)]):
        q, k, v, batch = make_case(lens, 4, 4, 2, 16, dtype=dtype, seed=3)
        b = dataclasses.replace(batch, attn_state=None)
        out = backend.forward(q, k, v, b, 16**-0.5)
        assert out.dtype == dtype
        assert rel_err(out, reference(q, k, v, batch)) <= 2e-2


def test_non_contiguous_q() -> None:
    """q as the model produces it: a strided view of the packed qkv projection."""
    q, k, v, batch = make_case([(5, 12), (3, 3)], 4, 4, 2, 16, seed=11)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # [T, 2 * Hq, D]
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    backend = TritonAttention(extend_block_m=16, extend_block_n=16)
    assert rel_err(run_triton(backend, q_view, k, v, batch), reference(q, k, v, batch)) <= RTOL


@pytest.mark.parametrize("rows, heads, head_dim", [(8, 4, 16), (2048, 64, 128)])
def test_precompile_covers_every_variant_a_step_can_launch(
    monkeypatch: pytest.MonkeyPatch, rows: int, heads: int, head_dim: int
) -> None:
    """`precompile` (run before serving) reaches every constexpr combination an eager batch can need: decode
    with one split (direct output) and each power-of-two split count of the reduce, extend with and without
    decode rows beside it and with and without splits; it launches nothing (compile only) and restores the
    backend. The wide case is Qwen3-32B's attention (64 heads of 128) under a batch of 2,048 tokens: its extend
    scratch cap must not hold the precompile at one split."""
    _, k_cache, v_cache, batch = make_case([(1, 40), (7, 30)], 16, 4, 2, 16, dtype=torch.bfloat16)
    q = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)  # nothing runs: only its type and layout matter
    backend = TritonAttention(num_kv_splits=None)
    seen: dict[str, set] = {}
    tiles: set[tuple[int, int]] = set()
    variants: set[tuple] = set()
    real_launch = backend._launch

    def record(kernel, grid, *args, **kwargs):
        assert backend._compile_only is not None  # only ever compiled, never run, while precompiling
        backend._compile_only.add((kernel, tuple(sorted(kwargs.items()))))
        variants.add((kernel.fn.__name__, tuple(sorted(kwargs.items()))))
        keys = {k: v for k, v in kwargs.items() if k in ("DIRECT_OUT", "SPLITS_PAD", "SKIP_DECODE", "SPLIT")}
        seen.setdefault(kernel.fn.__name__, set()).add(tuple(sorted(keys.items())))
        if kernel.fn.__name__ == "_extend_kernel":
            tiles.add((kwargs["BLOCK_M"], kwargs["BLOCK_N"]))

    monkeypatch.setattr(backend, "_launch", record)
    assert backend.precompile(q, k_cache, v_cache, batch, 0.25) == len(variants)
    assert backend._compile_only is None and backend.num_kv_splits is None and real_launch
    assert seen["_decode_split_kernel"] == {(("DIRECT_OUT", True),), (("DIRECT_OUT", False),)}
    assert {dict(c)["SPLITS_PAD"] for c in seen["_decode_reduce_kernel"]} == {2, 4, 8, 16, 32, 64}
    assert seen["_extend_kernel"] == {(("SKIP_DECODE", d), ("SPLIT", s)) for d in (False, True) for s in (False, True)}
    assert {dict(c)["SKIP_DECODE"] for c in seen["_extend_reduce_kernel"]} == {False, True}
    assert {dict(c)["SPLITS_PAD"] for c in seen["_extend_reduce_kernel"]} == {2, 4, 8, 16}
    # Eager batches take the prefill tile; graphs (int64 lengths, the short-suffix tile) compile theirs at capture.
    assert tiles == {(128, 32)}


_COMPILE_DECODE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenrouter.runner import triton_attention as ta

def waits_first(ptx):  # PDL: the grid-dependency wait before the kernel's first global memory access
    body = ptx[ptx.index(".entry"):]
    hits = [i for i in (body.find(op) for op in ("ld.global", "st.global", "atom.", "red.", "cp.async")) if i >= 0]
    return 0 <= body.find("griddepcontrol.wait") < min(hits)


for kernel, consts in (
        (ta._decode_split_kernel, dict(NUM_HEADS=16, HEAD_DIM=128, D_PAD=128, GROUP=2, GROUP_PAD=16, PAGE=16,
                                       BLOCK_N=64, DIRECT_OUT=False)),
        (ta._decode_reduce_kernel, dict(NUM_HEADS=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, SPLITS_PAD=4))):
    for pdl in (False, True):
        types = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "kv_lens_ptr": "*i32", "sm_scale_log2": "fp32"}
        sig = {n: types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
        sig.update({c: "constexpr" for c in consts}, PDL="constexpr")
        ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs={**consts, "PDL": pdl}),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "num_stages": 3, "launch_pdl": pdl}).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl  # PDL: the kernel waits for its predecessor first
        assert waits_first(ptx) or not pdl
print("compiled")
"""


def test_decode_compiles_for_hopper() -> None:
    """The interpreter has no grid-dependency ops and runs PDL off: compile the decode kernels both ways for sm_90,
    no GPU needed (Triton's ptxas)."""
    compile_for_hopper(_COMPILE_DECODE_FOR_HOPPER)
