"""Unit tests of the built-in routing policies on fabricated step results (no model runs).

Each test checks a policy's published decision rule, its send / receive answers, its argument checks and,
for the learned routers, the network's architecture, seeding and checkpoint loading.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tokenrouter.routing.policies.citer import CiterPolicy
from tokenrouter.routing.policies.collm import CoLLMPolicy
from tokenrouter.routing.policies.glimprouter import top_k_entropy
from tokenrouter.routing.policies.query import QueryPolicy
from tokenrouter.routing.policies.r2r import R2RPolicy, R2RRouter
from tokenrouter.routing.policy import POLICIES, Lease, Policy, RouteRequest, StepResult, make_policy, resolve
from tokenrouter.runner.model import CausalLM

# Deliberately not "small"/"large": policies must read the names from `models`.
S, L = "draft", "target"
MODELS = [S, L]
H, V = 16, 128
CPU = torch.device("cpu")

TWO_MODEL = ["random", "query", "r2r", "citer", "rstitch", "collm", "glimprouter"]
ALL = ["always", "mixture", *TWO_MODEL]


# -- fabrication helpers -------------------------------------------------------------------------------


def req(prompt: list[int], output: list[int] = (), model: str = S, state: dict | None = None) -> RouteRequest:
    return RouteRequest(
        request_id=f"r{hash((tuple(prompt), tuple(output))) & 0xFFFF}",
        model=model,
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        state={} if state is None else state,
    )


def step(n: int, seed: int = 0, vocab: int = V, hidden: int = H, logits: torch.Tensor | None = None) -> StepResult:
    """A StepResult of n rows with random logits / hidden states and a tiny seeded embedding table."""
    g = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = torch.randn(n, vocab, generator=g) * 3
    emb = nn.Embedding(logits.shape[-1], hidden)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(logits.shape[-1], hidden, generator=g))
    return StepResult(
        logits=logits.float(),
        hidden=torch.randn(n, hidden, generator=g),
        token_ids=torch.randint(0, logits.shape[-1], (n,), generator=g),
        embed_tokens=emb,
    )


def batch_of(n: int, seed: int = 0, model: str = S) -> list[RouteRequest]:
    rng = random.Random(seed)
    return [req([rng.randrange(V) for _ in range(rng.randint(1, 12))], model=model) for _ in range(n)]


def built(cls: type[Policy], model: str = S, hidden: int = H, vocab: int = V, **args) -> Policy:
    p = cls(MODELS, model, args)
    p.setup(CPU, torch.float32, hidden, vocab)
    return p


# -- registry, resolve, argument checks ----------------------------------------------------------------


def test_every_policy_is_registered() -> None:
    make_policy("always", MODELS, S)  # imports the package
    assert set(ALL) <= set(POLICIES)


def test_make_policy_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope", MODELS, S)


@pytest.mark.parametrize("name", ALL)
def test_unknown_arguments_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['bogus'\]"):
        make_policy(name, MODELS, S, {"bogus": 1})


@pytest.mark.parametrize("name", TWO_MODEL)
@pytest.mark.parametrize("models", [["a"], ["a", "b", "c"]])
def test_two_model_policies_reject_other_model_counts(name: str, models: list[str]) -> None:
    with pytest.raises(ValueError, match="exactly 2 models"):
        make_policy(name, models, "a")


def test_model_checks() -> None:
    with pytest.raises(ValueError, match="at least 2 models"):
        make_policy("mixture", ["a"], "a")
    with pytest.raises(ValueError, match="distinct"):
        make_policy("random", ["a", "a"], "a")
    with pytest.raises(ValueError, match="not in"):
        make_policy("random", MODELS, "elsewhere")


@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        ("random", {"p": 1.5}, r"'p' must be in \[0, 1\]"),
        ("random", {"p": "x"}, "'p' must be a number"),
        ("random", {"p": True}, "'p' must be a number"),
        ("r2r", {"threshold": -0.1}, "'threshold' must be in"),
        ("r2r", {"hidden_dim": 0}, "'hidden_dim' must be in"),
        ("r2r", {"top_k_logits": 2.5}, "'top_k_logits' must be an integer"),
        ("citer", {"threshold": 2}, "'threshold' must be in"),
        ("collm", {"threshold": float("nan")}, "'threshold' must be"),
        ("rstitch", {"tau_high": 1.1}, "'tau_high' must be in"),
        ("query", {"by": "vibes"}, "'by' must be one of"),
        ("query", {"max_prompt_tokens": -1}, "'max_prompt_tokens' must be in"),
        ("mixture", {"weights": [0.5]}, "list of 2 numbers"),
        ("mixture", {"weights": [0.7, 0.7]}, "sum to 1"),
        ("mixture", {"weights": [1.5, -0.5]}, ">= 0"),
        ("always", {"model": "nobody"}, "'model' must be one of"),
        ("glimprouter", {"delimiter": ""}, "non-empty string"),
        ("glimprouter", {"max_step_tokens": 0}, "'max_step_tokens' must be in"),
        ("glimprouter", {"delimiter_token_ids": "12"}, "list of token ids"),
    ],
)
def test_argument_ranges(name: str, args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_policy(name, MODELS, S, args)


def test_resolve_maps_booleans_and_rejects_unknown_names() -> None:
    p = make_policy("random", MODELS, S)
    assert resolve(p, [True, False, S, L]) == [L, S, S, L]
    q = make_policy("random", MODELS, L)
    assert resolve(q, [True, False]) == [S, L]
    with pytest.raises(ValueError, match="not one of the models"):
        resolve(p, ["elsewhere"])
    with pytest.raises(ValueError, match="not one of the models"):
        resolve(p, [1])
    three = make_policy("mixture", ["a", "b", "c"], "a")
    assert resolve(three, ["c", "a"]) == ["c", "a"]
    with pytest.raises(ValueError, match="only defined for two models"):
        resolve(three, [True])


@pytest.mark.parametrize("name", ALL)
def test_empty_batch_and_json_state(name: str) -> None:
    import json

    p = make_policy(name, MODELS, S)
    p.setup(CPU, torch.float32, H, V)
    assert p.route([], step(0)) == []
    json.dumps(p.initial_state([1, 2, 3]))


# -- always / random / mixture -------------------------------------------------------------------------


def test_always() -> None:
    p = make_policy("always", MODELS, S)
    assert p.route(batch_of(3), step(3)) == [L, L, L]
    assert make_policy("always", MODELS, L).route(batch_of(2), step(2)) == [L, L]
    assert make_policy("always", MODELS, L, {"model": S}).route(batch_of(2), step(2)) == [S, S]
    assert make_policy("always", ["a", "b", "c"], "a", {"model": "b"}).route(batch_of(1), step(1)) == ["b"]
    assert p.send(req([1]), L, 5) is False
    assert make_policy("always", MODELS, L).receive(req([1]), S) == Lease(until_route=True)


def test_random_rate_reproducibility_and_leases() -> None:
    n, p_ = 4000, 0.25
    batch = batch_of(n, seed=1)
    small = make_policy("random", MODELS, S, {"p": p_})
    decisions = small.route(batch, step(n))
    rate = decisions.count(L) / n
    assert abs(rate - p_) < 4 * math.sqrt(p_ * (1 - p_) / n)
    assert set(decisions) <= {S, L}
    # The same seed gives the same draws whatever the batch order; another seed gives other draws.
    again = make_policy("random", MODELS, S, {"p": p_}).route(batch[::-1], step(n))
    assert again[::-1] == decisions
    assert make_policy("random", MODELS, S, {"p": p_, "seed": 7}).route(batch, step(n)) != decisions
    # Each decision is exactly uniform(req, "random") < p.
    assert decisions == [L if small.uniform(r, "random") < p_ else S for r in batch]
    assert set(make_policy("random", MODELS, S, {"p": 0.0}).route(batch, step(n))) == {S}
    assert set(make_policy("random", MODELS, S, {"p": 1.0}).route(batch, step(n))) == {L}
    large = make_policy("random", MODELS, L, {"p": 1.0})
    assert large.route(batch[:5], step(5)) == [L] * 5
    assert small.send(batch[0], L, 3) is False
    assert large.receive(batch[0], S) == Lease(return_to=S, max_tokens=1)
    assert small.receive(batch[0], L) == Lease(until_route=True)


def test_uniform_draw_is_the_documented_hash() -> None:
    """The draw is blake2b over "seed|salt|length|prompt list": routing decisions recorded before its prompt text
    was cached stay the same, and a prompt that shares a cached prompt's tokens but not its length does not
    share its draw."""
    import hashlib

    pol = make_policy("random", MODELS, S, {"p": 0.5, "seed": 3})

    def spelled(r: RouteRequest, salt: str) -> float:
        key = f"3|{salt}|{len(r.token_ids)}|{list(r.token_ids[: r.num_prompt_tokens])}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64

    prompt = [5, 17, 4096, 3]
    for r in (req(prompt), req(prompt, [9]), req(prompt, [9, 2]), req(prompt[:3], [3]), req([], [1])):
        for salt in ("random", "mixture:2"):
            assert pol.uniform(r, salt) == spelled(r, salt)
            assert pol.uniform(r, salt) == spelled(r, salt)  # the second time from the cache
    assert pol.uniform(req(prompt[:3], [3]), "random") != pol.uniform(req(prompt), "random")


def test_mixture_frequencies_reproducibility_and_leases() -> None:
    models, weights, n = ["a", "b", "c"], [0.2, 0.3, 0.5], 6000
    batch = batch_of(n, seed=2, model="b")
    p = make_policy("mixture", models, "b", {"weights": weights})
    decisions = p.route(batch, step(n))
    for m, w in zip(models, weights):
        assert abs(decisions.count(m) / n - w) < 4 * math.sqrt(w * (1 - w) / n)
    # Same seed on another subserver (the draw must not depend on where the request is) -> same draws.
    assert make_policy("mixture", models, "c", {"weights": weights}).route(batch, step(n)) == decisions
    assert make_policy("mixture", models, "b", {"weights": weights, "seed": 1}).route(batch, step(n)) != decisions
    # The draw follows the request's length: one more committed token is a fresh draw.
    longer = [req(r.token_ids + [0], model="b") for r in batch]
    for r in longer:
        r.num_prompt_tokens -= 1
    assert p.route(longer, step(n)) != decisions
    # Zero weights are never drawn; the default is uniform.
    assert "a" not in make_policy("mixture", models, "a", {"weights": [0.0, 0.5, 0.5]}).route(batch, step(n))
    uniform = make_policy("mixture", models, "a").route(batch, step(n))
    assert all(abs(uniform.count(m) / n - 1 / 3) < 0.03 for m in models)
    assert p.send(batch[0], "a", 1) is True
    assert p.receive(batch[0], "a") == Lease(until_route=True)


# -- query ---------------------------------------------------------------------------------------------


def test_query_by_length_is_chosen_once() -> None:
    p = make_policy("query", MODELS, S, {"max_prompt_tokens": 8})
    short, long_ = req(list(range(8))), req(list(range(9)))
    assert p.route([short, long_], step(2)) == [S, L]
    assert short.state == {"query_model": S} and long_.state == {"query_model": L}
    assert p.send(long_, L, 4) is False
    large = make_policy("query", MODELS, L, {"max_prompt_tokens": 8})
    assert large.receive(long_, S) == Lease(until_route=True)
    # Later calls, on either model, repeat the stored choice (here deliberately contradicting the length).
    later = req(list(range(20)), [1, 2], state={"query_model": S})
    assert large.route([later, long_], step(2)) == [S, L]


def test_query_by_score() -> None:
    result = step(64, seed=3)
    p = built(QueryPolicy, by="score", threshold=0.5)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H, generator=g) / math.sqrt(H)
    expected = [L if s >= 0.5 else S for s in torch.sigmoid(result.hidden @ w).tolist()]
    assert p.route(batch_of(64), result) == expected
    assert 0 < expected.count(L) < 64
    assert set(built(QueryPolicy, by="score", threshold=0.0).route(batch_of(64), result)) == {L}
    assert set(built(QueryPolicy, by="score", threshold=1.0).route(batch_of(64), result)) == {S}


# -- rstitch -------------------------------------------------------------------------------------------


def test_rstitch_routes_by_normalized_entropy() -> None:
    g = torch.Generator().manual_seed(4)
    # Rows from near one-hot to near uniform: normalized entropies spread over (0, 1).
    logits = torch.randn(40, V, generator=g) * torch.linspace(30, 0.01, 40)[:, None]
    result = step(40, logits=logits)
    ent = result.normalized_entropy
    assert ent.min() < 0.05 and ent.max() > 0.9
    tau_high, tau_low = 0.5, 0.2
    small = make_policy("rstitch", MODELS, S, {"tau_high": tau_high, "tau_low": tau_low})
    large = make_policy("rstitch", MODELS, L, {"tau_high": tau_high, "tau_low": tau_low})
    assert small.route(batch_of(40), result) == [L if e > tau_high else S for e in ent.tolist()]
    assert large.route(batch_of(40, model=L), result) == [S if e < tau_low else L for e in ent.tolist()]
    assert small.send(req([1]), L, 3) is False  # small's uncertain token is replaced
    assert large.send(req([1]), S, 3) is True  # large's confident token is kept
    assert large.receive(req([1]), S) == Lease(until_route=True, return_to=S)
    assert small.receive(req([1]), L) == Lease(until_route=True)
    # Each model compares its own entropy, so no order between the thresholds is imposed.
    make_policy("rstitch", MODELS, S, {"tau_high": 0.2, "tau_low": 0.5})


# -- learned routers: r2r, citer, collm ------------------------------------------------------------------


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_r2r_architecture() -> None:
    d, k = 32, 100
    net = built(R2RPolicy, hidden_dim=d).net
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    norms = [m for m in net.modules() if isinstance(m, nn.LayerNorm)]
    shapes = [(m.in_features, m.out_features) for m in linears]
    assert shapes == [(k, H), (3 * H, d), (d, d)] + [(d, 4 * d), (4 * d, d)] * 6 + [(d, 1)]
    assert len(norms) == 7 and all(m.normalized_shape == (d,) for m in norms)
    assert sum(isinstance(m, nn.GELU) for m in net.modules()) == 6
    expected = (k * H + H) + (3 * H * d + d) + (d * d + d) + 6 * (2 * d + 8 * d * d + 5 * d) + 2 * d + d + 1
    assert n_params(net) == expected
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in net.parameters())
    # The top-k input is clamped to the vocabulary.
    assert built(R2RPolicy, vocab=40, hidden_dim=d).net.logits_proj.in_features == 40


def r2r_reference(sd: dict[str, torch.Tensor], result: StepResult, k: int) -> torch.Tensor:
    """The rule written out by hand from a state_dict: what `R2RRouter` must compute."""
    top = torch.topk(result.logits, k, dim=-1).values
    projected = F.linear(top, sd["logits_proj.weight"], sd["logits_proj.bias"])
    x = torch.cat([result.hidden, projected, result.token_embeddings], dim=-1)
    x = F.linear(x, sd["in_proj.weight"], sd["in_proj.bias"])
    x = F.linear(x, sd["mix.weight"], sd["mix.bias"])
    for i in range(6):
        b = f"blocks.{i}."
        y = F.layer_norm(x, x.shape[-1:], sd[b + "norm.weight"], sd[b + "norm.bias"])
        y = F.gelu(F.linear(y, sd[b + "fc1.weight"], sd[b + "fc1.bias"]))
        x = x + F.linear(y, sd[b + "fc2.weight"], sd[b + "fc2.bias"])
    x = F.layer_norm(x, x.shape[-1:], sd["norm.weight"], sd["norm.bias"])
    return F.linear(x, sd["head.weight"], sd["head.bias"]).squeeze(-1)


def test_r2r_decisions_seeding_and_thresholds() -> None:
    result, n = step(256, seed=5), 256
    a, b = built(R2RPolicy, hidden_dim=32), built(R2RPolicy, hidden_dim=32)
    z = a.logits(result)
    assert torch.equal(z, b.logits(result))  # same seed, same weights, bit for bit
    assert not torch.allclose(z, built(R2RPolicy, hidden_dim=32, seed=1).logits(result))
    sd = {k_: v.detach().clone() for k_, v in a.net.state_dict().items()}
    torch.testing.assert_close(z, r2r_reference(sd, result, 100))
    # The rule: large iff sigmoid(z) >= threshold. Pick the median so both outcomes occur.
    t = torch.sigmoid(z).median().item()
    c = built(R2RPolicy, hidden_dim=32, threshold=t)
    assert c.route(batch_of(n), result) == [L if s >= t else S for s in torch.sigmoid(z).tolist()]
    assert set(built(R2RPolicy, hidden_dim=32, threshold=0.0).route(batch_of(n), result)) == {L}
    assert set(built(R2RPolicy, hidden_dim=32, threshold=1.0).route(batch_of(n), result)) == {S}
    # The large model stays (its lease governs); small's token is dropped; one large token then back.
    assert built(R2RPolicy, model=L, threshold=0.0).route(batch_of(3, model=L), result) == [L] * 3
    assert a.send(req([1]), L, 9) is False
    assert built(R2RPolicy, model=L).receive(req([1]), S) == Lease(return_to=S, max_tokens=1)
    assert a.receive(req([1]), L) == Lease(until_route=True)


def test_a_router_without_checkpoint_is_said_to_be_random(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A learned router without its checkpoint routes arbitrarily (fine for dummy-weight benchmarks): the log
    says so once, at set-up, and says nothing when a checkpoint is given."""
    with caplog.at_level(logging.WARNING):
        ref = built(R2RPolicy, hidden_dim=16)
    assert [r.getMessage() for r in caplog.records] == [
        "policy 'r2r' has no checkpoint: its router network is randomly initialised (seed 0), so its routing "
        "decisions are arbitrary; give the policy a trained `checkpoint`"]
    path = tmp_path / "router.safetensors"
    save_file(ref.net.state_dict(), str(path))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        built(R2RPolicy, hidden_dim=16, checkpoint=str(path))
    assert caplog.records == []


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_r2r_loads_checkpoint(tmp_path: Path, suffix: str) -> None:
    result, n = step(32, seed=6), 32
    ref = built(R2RPolicy, hidden_dim=16)
    for bias, expected in ((50.0, L), (-50.0, S)):
        sd = {k_: v.clone() for k_, v in ref.net.state_dict().items()}
        sd["head.weight"].zero_()
        sd["head.bias"].fill_(bias)
        path = tmp_path / f"router{bias}{suffix}"
        if suffix == ".safetensors":
            save_file(sd, str(path))
        else:
            torch.save({"state_dict": sd}, path)  # the wrapped form training scripts often write
        p = built(R2RPolicy, hidden_dim=16, checkpoint=str(path), seed=123)  # seed is irrelevant with weights
        assert set(p.route(batch_of(n), result)) == {expected}
        assert torch.equal(p.net.blocks[3].fc1.weight, ref.net.blocks[3].fc1.weight)
        # Saturated sigmoid (1.0 / 0.0 in float32) still obeys threshold 1 -> none, 0 -> all.
        assert set(built(R2RPolicy, hidden_dim=16, checkpoint=str(path), threshold=1.0).route(batch_of(n), result)) == {
            S
        }
        assert set(built(R2RPolicy, hidden_dim=16, checkpoint=str(path), threshold=0.0).route(batch_of(n), result)) == {
            L
        }
    with pytest.raises(ValueError, match="does not fit the router network"):
        built(R2RPolicy, hidden_dim=8, checkpoint=str(path))
    with pytest.raises(FileNotFoundError):
        built(R2RPolicy, checkpoint=str(tmp_path / "missing.pt"))


def test_citer_architecture_rule_and_checkpoint(tmp_path: Path) -> None:
    p = built(CiterPolicy)
    shapes = [(m.in_features, m.out_features) for m in p.net.modules() if isinstance(m, nn.Linear)]
    assert shapes == [(H, 2 * H), (2 * H, H), (H, 1)]
    assert [type(m) for m in p.net.mlp] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert n_params(p.net) == (H * 2 * H + 2 * H) + (2 * H * H + H) + (H + 1)
    result, n = step(200, seed=7), 200
    z = p.logits(result)
    assert torch.equal(z, built(CiterPolicy).logits(result))
    assert not torch.equal(z, built(CiterPolicy, seed=3).logits(result))
    h = result.hidden
    sd = p.net.state_dict()
    x = F.relu(F.linear(h, sd["mlp.0.weight"], sd["mlp.0.bias"]))
    x = F.relu(F.linear(x, sd["mlp.2.weight"], sd["mlp.2.bias"]))
    ref = F.linear(x, sd["mlp.4.weight"], sd["mlp.4.bias"]).squeeze(-1)
    torch.testing.assert_close(z, ref)
    # The rule: large iff score < threshold (a high score means the small model is fine).
    t = torch.sigmoid(z).median().item()
    assert built(CiterPolicy, threshold=t).route(batch_of(n), result) == [
        L if s < t else S for s in torch.sigmoid(z).tolist()
    ]
    assert set(built(CiterPolicy, threshold=0.0).route(batch_of(n), result)) == {S}
    assert set(built(CiterPolicy, threshold=1.0).route(batch_of(n), result)) == {L}
    # A confident checkpoint (score ~ 1) routes nothing; its opposite routes everything.
    for bias, expected in ((50.0, S), (-50.0, L)):
        sd2 = {k: v.clone() for k, v in sd.items()}
        sd2["mlp.4.weight"].zero_()
        sd2["mlp.4.bias"].fill_(bias)
        path = tmp_path / f"citer{bias}.pt"
        torch.save(sd2, path)
        assert set(built(CiterPolicy, checkpoint=str(path)).route(batch_of(n), result)) == {expected}
    assert built(CiterPolicy, model=L).net is None  # only the small model routes
    assert built(CiterPolicy, model=L).route(batch_of(2, model=L), result) == [L, L]
    assert built(CiterPolicy, model=L).receive(req([1]), S) == Lease(return_to=S, max_tokens=1)
    assert p.send(req([1]), L, 1) is False


def test_collm_architecture_rule_and_checkpoint(tmp_path: Path) -> None:
    p = built(CoLLMPolicy)
    linears = [m for m in p.net.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(H, 1)] and n_params(p.net) == H + 1
    result, n = step(200, seed=8), 200
    z = p.logits(result)
    assert torch.equal(z, built(CoLLMPolicy).logits(result))
    torch.testing.assert_close(z, (result.hidden @ linears[0].weight.T + linears[0].bias).squeeze(-1))
    t = torch.sigmoid(z).median().item()
    assert built(CoLLMPolicy, threshold=t).route(batch_of(n), result) == [
        L if s > t else S for s in torch.sigmoid(z).tolist()
    ]
    assert set(built(CoLLMPolicy, threshold=0.0).route(batch_of(n), result)) == {L}
    assert set(built(CoLLMPolicy, threshold=1.0).route(batch_of(n), result)) == {S}
    for bias, expected in ((50.0, L), (-50.0, S)):
        path = tmp_path / f"collm{bias}.safetensors"
        save_file({"proj.weight": torch.zeros(1, H), "proj.bias": torch.tensor([bias])}, str(path))
        assert set(built(CoLLMPolicy, checkpoint=str(path)).route(batch_of(n), result)) == {expected}
    assert p.send(req([1]), L, 1) is False
    assert built(CoLLMPolicy, model=L).receive(req([1]), S) == Lease(return_to=S, max_tokens=1)


def test_r2r_folds_in_proj_and_mix_at_setup() -> None:
    """The policy runs mix(in_proj(x)) as one folded map: the same logits to float32 rounding, R2R's layers and
    state_dict untouched (checkpoints still load and save as trained)."""
    policy = built(R2RPolicy, hidden_dim=32)
    net = policy.net
    assert len(net._folded) == 1 and [f.name for f in net.fused_linears()][:2] == ["logits_proj", "in_proj+mix"]
    assert set(net.state_dict()) == set(R2RRouter(H, 100, 32).state_dict())
    result = step(64, seed=3)
    folded = policy.logits(result)
    w_in = net.in_proj.weight.clone()
    with torch.no_grad():
        net.in_proj.weight.zero_()  # the layers as trained no longer matter once folded...
    assert torch.equal(policy.logits(result), folded)
    with torch.no_grad():
        net.in_proj.weight.copy_(w_in)
    net._folded = ()  # ...and unfolded they give the same map
    torch.testing.assert_close(policy.logits(result), folded, rtol=1e-5, atol=1e-5)
    # `router_kernel: torch` keeps the layers as trained.
    assert built(R2RPolicy, hidden_dim=32, router_kernel="torch").net._folded == ()


def test_r2r_top_k_in_the_model_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 small model's logits arrive widened to float32; the policy takes their top k back in bfloat16
    (half the radix passes): the router's logits are bit-identical to a float32 policy's."""
    lm = SimpleNamespace(lm_head=nn.Linear(H, V, bias=False, dtype=torch.bfloat16), model=None)
    logits = CausalLM.compute_logits(lm, torch.randn(8, H, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and torch.equal(logits.to(torch.bfloat16).float(), logits)
    result = step(8, seed=4, logits=logits)
    wide = R2RPolicy(MODELS, S, {"hidden_dim": 32, "top_k_logits": 40})
    wide.setup(CPU, torch.float32, H, V)
    narrow = R2RPolicy(MODELS, S, {"hidden_dim": 32, "top_k_logits": 40})
    narrow.setup(CPU, torch.bfloat16, H, V)
    topk, seen = torch.topk, []
    monkeypatch.setattr(torch, "topk", lambda x, *a, **kw: seen.append(x.dtype) or topk(x, *a, **kw))
    assert torch.equal(narrow.logits(result), wide.logits(result))
    assert seen == [torch.bfloat16, torch.float32]


def test_router_init_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    built(R2RPolicy, hidden_dim=16)
    built(CiterPolicy)
    assert torch.equal(torch.rand(3), before)


# -- glimprouter ---------------------------------------------------------------------------------------

# Token texts of a toy vocabulary: 0 "a", 1 "\n", 2 "\n\n", 3 ".\n\n", the rest letters.
TEXTS = ["a", "\n", "\n\n", ".\n\n"] + [chr(ord("b") + i % 20) for i in range(V - 4)]


def glimpse_step() -> StepResult:
    """Row 0: a flat top-20 (entropy log 20 ~ 3.0, hard); row 1: one dominant logit (entropy ~ 0, easy)."""
    logits = torch.full((2, V), -30.0)
    logits[0, :20] = 0.0
    logits[1, 0] = 10.0
    return step(2, logits=logits)


def test_glimprouter_top_k_entropy() -> None:
    ent = top_k_entropy(glimpse_step().logits, 20)
    assert ent[0].item() == pytest.approx(math.log(20), rel=1e-5) and ent[1].item() < 0.01


@pytest.mark.parametrize(
    ("output", "at_start"),
    [
        ([], True),  # the beginning of the output
        ([5, 0], False),  # mid-step
        ([5, 2], True),  # "\n\n" as one token
        ([5, 3], True),  # ".\n\n" merged token
        ([5, 1, 1], True),  # "\n" + "\n": the delimiter split over two tokens
        ([5, 1], False),
        ([2, 0], False),  # delimiter earlier, not at the end
    ],
)
def test_glimprouter_decides_only_at_step_starts(output: list[int], at_start: bool) -> None:
    p = make_policy("glimprouter", MODELS, S)
    p.set_token_texts(TEXTS)
    hard, easy = req([7, 8], output, state={"at_step_start": False}), req([7, 8], output, state={})
    assert p.route([hard, easy], glimpse_step()) == ([L, S] if at_start else [S, S])
    # A routed step comes back as a step start; an accepted glimpse opens a small-model step.
    assert hard.state["at_step_start"] is at_start
    if at_start:
        assert easy.state["at_step_start"] is False


def test_glimprouter_state_handoff_and_leases() -> None:
    p = make_policy("glimprouter", MODELS, S, {"max_step_tokens": 32, "delimiter": "\n"})
    r = req([7], [5, 6], state=p.initial_state([7]))
    assert r.state == {"at_step_start": True}
    # The flag set when a step was routed makes the next small-model token a glimpse even mid-text
    # (e.g. the large model's step ended at max_step_tokens).
    r.state["at_step_start"] = True
    assert p.route([r], step(1, logits=glimpse_step().logits[:1])) == [L]
    assert p.send(r, L, 4) is False
    large = make_policy("glimprouter", MODELS, L, {"max_step_tokens": 32, "delimiter": "\n"})
    assert large.receive(r, S) == Lease(return_to=S, stop_pattern="\n", max_tokens=32)
    assert large.route([r], glimpse_step()) == [L]
    assert p.receive(r, L) == Lease(until_route=True)
    # Threshold above log(20): nothing is ever hard.
    q = make_policy("glimprouter", MODELS, S, {"threshold": 3.1})
    assert q.route([req([1]), req([2])], glimpse_step()) == [S, S]


def test_glimprouter_token_id_fallbacks() -> None:
    ids = make_policy("glimprouter", MODELS, S, {"delimiter_token_ids": [2, 3]})
    none = make_policy("glimprouter", MODELS, S)
    for output, expected_ids in (([5, 2], L), ([5, 3], L), ([5, 1, 1], S), ([5, 0], S)):
        assert ids.route([req([9], output)], step(1, logits=glimpse_step().logits[:1])) == [expected_ids]
        # Without token text or ids, only the output start and hand-backs are step starts.
        assert none.route([req([9], output)], step(1, logits=glimpse_step().logits[:1])) == [S]
    assert none.route([req([9])], step(1, logits=glimpse_step().logits[:1])) == [L]


def test_glimprouter_with_a_real_tokenizer(tiny_dir: Path) -> None:
    from tokenrouter.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_dir / "tokenizer"))
    p = make_policy("glimprouter", MODELS, S, {"tokenizer": str(tiny_dir / "tokenizer")})
    p.setup(CPU, torch.float32, H, len(tok))
    prompt = tok.encode("Solve it.")
    hard = step(1, logits=torch.cat([torch.zeros(1, 20), torch.full((1, len(tok) - 20), -30.0)], dim=-1))
    for text, at_start in (("First, x = 1.\n\n", True), ("First, x = 1.\n", False), ("First, x", False)):
        r = req(prompt, tok.encode(text), state={})
        assert p.route([r], hard) == ([L] if at_start else [S]), text
