"""A decoder layer's whole MLP for a few rows as one kernel: RMSNorm, gate/up, SiLU * up, down, residual add.

The skinny path (skinny_gemm.py) runs the MLP as two launches: gate_up (RMSNorm in front) and down (SiLU * up in
front, split-K, residual behind). For a small model at decode that is two short kernels whose time is mostly fixed
cost (the 0.6B's: ~7 us each for ~3 us of weight bytes, perf/results/qk_rope_h200_2026-12-03), and beside a large
model on the same GPU each kernel also waits for SMs once. Here each program owns a slice of the intermediate
dimension: it computes its slice of gate and up from the normed rows (the whole hidden row is its K), applies the
activation, and multiplies the slice by the matching columns of the down weight, a float32 partial of the whole
output. Every weight byte is read once, by one program. The partials are then summed: on a GPU the programs meet at
a grid barrier (all are resident: there are fewer than the SMs) and each sums a few output columns; under Triton's
interpreter, which runs programs one after another, the last to arrive sums them all. Both add the partials in
the same order (blocks of programs in order, each block's sum a fixed tree), so the result does not depend on
which program finished last.

Roundings are the skinny path's: the normed input rounded as RMSNorm rounds it, gate and up rounded as the
gate_up matmul's output, silu then the product rounded as fused_ops.silu_mul, the down product rounded before
the residual add. Only the summation order of the down product differs (its K is cut into other pieces), so
results agree with the skinny path to float32 summation order, not bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenrouter.runner import pdl
from tokenrouter.runner.pdl import wait_for_predecessor
from tokenrouter.runner.skinny_gemm import (
    _STATS_ELEMS,
    SplitKWorkspace,
    _accumulate,
    _row_stats,
    _table,
)

# "auto": a model runs it where the GPU's tuned table measured it faster than the two launches (`pays`); "1": at
# every shape that fits (untuned shapes take MlpConfig's defaults); "0": never. Benchmarks compare the ways.
MODE = os.environ.get("TOKENROUTER_FUSED_MLP", "auto").strip().lower()
MAX_ROWS = 16  # one 16-row tile: decode and the shortest extends of a small model
REDUCE_ELEMS = 128 * 128  # float32 values one reduction load holds (programs x output elements)


@dataclass(frozen=True)
class MlpConfig:
    block_i: int = 32  # intermediate columns per program: the grid is cdiv(I, block_i) programs
    block_k: int = 128  # hidden columns per step of the gate/up loop
    block_n: int = 128  # output columns per step of the down loop
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _reduce_chunk(part_ptr, x_ptr, out_ptr, e0, programs, M, H, stride_x, P_BLOCK: tl.constexpr,
                  E_BLOCK: tl.constexpr):
    """Output elements [e0, e0 + E_BLOCK) of the flattened [M, H] output: every program's partial summed in one
    load (a fixed tree over the programs), rounded, plus the residual, rounded again (as skinny_gemm's epilogue)."""
    e = e0 + tl.arange(0, E_BLOCK)
    e_ok = e < M * H
    rp = tl.arange(0, P_BLOCK)
    ptrs = part_ptr + rp.to(tl.int64)[:, None] * M * H + e[None, :]
    vals = tl.load(ptrs, mask=(rp < programs)[:, None] & e_ok[None, :], other=0.0, cache_modifier=".cg")
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(vals, 0).to(dtype)
    res = tl.load(x_ptr + (e // H).to(tl.int64) * stride_x + e % H, mask=e_ok, other=0.0)
    tl.store(out_ptr + e, (y.to(tl.float32) + res.to(tl.float32)).to(dtype), mask=e_ok)


@triton.jit
def _down_partial(w, h, part, rn, rm, m_ok, H, FP32_DOT: tl.constexpr):
    """part[:, rn] = (w @ h)^T: a down-weight tile [BLOCK_N, BLOCK_I] times the slice's activations [BLOCK_I, M]."""
    if FP32_DOT == "":
        p = tl.dot(w, h)
    else:
        p = tl.dot(w, h, input_precision=FP32_DOT)
    tl.store(part + rm[None, :] * H + rn[:, None], p, mask=(rn < H)[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_ptr,  # [M, H] the residual stream, row stride stride_x
    norm_w_ptr,  # [H] post-attention RMSNorm weight
    gu_ptr,  # [2I, H] gate rows then up rows, row stride stride_gu
    down_ptr,  # [H, I], row stride stride_d
    out_ptr,  # [M, H] contiguous
    part_ptr,  # [programs, M, H] float32 partials
    count_ptr,  # [2] int32 zeros: arrivals, departures (left zero again)
    M,
    H,
    INTER,  # the intermediate size I
    eps,
    stride_x,
    stride_gu,
    stride_d,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    P_BLOCK: tl.constexpr,  # the programs rounded up to a power of two: the reduction loads all partials at once
    E_BLOCK: tl.constexpr,  # output elements per reduction chunk
    STATS_BLOCK: tl.constexpr,
    STATS_ITERS: tl.constexpr,
    GRID_SYNC: tl.constexpr,  # all programs resident (a GPU): meet at a barrier and share the reduction
    FP32_DOT: tl.constexpr,  # float32 inputs: tl.dot's input_precision, as skinny_gemm's; "" for 16-bit inputs
    PDL: tl.constexpr,
    STOP: tl.constexpr = 0,  # perf/bench_mlp.py --phases times the kernel cut short: 1 after gate/up, 2 after the
    # down partials, 3 after the barrier (its output then is not the MLP's); 0: the whole kernel
):
    """Grid (cdiv(I, BLOCK_I),): program p owns intermediate columns p*BLOCK_I.."""
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    mean, rstd = _row_stats(x_rows, m_ok, H, eps, 1, BLOCK_M, STATS_BLOCK, STATS_ITERS)

    # The down weight's first tile is read before the gate/up loop (the weights do not depend on this step), so that
    # its latency hides behind that loop instead of opening the down loop.
    ri = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = ri < INTER
    rn = tl.arange(0, BLOCK_N)
    w_first = tl.load(down_ptr + rn.to(tl.int64)[:, None] * stride_d + ri[None, :],
                      mask=(rn < H)[:, None] & i_ok[None, :], other=0.0)

    # Gate and up rows of this slice as one tile of 2 * BLOCK_I weight rows: one pass over the normed input.
    r2 = tl.arange(0, 2 * BLOCK_I)
    col = pid * BLOCK_I + r2 % BLOCK_I
    gu_rows = gu_ptr + (col + (r2 >= BLOCK_I).to(tl.int32) * INTER).to(tl.int64)[:, None] * stride_gu
    acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc = _accumulate(acc, x_rows, gu_rows, m_ok, col < INTER, 0, H, H, norm_w_ptr, norm_w_ptr, mean, rstd, dtype, 1,
                      FP32_DOT, BLOCK_K)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_I, BLOCK_M)), (1, 2, 0)))
    gate = gate.to(dtype).to(tl.float32)  # the gate_up matmul's output rounding
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # as fused_ops.silu_mul
    h = (act * up).to(dtype)  # [BLOCK_I, BLOCK_M]; columns past I are 0 (their weights loaded as 0)

    # This slice's share of the down product, over every output column.
    part = part_ptr + pid.to(tl.int64) * M * H
    if STOP == 1:
        tl.store(part + tl.arange(0, BLOCK_M), tl.sum(h.to(tl.float32), 0))
        return
    _down_partial(w_first, h, part, rn, rm, m_ok, H, FP32_DOT)
    for n0 in range(BLOCK_N, H, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        w = tl.load(down_ptr + rn.to(tl.int64)[:, None] * stride_d + ri[None, :],
                    mask=(rn < H)[:, None] & i_ok[None, :], other=0.0)
        _down_partial(w, h, part, rn, rm, m_ok, H, FP32_DOT)
    if STOP == 2:
        return
    # Every thread's stores before the one atomic, and acq_rel on it: this program's partial is visible before its
    # count, and whoever sees the full count sees every partial.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1) + 1
    if GRID_SYNC:
        # Spin on plain loads from L2 (an atomic per poll from every program would queue behind one another at the
        # counter's L2 slice, the last arrivals' increments among them), then one atomic for its acquire.
        while arrived < programs:
            arrived = tl.load(count_ptr, volatile=True)
        tl.atomic_add(count_ptr, 0)
        if STOP != 3:
            for e0 in range(pid * E_BLOCK, M * H, programs * E_BLOCK):
                _reduce_chunk(part_ptr, x_ptr, out_ptr, e0, programs, M, H, stride_x, P_BLOCK, E_BLOCK)
        left = tl.atomic_add(count_ptr + 1, 1)
        if left == programs - 1:  # every program is past the barrier: zero both for the next launch
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(count_ptr + 1, 0)
    elif arrived == programs:
        for e0 in range(0, M * H, E_BLOCK):
            _reduce_chunk(part_ptr, x_ptr, out_ptr, e0, programs, M, H, stride_x, P_BLOCK, E_BLOCK)
        tl.atomic_xchg(count_ptr, 0)


def table_key(hidden: int, intermediate: int) -> str:
    """The tuned table's `mlp` section names a layer's MLP "HxI" (one 16-row tile)."""
    return f"{hidden}x{intermediate}"


def _tuned(hidden: int, intermediate: int, device: torch.device) -> dict | None:
    table = _table(device)
    return None if table is None else table.mlp.get(table_key(hidden, intermediate))


def config_for(hidden: int, intermediate: int, device: torch.device) -> MlpConfig:
    entry = _tuned(hidden, intermediate, device)
    return MlpConfig(**entry["config"]) if entry is not None else MlpConfig()


def pays(hidden: int, intermediate: int, device: torch.device) -> bool:
    """Whether a model with this MLP should run it as one kernel: by MODE, and under "auto" where the GPU's tuned
    table measured it no slower than the two skinny launches (off a GPU: never; the tests turn it on)."""
    if MODE in ("0", "off", "false", "no"):
        return False
    if MODE in ("1", "on", "true", "yes"):
        return True
    entry = _tuned(hidden, intermediate, device)
    return entry is not None and entry["us"] <= entry["baseline_us"]


def programs(intermediate: int, cfg: MlpConfig = MlpConfig()) -> int:
    return triton.cdiv(intermediate, cfg.block_i)


def workspace_need(hidden: int, intermediate: int, m: int, cfg: MlpConfig = MlpConfig()) -> tuple[int, int]:
    """(float32 partial elements, counters) one launch uses."""
    return programs(intermediate, cfg) * m * hidden, 2


def fits(device: torch.device, intermediate: int, cfg: MlpConfig = MlpConfig(), num_sms: int = 0) -> bool:
    """Whether the grid barrier can hold on `device`: every program resident at once, one per SM at most, on the
    `num_sms` SMs of a green context (runner/green.py) when the model has one (0: the whole GPU)."""
    if device.type != "cuda":
        return True
    sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
    return programs(intermediate, cfg) <= sms


def fused_mlp(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    workspace: SplitKWorkspace,
    cfg: MlpConfig | None = None,
    num_sms: int = 0,
    stop: int = 0,
) -> torch.Tensor:
    """down(silu(gate) * up) + x with [gate | up] = RMSNorm(x) @ gate_up_weight^T -> new contiguous [M, H].

    x: [M, H] (M <= MAX_ROWS, last dim contiguous); gate_up_weight [2I, H] (gate rows first); down_weight [H, I].
    num_sms: the SMs of the green context the launch runs on (0: the whole GPU), which must hold the grid at once.
    stop (benchmarks only): cut the kernel short after a phase, see the kernel's STOP.
    float32 inputs multiply in three TF32 passes on a GPU (skinny_gemm's float32 grade). Never synchronises, so
    it can be captured in a CUDA graph."""
    if x.dim() != 2 or x.stride(-1) != 1 or gate_up_weight.stride(-1) != 1 or down_weight.stride(-1) != 1:
        raise ValueError("fused_mlp: x and the weights must be 2-D with a contiguous last dim")
    M, H = x.shape
    I2, H2 = gate_up_weight.shape
    if H2 != H or I2 % 2 or down_weight.shape != (H, I2 // 2) or norm_weight.shape != (H,):
        raise ValueError(f"fused_mlp: x {tuple(x.shape)}, gate_up {tuple(gate_up_weight.shape)}, down "
                         f"{tuple(down_weight.shape)} and norm {tuple(norm_weight.shape)} do not fit")
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"fused_mlp takes 1 to {MAX_ROWS} rows, got {M}")
    if len({x.dtype, gate_up_weight.dtype, down_weight.dtype, norm_weight.dtype}) != 1:
        raise ValueError("fused_mlp: x, both weights and the norm weight must share one dtype")
    I = I2 // 2  # noqa: E741 (the intermediate size, as the field names it)
    cfg = cfg or config_for(H, I, x.device)
    if not fits(x.device, I, cfg, num_sms):
        raise ValueError(f"fused_mlp: {programs(I, cfg)} programs cannot all be resident on this GPU")
    if not workspace.fits(*workspace_need(H, I, M, cfg)):
        raise ValueError(f"fused_mlp: [{M}, {H}] x {I} needs a workspace of {workspace_need(H, I, M, cfg)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    stats_block = _STATS_ELEMS // MAX_ROWS
    p_block = triton.next_power_of_2(programs(I, cfg))
    _fused_mlp_kernel[(programs(I, cfg),)](
        x, norm_weight, gate_up_weight, down_weight, out, workspace.partials, workspace.counts, M, H, I, eps,
        x.stride(0), gate_up_weight.stride(0), down_weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, P_BLOCK=p_block,
        E_BLOCK=max(16, REDUCE_ELEMS // p_block), STATS_BLOCK=stats_block, STATS_ITERS=triton.cdiv(H, stats_block),
        GRID_SYNC=x.device.type == "cuda" and not pdl._interpreted(),
        FP32_DOT="tf32x3" if x.dtype == torch.float32 else "",
        STOP=stop, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
