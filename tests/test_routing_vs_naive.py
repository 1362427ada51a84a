"""Routed generation equals a naive reference: one process, no batching, no KV cache, every model
recomputing its whole sequence with Hugging Face transformers at every step, following the same policy
rules (route / send / receive, leases). Also: no recompute, all KV free afterwards, clear routing errors."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenrouter import Engine, SamplingParams
from tokenrouter.engine.subserver import AheadRow
from tokenrouter.routing.policy import POLICIES, Policy, RouteRequest, StepResult, make_policy, register, resolve

MAX_NEW = 20
PROMPT_LENS = [3, 5, 8, 11, 13, 17, 21, 30]

# Thresholds picked so that, on the tiny random models, both models really produce tokens.
CASES: dict[str, tuple[list[str], dict]] = {
    "always-small": (["small", "large"], {"name": "always", "model": "small"}),
    "always-large": (["small", "large"], {"name": "always", "model": "large"}),
    "random": (["small", "large"], {"name": "random", "p": 0.3, "seed": 7}),
    "r2r": (["small", "large"], {"name": "r2r", "threshold": 0.5, "hidden_dim": 64, "seed": 3}),
    "citer": (["small", "large"], {"name": "citer", "threshold": 0.5, "seed": 1}),
    "collm": (["small", "large"], {"name": "collm", "threshold": 0.5, "seed": 2}),
    "rstitch": (["small", "large"], {"name": "rstitch", "tau_high": 0.9886, "tau_low": 0.9772}),
    "glimprouter": (["small", "large"], {"name": "glimprouter", "threshold": 2.9, "max_step_tokens": 4}),
    "query": (["small", "large"], {"name": "query", "by": "length", "max_prompt_tokens": 12}),
    "mixture": (["small", "medium", "large"], {"name": "mixture", "weights": [0.5, 0.3, 0.2], "seed": 5}),
}


@functools.cache
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def naive_generate(tiny: Path, models: list[str], policy_cfg: dict, prompt: list[int], max_new: int):
    """The reference: full recompute of the current model's whole sequence for every token."""
    tok = AutoTokenizer.from_pretrained(tiny / "small")
    args = {k: v for k, v in policy_cfg.items() if k != "name"}
    if policy_cfg["name"] == "always" and "model" not in args:
        args["model"] = models[0]
    pols = {m: make_policy(policy_cfg["name"], models, m, args) for m in models}
    hf = {m: hf_model(str(tiny / m)) for m in models}
    for m, p in pols.items():
        p.tokenizer = tok
        p.setup(torch.device("cpu"), torch.float32, hf[m].config.hidden_size, hf[m].config.vocab_size)
    tokens, n_prompt, owner, lease = list(prompt), len(prompt), models[0], None
    state = pols[owner].initial_state(tokens)
    per_model: Counter[str] = Counter()
    with torch.no_grad():
        while len(tokens) - n_prompt < max_new:
            out = hf[owner](torch.tensor([tokens]), output_hidden_states=True)
            logits, hidden = out.logits[0, -1:].float(), out.hidden_states[-1][0, -1:]
            t = int(logits.argmax(-1))
            view = RouteRequest("r", owner, tokens, n_prompt, state, lease)
            result = StepResult(logits, hidden, torch.tensor([t]), hf[owner].get_input_embeddings())
            decision = resolve(pols[owner], pols[owner].route([view], result))[0]
            if lease is not None and lease.decides:
                # The stop pattern by decoding the lease's whole text (the engine checks it incrementally).
                def stop_reached(lease=lease, t=t) -> bool:
                    text = tok.decode(tokens[lease.start :] + [t], skip_special_tokens=True)
                    return text.endswith(lease.stop_pattern)

                target, commit = (lease.return_to if lease.advance(stop_reached) else owner), True
            else:
                target = decision
                commit = target == owner or pols[owner].send(view, target, t)
            if commit:
                tokens.append(t)
                per_model[owner] += 1
            if target != owner:
                source, owner = owner, target
                lease = pols[owner].receive(RouteRequest("r", owner, tokens, n_prompt, state, None), source)
                if lease is not None:
                    lease.begin(source, len(tokens))
    return tokens[n_prompt:], dict(per_model)


def make_engine(tiny: Path, models: list[str], policy: dict, thresholds: dict | int = 1) -> Engine:
    cfg = {
        "models": {m: {"path": str(tiny / m), "kv_cache_tokens": 2048, "block_size": 4} for m in models},
        "entry": models[0],
        "policy": policy,
        "batching": {"thresholds": thresholds, "max_wait_ms": 2.0},
    }
    return Engine.from_config(cfg)


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def record_chunks(engine: Engine) -> dict[tuple[str, str], list[tuple[int, int, bool]]]:
    """Wrap every runner to log which token positions of which request each model computes, and whether in a step
    launched ahead (before the token it runs was known on the host)."""
    log: dict[tuple[str, str], list[tuple[int, int, bool]]] = {}
    for name, sub in engine.subservers.items():
        orig = sub.runner.forward

        def forward(chunks, orig=orig, name=name, **kw):
            for c in chunks:
                ahead = isinstance(c.seq, AheadRow)
                rid = c.seq.seq.request_id if ahead else c.seq.request_id
                log.setdefault((name, rid), []).append((c.seq.num_computed_tokens, c.num_new_tokens, ahead))
            return orig(chunks, **kw)

        sub.runner.forward = forward
    return log


def computed_run(runs: list[tuple[int, int, bool]], where: str) -> tuple[int, int]:
    """(positions computed for the request, void ahead rows) from a model's log of one request. The positions form
    one contiguous run from 0 (no recompute), except that a row launched ahead whose token did not stay (routed
    away, finished) is computed again where the run goes on. So an ahead row runs the next position, and the only
    step back allowed is over such a row: one position, right after it."""
    pos, void, tentative = 0, 0, False
    for start, n, ahead in runs:
        if tentative and start == pos - 1:
            pos, void = pos - 1, void + 1  # the ahead row before was void: its position runs again
        assert start == pos, f"{where}: recomputed or skipped at {start} (expected {pos})"
        assert not ahead or n == 1, f"{where}: an ahead row of {n} tokens"
        pos += n
        tentative = ahead
    return pos, void


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    for sub in engine.subservers.values():
        assert sub.block_manager.num_free_blocks == sub.block_manager.num_blocks, sub.name
        assert not sub.seqs, sub.name


@pytest.mark.parametrize("case", sorted(CASES))
def test_routed_equals_naive_reference(tiny_dir: Path, case: str) -> None:
    models, policy = CASES[case]
    engine = make_engine(tiny_dir, models, policy, thresholds={models[0]: 3, models[-1]: 2})
    prompts = prompts_for(engine.vocab_size)
    chunks = record_chunks(engine)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    total_handoffs = 0
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_per_model = naive_generate(tiny_dir, models, policy, prompt, MAX_NEW)
        assert out.token_ids == ref_tokens, f"{case}: prompt of {len(prompt)} tokens diverged"
        assert out.stats["tokens_per_model"] == ref_per_model
        # (the reference counts each model from its first committed token on: its first key made the first token)
        assert out.stats["first_token_model"] == next(iter(ref_per_model))
        total_handoffs += out.stats["handoffs"]
        # No recompute: on each model, the positions computed form one contiguous run from 0 (but for void rows
        # of steps launched ahead, at most one per handoff away and one at the end, each computed again).
        for m in models:
            pos, void = computed_run(chunks.get((m, out.request_id), []), f"{case}/{m}")
            forwarded = out.stats["forwarded_per_model"].get(m, 0)
            assert forwarded in (pos, pos - 1), f"{case}/{m}: {forwarded} tokens forwarded, run of {pos}"
            void += pos - forwarded  # (the last ahead row, void: the request finished)
            assert void <= out.stats["handoffs"] + 1, f"{case}/{m}: {void} void ahead rows"
    if case == "always-small":
        assert total_handoffs == 0
    else:
        assert total_handoffs > 0, f"{case}: no request was ever routed; the test would prove nothing"
    assert_all_free(engine)
    engine.shutdown()


def test_always_small_and_large_equal_single_model(tiny_dir: Path) -> None:
    prompts = prompts_for(1024)[:4]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for target in ("small", "large"):
        routed = make_engine(tiny_dir, ["small", "large"], {"name": "always", "model": target})
        single = Engine.from_config({"models": {target: {"path": str(tiny_dir / target), "kv_cache_tokens": 2048}}})
        a = [o.token_ids for o in routed.generate(prompts, params)]
        b = [o.token_ids for o in single.generate(prompts, params)]
        assert a == b
        assert_all_free(routed)
        routed.shutdown()
        single.shutdown()


def test_background_threads_equal_stepped(tiny_dir: Path) -> None:
    models, policy = CASES["r2r"]
    prompts = prompts_for(1024)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    stepped = make_engine(tiny_dir, models, policy)
    expected = [o.token_ids for o in stepped.generate(prompts, params)]
    stepped.shutdown()
    bg = make_engine(tiny_dir, models, policy, thresholds={"small": 4, "large": 2})
    bg.start()
    got = [o.token_ids for o in bg.generate(prompts, params)]
    assert got == expected
    assert_all_free(bg)
    bg.shutdown()


def test_cancel_frees_kv_on_every_model(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, *CASES["random"])
    prompts = prompts_for(1024)
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(30):
        engine.step()
    assert any(len(r.holders) > 1 for r in engine.requests.values()), "expected requests parked on both models"
    for rid in ids:
        out = engine.abort(rid)
        assert out is not None and out.finish_reason == "abort" and out.finished
    assert not engine.has_unfinished()
    assert_all_free(engine)
    engine.shutdown()


class _BoolPolicy(Policy):
    """Every third output position goes to the peer, answered as a boolean."""

    name = "test-bool"

    def route(self, batch, result):
        return [self.model == self.models[0] and r.output_len % 3 == 2 for r in batch]


class _BadPolicy(Policy):
    name = "test-bad"

    def route(self, batch, result):
        return ["nonexistent-model"] * len(batch)


def test_boolean_route_results(tiny_dir: Path) -> None:
    if "test-bool" not in POLICIES:
        register(_BoolPolicy)
    engine = make_engine(tiny_dir, ["small", "large"], {"name": "test-bool"})
    prompt = prompts_for(1024)[2]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    ref, per_model = naive_generate(tiny_dir, ["small", "large"], {"name": "test-bool"}, prompt, 12)
    assert out.token_ids == ref
    assert out.stats["handoffs"] > 0 and per_model.get("large", 0) > 0
    assert_all_free(engine)
    engine.shutdown()


def test_unknown_model_in_route_is_a_clear_error(tiny_dir: Path) -> None:
    if "test-bad" not in POLICIES:
        register(_BadPolicy)
    engine = make_engine(tiny_dir, ["small", "large"], {"name": "test-bad"})
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0]
    assert out.finish_reason == "error"
    assert "nonexistent-model" in out.error and "not one of the models" in out.error
    assert_all_free(engine)
    # The engine is still up: the next request gets the same clear error, nothing hangs or leaks.
    again = engine.generate([[8, 9]], SamplingParams(max_new_tokens=2))[0]
    assert again.finish_reason == "error"
    assert_all_free(engine)
    engine.shutdown()


def test_out_of_order_message_fails_only_its_request(tiny_dir: Path) -> None:
    """A subserver that gets an impossible message (a 'return' for a request it never parked) fails that
    request cleanly and keeps its loop running for the others."""
    from tokenrouter.transport.messages import Arrive

    engine = make_engine(tiny_dir, *CASES["random"])
    engine.start()
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    bogus = Arrive("nobody", [1, 2], False, 2, params, {}, "large", {})
    engine.subservers["small"].submit(bogus)
    import threading

    outs: list = []
    worker = threading.Thread(target=lambda: outs.extend(engine.generate([[5, 6, 7]], params)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert outs, "the subserver loop stopped serving after a bad message"
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 6
    assert all(t.is_alive() for t in engine._threads)
    assert_all_free(engine)
    engine.shutdown()


def test_release_overtaking_a_returning_handoff(tiny_dir: Path) -> None:
    """Over a transport without one order across messages, a cancel's Release can reach a model before
    the handoff that was already on its way back there; the late handoff must be answered as 'nothing held',
    never revive the request or kill the loop."""
    from tokenrouter.transport.messages import Arrive, Release, Released

    engine = make_engine(tiny_dir, *CASES["random"])
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts_for(1024)]
    small = engine.subservers["small"]

    def parked_on_small() -> list[str]:
        return [r for r in rids if r in small.seqs and small.seqs[r].status.value == "parked"]

    for _ in range(200):
        engine.subservers["small"].safe_step()  # only the small model runs: handoffs pile up on large
        engine._pump()
        if parked_on_small():
            break
    parked = parked_on_small()[0]
    events: list = []
    small.emit, emit = events.append, small.emit
    small.handle(Release(parked, "abort"))
    small.handle(Arrive(parked, [7], False, 3, params, {}, "large", {}))
    small.emit = emit
    assert [type(e) for e in events] == [Released, Released]
    assert events[0].held and not events[1].held
    assert parked not in small.seqs
    for rid in rids:
        engine.abort(rid)
    assert_all_free(engine)
    engine.shutdown()
