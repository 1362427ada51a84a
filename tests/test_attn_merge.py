"""o_proj merging a decode batch's attention splits in its prologue (skinny_gemm's `attn_merge`) computes what the
split kernel's reduce and then the plain matmul compute, on the CPU through Triton's interpreter (compiled with
TRITON_INTERPRET=0 on a GPU): the kernel on hand-made batches (splits a sequence leaves empty, a CUDA graph's
padding row, grouped heads, K blocks narrower than a head), when `forward_partials` hands partials over and when not,
and the model's graph step against the plain model."""

from __future__ import annotations

# isort: off
from triton_interpreter import INTERPRET  # first: before anything here imports triton
# isort: on

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot be tested")

from test_cuda_graph_runner import ON_GPU, _Driver, _hook, _runner  # noqa: E402
from test_cuda_graph_runner import TOL as MODEL_TOL  # noqa: E402
from test_triton_attention import make_case, reference  # noqa: E402
from tokenrouter.runner import skinny_gemm as sg  # noqa: E402
from tokenrouter.runner.attention import SplitPartials  # noqa: E402
from tokenrouter.runner.model_runner import ModelRunner  # noqa: E402
from tokenrouter.runner.triton_attention import TritonAttention  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
H, HKV, D, N = 4, 2, 32, 48


def _padded_decode(dtype: torch.dtype, lens: list[int]):
    """A decode batch as a CUDA graph replays it: one row per sequence, then a padding row (a sequence with no
    tokens, a token of no sequence)."""
    q, k, v, batch = make_case([(1, n) for n in lens], 4, H, HKV, D, dtype=dtype, seed=len(lens))
    pad = lambda t, val: torch.cat([t, torch.full((1, *t.shape[1:]), val, dtype=t.dtype, device=t.device)])  # noqa: E731
    q = pad(q, 0.5)
    batch = dataclasses.replace(
        batch, input_ids=pad(batch.input_ids, 0), positions=pad(batch.positions, 0),
        slot_mapping=pad(batch.slot_mapping, -1), block_tables=pad(batch.block_tables, 0),
        cu_seqlens_q=pad(batch.cu_seqlens_q, len(lens)), kv_lens=pad(batch.kv_lens, 0), q_lens_cpu=[], kv_lens_cpu=[],
    )  # fmt: skip
    return q, k, v, batch


def _in_graph(backend: TritonAttention, batch, max_kv_len: int = 128):
    b = dataclasses.replace(batch, attn_state=None)
    b.attn_state = backend.graph_state(b.num_seqs, b.num_seqs, False, max_kv_len)
    return b


# (Triton's interpreter has no bfloat16 tl.dot: bfloat16 compiled only)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16]))
@pytest.mark.parametrize("cfg", [
    sg.GemmConfig(16, 32, 1),  # one head per K block
    sg.GemmConfig(32, 16, 3),  # split-K, two K blocks per head
    sg.GemmConfig(16, 64, 2),  # a K block wider than a head: narrowed to one head
    sg.GemmConfig(16, 32, 1, programs=5),  # stream-K: becomes a split-K grid
])  # fmt: skip
def test_merged_o_proj_matches_reduce_then_matmul(dtype: torch.dtype, cfg: sg.GemmConfig) -> None:
    # 4 splits of 16-key tiles: 70 keys write splits 0-2 (32 each, the last 6), 5 keys split 0 only, 33 keys 0-2.
    backend = TritonAttention(decode_block_n=16, num_kv_splits=4)
    q, k, v, batch = _padded_decode(dtype, [70, 5, 33])
    T = q.shape[0]
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(N, H * D, generator=gen) * 0.2).to(DEVICE, dtype)
    res = torch.randn(T, N, generator=gen).to(DEVICE, dtype)
    ws = sg.SplitKWorkspace(DEVICE, 16 * T * N, 16)

    merged = backend.forward(q, k, v, _in_graph(backend, batch), D**-0.5)  # split kernel + reduce
    want = sg.skinny_linear(merged.view(T, -1), w, ws, residual=res, config=sg.attn_merge_config(cfg, N, H * D, D))
    parts = backend.forward_partials(q, k, v, _in_graph(backend, batch), D**-0.5)
    assert isinstance(parts, SplitPartials) and parts.num_splits == 4
    got = sg.skinny_linear(parts.out.view(T, -1), w, ws, prologue="attn_merge", partials=parts, residual=res,
                           config=cfg)
    # The same float32 merge up to its summation order (one ulp, which the rounding to the dtype may keep).
    tol = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
           torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}[dtype]
    torch.testing.assert_close(got[:3], want[:3], **tol)
    assert torch.equal(got[3], res[3])  # the padding row merges to zeros: only its residual is left
    # And against the torch attention in float32 (the reduce's own test bound).
    ref = F.linear(reference(q[:3], k, v, dataclasses.replace(
        batch, cu_seqlens_q=batch.cu_seqlens_q[:4], kv_lens=batch.kv_lens[:3], block_tables=batch.block_tables[:3],
        q_lens_cpu=[1, 1, 1], kv_lens_cpu=batch.kv_lens[:3].tolist())).to(dtype).float().reshape(3, -1), w.float())
    torch.testing.assert_close(got[:3].float(), ref + res[:3].float(), rtol=5e-2, atol=5e-2)
    assert int(ws.counts.count_nonzero()) == 0


def test_merge_in_chunks_up_to_the_last_split_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """More splits than the prologue loads at once: 8 launched, at most 5 written (70 keys in 16s), merged 2 at a
    time."""
    monkeypatch.setattr(sg, "MERGE_CHUNK", 2)
    backend = TritonAttention(decode_block_n=16, num_kv_splits=8)
    q, k, v, batch = _padded_decode(torch.float32, [70, 5, 33])
    T = q.shape[0]
    gen = torch.Generator().manual_seed(2)
    w, res = torch.randn(N, H * D, generator=gen).to(DEVICE), torch.randn(T, N, generator=gen).to(DEVICE)
    ws = sg.SplitKWorkspace(DEVICE, 16 * T * N, 16)
    cfg = sg.GemmConfig(16, 32, 2)
    merged = backend.forward(q, k, v, _in_graph(backend, batch), D**-0.5)
    want = sg.skinny_linear(merged.view(T, -1), w, ws, residual=res, config=cfg)
    parts = backend.forward_partials(q, k, v, _in_graph(backend, batch), D**-0.5)
    got = sg.skinny_linear(parts.out.view(T, -1), w, ws, prologue="attn_merge", partials=parts, residual=res,
                           config=cfg)
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], res[3])


def test_partials_only_for_split_decode_batches_in_graphs() -> None:
    """Eager batches, one split, or an extend row: the merged output."""
    q, k, v, batch = _padded_decode(torch.float32, [70, 5])
    split = TritonAttention(decode_block_n=16, num_kv_splits=4)
    assert isinstance(split.forward_partials(q, k, v, _in_graph(split, batch), 1.0), SplitPartials)
    eager = dataclasses.replace(batch, q_lens_cpu=[1, 1, 0], kv_lens_cpu=[70, 5, 0], attn_state=None)
    assert isinstance(split.forward_partials(q, k, v, eager, 1.0), torch.Tensor)
    one = TritonAttention(decode_block_n=16, num_kv_splits=1)
    assert isinstance(one.forward_partials(q, k, v, _in_graph(one, batch), 1.0), torch.Tensor)
    qe, ke, ve, ext = make_case([(1, 40), (3, 20)], 4, H, HKV, D)
    ext = dataclasses.replace(ext, attn_state=split.graph_state(2, 4, True, 128))
    assert isinstance(split.forward_partials(qe, ke, ve, ext, 1.0), torch.Tensor)


def test_attn_merge_rejects_bad_calls() -> None:
    backend = TritonAttention(decode_block_n=16, num_kv_splits=4)
    q, k, v, batch = _padded_decode(torch.float32, [70, 5])
    parts = backend.forward_partials(q, k, v, _in_graph(backend, batch), 1.0)
    x = parts.out.view(3, -1)
    w = torch.randn(N, H * D, device=DEVICE)
    ws = sg.SplitKWorkspace(DEVICE, 1 << 12, 16)
    with pytest.raises(ValueError, match="come together"):
        sg.skinny_linear(x, w, ws, prologue="attn_merge")
    with pytest.raises(ValueError, match="come together"):
        sg.skinny_linear(x, w, ws, partials=parts)
    with pytest.raises(ValueError, match="do not fit"):
        sg.skinny_linear(x[:2], w, ws, prologue="attn_merge", partials=parts)
    with pytest.raises(ValueError, match="float32"):
        bad = dataclasses.replace(parts, mid_o=parts.mid_o.half())
        sg.skinny_linear(x, w, ws, prologue="attn_merge", partials=bad)


def test_graph_step_with_merged_o_proj_matches_plain_model(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The skinny model's padded graph step (decodes of 3 and 2 sequences, contexts over one KV split, an extend in
    between) with o_proj merging the splits: the plain model's logits, tokens and KV, and the merge did run."""
    monkeypatch.setattr(sg, "max_rows", lambda shapes, device, dtype=None: sg.MAX_M)
    monkeypatch.setattr(sg, "config_for", lambda n, k, m, device, dtype=None: sg.GemmConfig(16, 16, 2))
    merges = []
    real = sg.skinny_linear

    def recorded(x, *a, **kw):
        merges.append(kw.get("prologue") == "attn_merge")
        return real(x, *a, **kw)

    monkeypatch.setattr(sg, "skinny_linear", recorded)
    graphed = _runner(tiny_dir, max_tokens=64)
    graphed.setup_step(_hook(graphed), capture=ON_GPU)
    # On a GPU the graphs were captured just now, with the merge (replays run no Python).
    assert any(merges) == ON_GPU
    plain = ModelRunner(dataclasses.replace(graphed.cfg, skinny_gemm=False), default_kv_tokens=1024)
    plain.step_hook = graphed.step_hook
    assert all(layer.attn_merge for layer in graphed.model.model.layers)
    gen = torch.Generator().manual_seed(3)
    vocab = graphed.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (140, 30, 100)]
    a, b = _Driver(graphed, prompts), _Driver(plain, prompts)
    for toks, merged in (([[], [], []], False), ([[5], [6], [7]], True), ([[8, 9], [10], [11]], False),
                         ([[12], [], [13]], True)):
        merges.clear()
        ours, ref = a.step(toks), b.step(toks)
        assert ON_GPU or any(merges) == merged, toks
        torch.testing.assert_close(ours[0], ref[0], rtol=MODEL_TOL, atol=MODEL_TOL)  # logits
        torch.testing.assert_close(ours[1], ref[1], rtol=MODEL_TOL, atol=MODEL_TOL)  # hidden
        assert torch.equal(ours[2], ref[2])  # greedy tokens
    torch.testing.assert_close(graphed.kv_cache, plain.kv_cache, rtol=MODEL_TOL, atol=MODEL_TOL)
    a.release()
    b.release()
