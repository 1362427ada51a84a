"""The CUDA-graph step path (static buffers, padded batches, policy work inside the step) computes what the plain
forward computes. On the CPU nothing is captured: the same padded static batch runs eagerly through the Triton
kernels under TRITON_INTERPRET=1, which checks the padding, the bucket choice and the step hook. With
`TRITON_INTERPRET=0` on a GPU the same test captures real graphs and replays them (float32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tokenrouter.config import ModelConfig
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.sequence import Sequence
from tokenrouter.routing.policy import make_policy, step_hook
from tokenrouter.runner.cuda_graph import GraphShape, extend_token_counts, fewest_tokens, graph_shapes, pick_shape
from tokenrouter.runner.forward_batch import ScheduledChunk
from tokenrouter.runner.model_runner import ModelRunner
from tokenrouter.sampling_params import SamplingParams

PADDING_ROWS_UNWRITTEN = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
"""For tests of padded steps: padding tokens belong to no sequence, and attention leaves their output rows unwritten
(zeroing them would cost a memset per layer in every graph step), so the interpreter's numpy may overflow on those
rows' garbage downstream. Rows are independent: such tests compare the real rows."""


def test_graph_shapes_cover_decode_and_short_extends() -> None:
    shapes = graph_shapes(max_batch=8, max_tokens=32)
    decode = sorted(s.num_seqs for s in shapes if not s.has_extend)
    assert decode == [1, 2, 4, 8]
    extend = sorted((s.num_tokens, s.num_seqs) for s in shapes if s.has_extend)
    assert extend == [(16, 4), (16, 8), (32, 4), (32, 8)]
    assert graph_shapes(max_batch=0, max_tokens=0) == []
    # Extend graphs without decode graphs; and the scheduler's sequence limit caps both kinds.
    assert [s for s in graph_shapes(0, 16, max_seqs=8) if not s.has_extend] == []
    assert graph_shapes(0, 16, max_seqs=8) == [GraphShape(16, 4), GraphShape(16, 8)]
    assert max(s.num_seqs for s in graph_shapes(64, 128, max_seqs=6)) == 6


def test_extend_token_counts_step_16_then_64() -> None:
    # Fine steps where returning requests' short suffixes land, coarse ones for prefills.
    assert extend_token_counts(128) == list(range(16, 129, 16))
    assert extend_token_counts(512) == list(range(16, 257, 16)) + [320, 384, 448, 512]
    assert extend_token_counts(200) == list(range(16, 193, 16))  # up to the limit, never past it
    assert extend_token_counts(300) == list(range(16, 257, 16))
    assert extend_token_counts(15) == []
    # The default config's largest extend graph holds four 100-token prompts with their suffixes.
    default = ModelConfig(name="m", path="unused").cuda_graph_max_tokens
    assert max(extend_token_counts(default)) >= 4 * (100 + 10)
    # Past 128 tokens, graphs of at most 16 sequences: a 64-sequence graph's extend grid (every sequence's longest
    # possible suffix) would be mostly empty programs; such batches run eagerly.
    shapes = graph_shapes(64, 512, 256)
    assert {s.num_seqs for s in shapes if s.num_tokens > 128} == {4, 16}
    assert pick_shape(shapes, 16, 300) == GraphShape(320, 16)
    assert pick_shape(shapes, 17, 140) is None
    assert pick_shape(shapes, 40, 120) == GraphShape(128, 64)


@pytest.mark.parametrize(
    ("seqs", "tokens", "want"),
    [
        (1, 1, GraphShape(1, 1)),
        (3, 3, GraphShape(4, 4)),  # decode pads to the next decode size
        (8, 8, GraphShape(8, 8)),
        (9, 9, None),  # more sequences than any decode graph
        (1, 2, GraphShape(16, 4)),  # any extend row needs an extend graph, even if the tokens would fit (2, 2)
        (3, 17, GraphShape(32, 4)),
        (5, 20, GraphShape(32, 8)),
        (2, 33, None),  # more tokens than any extend graph
    ],
)
def test_pick_shape(seqs: int, tokens: int, want: GraphShape | None) -> None:
    assert pick_shape(graph_shapes(max_batch=8, max_tokens=32), seqs, tokens) == want


ON_GPU = os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()
# Row-order effects of GPU matmul kernels that differ with the padded batch size stay far below this.
TOL = 1e-4 if ON_GPU else 1e-5


def _runner(tiny_dir: Path, max_tokens: int = 32) -> ModelRunner:
    device = "cuda:0" if ON_GPU else "cpu"
    cfg = ModelConfig(name="small", path=str(tiny_dir / "small"), dtype="float32", device=device,
                      kv_cache_tokens=1024, attention="triton", cuda_graph_max_batch=8,
                      cuda_graph_max_tokens=max_tokens)
    return ModelRunner(cfg, default_kv_tokens=1024)


def _hook(runner: ModelRunner):
    policy = make_policy("r2r", ["small", "large"], "small", {"hidden_dim": 16, "top_k_logits": 8, "seed": 5})
    a = runner.arch
    policy.setup(runner.device, runner.dtype, a.hidden_size, a.vocab_size)
    return step_hook(policy, runner.model.model.embed_tokens)


class _Driver:
    """Sequences on one runner, advanced by hand: forward, then append the given tokens and commit them."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams()) for i, p in enumerate(prompts)]

    def step(self, new_tokens: list[list[int]]):
        """Append `new_tokens[i]` to sequence i (nothing for an empty list) and run them as one batch."""
        chunks = []
        for seq, toks in zip(self.seqs, new_tokens):
            seq.token_ids.extend(toks)
            n = seq.num_tokens - seq.num_computed_tokens
            if n:
                assert self.bm.ensure(seq, seq.num_tokens)
                chunks.append(ScheduledChunk(seq, n))
        out = self.runner.forward(chunks)
        result = (out.logits.clone(), out.hidden.clone(), out.greedy.clone(),
                  None if out.step_values is None else out.step_values.clone(), out.finite.clone())
        for c in chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
        return result

    def release(self) -> None:
        for seq in self.seqs:
            self.bm.release(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks


def test_fewest_tokens_bounds_every_batch_a_graph_replays() -> None:
    """The lower bound the attention sizes a graph's extend splits by: every batch that picks a shape has at
    least that many tokens."""
    shapes = graph_shapes(64, 512, 256)
    for seqs in range(1, 65):
        for tokens in range(seqs, 513):
            shape = pick_shape(shapes, seqs, tokens)
            if shape is not None:
                assert tokens >= fewest_tokens(shapes, shape), (seqs, tokens, shape)
    assert fewest_tokens(shapes, GraphShape(80, 16)) == 65  # 8 requests x 10 tokens replay (80, 16)
    assert fewest_tokens(shapes, GraphShape(192, 4)) == 177  # steps of 16 up to 256 tokens
    assert fewest_tokens(shapes, GraphShape(320, 4)) == 257  # past 256 tokens the step is 64


@PADDING_ROWS_UNWRITTEN
def test_padded_graph_step_matches_plain_forward(tiny_dir: Path) -> None:
    graphed, plain = _runner(tiny_dir), _runner(tiny_dir)
    hook = _hook(graphed)
    graphed.setup_step(hook, capture=ON_GPU)
    assert len(graphed.graphs.graphs) == (len(graphed.graphs.keys()) if ON_GPU else 0)
    plain.step_hook = hook
    assert graphed.graphs is not None and plain.graphs is None
    g = torch.Generator().manual_seed(0)
    vocab = graphed.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 23, 37)]
    a, b = _Driver(graphed, prompts), _Driver(plain, prompts)
    steps = [
        [[], [], []],  # prefill of 100 tokens: too many for a graph, eager on both
        [[5], [6], [7]],  # decode of 3: the 4-sequence decode graph
        [[8, 9, 10], [11], [12, 13]],  # extend of 6 tokens over 3 sequences: the (16, 4) graph
        [[14], [], [15]],  # decode of 2
    ]
    for k, toks in enumerate(steps):
        before = graphed.graphs.num_replays
        ours, ref = a.step(toks), b.step(toks)
        assert graphed.graphs.num_replays == before + (k > 0)
        torch.testing.assert_close(ours[0], ref[0], rtol=TOL, atol=TOL)  # logits
        torch.testing.assert_close(ours[1], ref[1], rtol=TOL, atol=TOL)  # hidden
        assert torch.equal(ours[2], ref[2])  # greedy tokens
        torch.testing.assert_close(ours[3], ref[3], rtol=TOL, atol=TOL)  # the router's logits
        assert ours[4].tolist() == ref[4].tolist() == [True] * len(ref[0])  # finite rows, one per sequence
    # Padding tokens wrote no KV: both pools hold the same cache, slot for slot.
    torch.testing.assert_close(graphed.kv_cache, plain.kv_cache, rtol=TOL, atol=TOL)
    a.release()
    b.release()


@PADDING_ROWS_UNWRITTEN
def test_prefill_replays_a_graph_past_128_tokens(tiny_dir: Path) -> None:
    """A batch of prompts (170 tokens) replays the 176-token graph (6 padding tokens, a padding sequence; every
    prompt uses one KV split, so the extend kernel writes the output itself); then a returning request's suffix
    beside a decode row replays a 16-token graph. Same logits, tokens and KV as the unpadded eager steps."""
    graphed, plain = _runner(tiny_dir, max_tokens=192), _runner(tiny_dir, max_tokens=192)
    graphed.setup_step(None, capture=ON_GPU)
    replayed = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda chunks, shape, fed=None: replayed.append(shape) or run(chunks, shape, fed)
    g = torch.Generator().manual_seed(1)
    vocab = graphed.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (70, 53, 47)]
    a, b = _Driver(graphed, prompts), _Driver(plain, prompts)
    suffix = torch.randint(3, vocab, (12,), generator=g).tolist()
    for toks in ([[], [], []], [suffix, [5], []]):
        ours, ref = a.step(toks), b.step(toks)
        torch.testing.assert_close(ours[0], ref[0], rtol=TOL, atol=TOL)  # logits
        assert torch.equal(ours[2], ref[2])  # greedy tokens
    assert replayed == [GraphShape(176, 4), GraphShape(16, 4)]
    torch.testing.assert_close(graphed.kv_cache, plain.kv_cache, rtol=TOL, atol=TOL)
    a.release()
    b.release()


def test_short_contexts_replay_the_unsplit_graph(tiny_dir: Path) -> None:
    """An extend graph is captured twice: for any context, and for contexts of at most 384 tokens on one KV split.
    A batch whose longest context is 384 replays the second; one token more, the first. Both compute what the
    unpadded eager step computes (logits, tokens, KV)."""
    graphed, plain = _runner(tiny_dir), _runner(tiny_dir)
    graphed.setup_step(None, capture=ON_GPU)
    graphs = graphed.graphs
    full = graphed.max_model_len
    assert graphs.bounds == [full, 384]
    extends = [s for s in graphs.shapes if s.has_extend]
    assert sorted(graphs.keys()) == sorted([(s, full) for s in graphs.shapes] + [(s, 384) for s in extends])
    g = torch.Generator().manual_seed(2)
    vocab = graphed.arch.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (380, 30)]
    a, b = _Driver(graphed, prompts), _Driver(plain, prompts)
    bounds = []
    for toks in ([[], []], [[5, 6, 7, 8], [9, 10]], [[11, 12], [13, 14, 15]], [[16], [17]]):
        before = graphs.num_replays
        ours, ref = a.step(toks), b.step(toks)
        if graphs.num_replays > before:
            bounds.append(graphs.last_bound)
        torch.testing.assert_close(ours[0], ref[0], rtol=TOL, atol=TOL)  # logits
        assert torch.equal(ours[2], ref[2])  # greedy tokens
    # The prompts run eagerly (410 tokens); contexts 384 / 32, then 386 / 35; the decode graph has one bound.
    assert bounds == [384, full, full]
    torch.testing.assert_close(graphed.kv_cache, plain.kv_cache, rtol=TOL, atol=TOL)
    a.release()
    b.release()
