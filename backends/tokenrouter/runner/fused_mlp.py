"""A decoder layer's whole MLP for a few rows as one kernel: RMSNorm, gate/up, SiLU * up, down, residual add.

The skinny path (skinny_gemm.py) runs the MLP as two launches: gate_up (RMSNorm in front) and down (SiLU * up in
front, split-K, residual behind). For a small model at decode those are short kernels whose time is mostly fixed
cost (the 0.6B's: ~7 us each for ~3 us of weight bytes, perf/results/qk_rope_h200_2026-12-03), each with its own
grid: gate_up's 96 programs leave a quarter of an H100's or H200's 132 SMs idle. Here one grid of one program per
SM does both halves, each spread evenly over the programs:

1. gate/up: program p computes intermediate columns [p * ci, (p + 1) * ci) of gate and up from the normed rows (the
   whole hidden row is its K), applies the activation and stores its slice of h = silu(gate) * up (a few rows by I:
   tens of KB, to L2);
2. the programs meet at a grid barrier (all are resident: at most one per SM);
3. down: program p computes output columns [p * cn, (p + 1) * cn) over the whole of h, adds the residual and stores
   them. No partial sums: each output has one program.

Every weight byte is read once. Under Triton's interpreter, which runs programs one after another, the last program
to finish step 1 runs step 3 for all of them (same arithmetic, same order).

Roundings are the skinny path's: the normed input rounded as RMSNorm rounds it, gate and up rounded as the
gate_up matmul's output, silu then the product rounded as fused_ops.silu_mul, the down product rounded before
the residual add. Only the summation order of the down product differs (it runs over I in other pieces than the
skinny path's split-K), so results agree with the skinny path to float32 summation order, not bit for bit.
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
CPU_PROGRAMS = 4  # the grid under Triton's interpreter, where there are no SMs to fill


@dataclass(frozen=True)
class MlpConfig:
    programs: int = 0  # the grid; 0: one program per SM (of the model's green context, if it has one)
    block_k: int = 128  # hidden columns per step of the gate/up loop
    block_k2: int = 256  # intermediate columns per step of the down loop
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _down_rows(t, h_ptr, down_ptr, x_ptr, out_ptr, M, H, INTER, rows_n, stride_d, stride_x, rm, m_ok,
               dtype: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NR: tl.constexpr,
               BLOCK_K2: tl.constexpr):
    """Output columns [t * rows_n, (t + 1) * rows_n): h @ down[cols]^T over all of I, rounded, plus the residual,
    rounded again (as skinny_gemm's epilogue)."""
    r = tl.arange(0, BLOCK_NR)
    rn = t * rows_n + r
    n_ok = (r < rows_n) & (rn < H)
    w_rows = down_ptr + rn.to(tl.int64)[:, None] * stride_d
    rk = tl.arange(0, BLOCK_K2)
    acc = tl.zeros([BLOCK_NR, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K2):
        k_ok = (k0 + rk) < INTER
        w = tl.load(w_rows + k0 + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # h as the other programs left it in L2 (.cg: not from this SM's L1, which never held it)
        hk = tl.load(h_ptr + rm[None, :] * INTER + k0 + rk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0,
                     cache_modifier=".cg").to(dtype)
        if FP32_DOT == "":
            acc += tl.dot(w, hk)
        else:
            acc += tl.dot(w, hk, input_precision=FP32_DOT)
    mask = n_ok[:, None] & m_ok[None, :]
    res = tl.load(x_ptr + rm.to(tl.int64)[None, :] * stride_x + rn[:, None], mask=mask, other=0.0)
    y = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rm[None, :] * H + rn[:, None], y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_ptr,  # [M, H] the residual stream, row stride stride_x
    norm_w_ptr,  # [H] post-attention RMSNorm weight
    gu_ptr,  # [2I, H] gate rows then up rows, row stride stride_gu
    down_ptr,  # [H, I], row stride stride_d
    out_ptr,  # [M, H] contiguous
    h_ptr,  # [M, I] float32 scratch: silu(gate) * up, rounded to the dtype
    count_ptr,  # [2] int32 zeros: arrivals, departures (left zero again)
    M,
    H,
    INTER,  # the intermediate size I
    cols_i,  # intermediate columns per program (step 1)
    rows_n,  # output columns per program (step 3)
    eps,
    stride_x,
    stride_gu,
    stride_d,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,  # cols_i rounded up to a power of two (at least 16)
    BLOCK_K: tl.constexpr,
    BLOCK_NR: tl.constexpr,  # rows_n rounded up to a power of two (at least 16)
    BLOCK_K2: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    STATS_ITERS: tl.constexpr,
    GRID_SYNC: tl.constexpr,  # all programs resident (a GPU): meet at a barrier, each then does its own columns
    FP32_DOT: tl.constexpr,  # float32 inputs: tl.dot's input_precision, as skinny_gemm's; "" for 16-bit inputs
    PDL: tl.constexpr,
    STOP: tl.constexpr = 0,  # perf/bench_mlp.py --phases times the kernel cut short: 1 after gate/up, 2 after the
    # barrier (its output then is not the MLP's); 0: the whole kernel
):
    """One program per SM at most; see the module's docstring for the three steps."""
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    mean, rstd = _row_stats(x_rows, m_ok, H, eps, 1, BLOCK_M, STATS_BLOCK, STATS_ITERS)

    # Step 1: gate and up rows of this program's columns as one tile of 2 * BLOCK_I weight rows, one pass over the
    # normed input.
    r2 = tl.arange(0, 2 * BLOCK_I)
    local = r2 % BLOCK_I
    col = pid * cols_i + local
    gu_rows = gu_ptr + (col + (r2 >= BLOCK_I).to(tl.int32) * INTER).to(tl.int64)[:, None] * stride_gu
    acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc = _accumulate(acc, x_rows, gu_rows, m_ok, (local < cols_i) & (col < INTER), 0, H, H, norm_w_ptr, norm_w_ptr,
                      mean, rstd, dtype, 1, FP32_DOT, BLOCK_K)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_I, BLOCK_M)), (1, 2, 0)))
    gate = gate.to(dtype).to(tl.float32)  # the gate_up matmul's output rounding
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # as fused_ops.silu_mul
    h = (act * up).to(dtype).to(tl.float32)  # [BLOCK_I, BLOCK_M]
    ri = tl.arange(0, BLOCK_I)
    i_ok = (ri < cols_i) & (pid * cols_i + ri < INTER)
    tl.store(h_ptr + rm[None, :] * INTER + pid * cols_i + ri[:, None], h, mask=i_ok[:, None] & m_ok[None, :])
    if STOP == 1:
        return

    # Step 2. Every thread's stores before the one atomic, and acq_rel on it: this program's slice of h is visible
    # before its count, and whoever sees the full count sees all of h.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1) + 1
    if GRID_SYNC:
        # Spin on plain loads from L2 (an atomic per poll from every program would queue behind one another at the
        # counter's L2 slice, the last arrivals' increments among them), then one atomic for its acquire.
        while arrived < programs:
            arrived = tl.load(count_ptr, volatile=True)
        tl.atomic_add(count_ptr, 0)
        if STOP != 2:  # step 3
            _down_rows(pid, h_ptr, down_ptr, x_ptr, out_ptr, M, H, INTER, rows_n, stride_d, stride_x, rm, m_ok, dtype,
                       FP32_DOT, BLOCK_M, BLOCK_NR, BLOCK_K2)
        left = tl.atomic_add(count_ptr + 1, 1)
        if left == programs - 1:  # every program is past the barrier: zero both for the next launch
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(count_ptr + 1, 0)
    elif arrived == programs:
        for t in range(0, programs):
            _down_rows(t, h_ptr, down_ptr, x_ptr, out_ptr, M, H, INTER, rows_n, stride_d, stride_x, rm, m_ok, dtype,
                       FP32_DOT, BLOCK_M, BLOCK_NR, BLOCK_K2)
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


def _sms(device: torch.device, num_sms: int = 0) -> int:
    """The SMs a launch can use: a green context's (runner/green.py) when the model has one, else the GPU's."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return num_sms or torch.cuda.get_device_properties(device).multi_processor_count


def grid_size(device: torch.device, cfg: MlpConfig = MlpConfig(), num_sms: int = 0) -> int:
    return cfg.programs or _sms(device, num_sms)


def workspace_need(intermediate: int, m: int) -> tuple[int, int]:
    """(float32 scratch elements, counters) one launch uses: h, m rows by I."""
    return m * intermediate, 2


def fits(device: torch.device, cfg: MlpConfig = MlpConfig(), num_sms: int = 0) -> bool:
    """Whether the grid barrier can hold: every program resident at once, at most one per SM of the GPU (or of the
    model's green context of `num_sms` SMs). Off a GPU the interpreter runs programs one after another: always."""
    return device.type != "cuda" or grid_size(device, cfg, num_sms) <= _sms(device, num_sms)


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
    if not fits(x.device, cfg, num_sms):
        raise ValueError(f"fused_mlp: {grid_size(x.device, cfg, num_sms)} programs cannot all be resident on "
                         f"{_sms(x.device, num_sms)} SMs")
    if not workspace.fits(*workspace_need(I, M)):
        raise ValueError(f"fused_mlp: [{M}, {H}] x {I} needs a workspace of {workspace_need(I, M)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    grid = grid_size(x.device, cfg, num_sms)
    cols_i, rows_n = triton.cdiv(I, grid), triton.cdiv(H, grid)
    stats_block = _STATS_ELEMS // MAX_ROWS
    _fused_mlp_kernel[(grid,)](
        x, norm_weight, gate_up_weight, down_weight, out, workspace.partials, workspace.counts, M, H, I, cols_i,
        rows_n, eps, x.stride(0), gate_up_weight.stride(0), down_weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_I=max(16, triton.next_power_of_2(cols_i)), BLOCK_K=cfg.block_k,
        BLOCK_NR=max(16, triton.next_power_of_2(rows_n)), BLOCK_K2=cfg.block_k2, STATS_BLOCK=stats_block,
        STATS_ITERS=triton.cdiv(H, stats_block), GRID_SYNC=x.device.type == "cuda" and not pdl._interpreted(),
        FP32_DOT="tf32x3" if x.dtype == torch.float32 else "",
        STOP=stop, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
