"""The policy interface: `route`, `send`, `receive` (what a routing-policy author writes).

After every forward pass of a model, its subserver calls `route(batch, result)` once for the requests that
sampled a token; it returns one model name per request (the current model's name continues locally; a
two-model policy may return booleans, True meaning "the peer"). For each request that leaves, `send`
decides whether the token that triggered the switch is committed or dropped (the target then produces its
own), and `receive` decides how the target resumes: a fixed number of tokens then back, until a stop
pattern, or until the target's own `route` says otherwise.

One policy object lives in each subserver (in Triton, each its own process): per-request state that must
follow the request goes in `RouteRequest.state`, a JSON-serializable dict carried by every handoff.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, ClassVar

import torch

from tokenrouter.sampling_params import SEED_RANGE


@dataclass
class Lease:
    """How a request resumes on the model it was sent to; None fields do not apply."""

    return_to: str | None = None  # where to hand back when the lease ends (the sender by default)
    max_tokens: int | None = None  # hand back after producing this many tokens here
    stop_pattern: str | None = None  # ... or as soon as the text produced here ends with this
    until_route: bool = False  # keep decoding until this model's own `route` hands it on
    produced: int = 0  # tokens produced here under this lease so far (kept by the engine)
    start: int = 0  # len(token_ids) when the lease began (kept by the engine, for stop_pattern)

    # The lease's transitions, for every executor of the routing rules (the engine's subserver, Std.
    # Serving's dispatcher, the tests' naive reference): one place for them.

    def begin(self, source: str, num_tokens: int) -> None:
        """The request arrived from `source` holding `num_tokens` tokens: the lease starts counting here."""
        self.return_to = self.return_to or source
        self.produced, self.start = 0, num_tokens

    @property
    def decides(self) -> bool:
        """Whether the lease, not `route`, decides where the request goes after each token here."""
        return not self.until_route

    def advance(self, stop_reached: Callable[[], bool]) -> bool:
        """One more token produced under the lease (it always commits); True when the lease ends with it.
        `stop_reached()` says whether the text produced here now ends with `stop_pattern` (asked only then:
        the engine checks it incrementally, a reference may decode)."""
        self.produced += 1
        done = self.max_tokens is not None and self.produced >= self.max_tokens
        if self.stop_pattern is not None and not done:
            done = stop_reached()
        return done

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Lease | None:
        return None if d is None else cls(**d)


@dataclass
class RouteRequest:
    """What a policy sees of one request in the batch (the sampled token is not yet in `token_ids`)."""

    request_id: str
    model: str  # the model that just ran it
    token_ids: list[int]  # prompt + committed output
    num_prompt_tokens: int
    state: dict[str, Any]
    lease: Lease | None = None

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class StepResult:
    """One forward pass's outputs for the sampled rows, on the model's device (no host copies)."""

    def __init__(
        self,
        logits: torch.Tensor,  # [S, V] float32
        hidden: torch.Tensor,  # [S, H] final-norm hidden state of the last token
        token_ids: torch.Tensor,  # [S] sampled ids
        embed_tokens: torch.nn.Module,
        step_values: torch.Tensor | None = None,
    ) -> None:
        self.logits, self.hidden, self.token_ids = logits, hidden, token_ids
        self._embed_tokens = embed_tokens
        # Host copy of the policy's `step_tensors` for this step, when the engine computed it already.
        self.step_values = step_values

    @cached_property
    def log_probs(self) -> torch.Tensor:  # [S, V]
        return torch.log_softmax(self.logits, dim=-1)

    @cached_property
    def entropy(self) -> torch.Tensor:  # [S], nats
        lp = self.log_probs
        return -(lp.exp() * lp).sum(-1)

    @cached_property
    def normalized_entropy(self) -> torch.Tensor:  # [S] in [0, 1]: H / log(V)
        return self.entropy / math.log(self.logits.shape[-1])

    @cached_property
    def token_embeddings(self) -> torch.Tensor:  # [S, H] embedding of each sampled token
        return self._embed_tokens(self.token_ids)


RouteDecision = str | bool


def _seed_arg(policy: str, seed: Any) -> int:
    """The `seed` argument every policy takes, as an int (it seeds a torch.Generator), or a ValueError."""
    lo, hi = SEED_RANGE
    # bool is an int subclass (`seed: true` is a mistake); 7.0 from a YAML or JSON writer is 7.
    ok = not isinstance(seed, bool) and isinstance(seed, int | float) and float(seed).is_integer()
    if not ok or not lo <= seed <= hi:
        raise ValueError(f"policy {policy!r}: argument 'seed' must be an integer in [{lo}, {hi}], got {seed!r}")
    return int(seed)


class Policy(ABC):
    """A routing policy instance bound to one subserver (`self.model`) of a deployment with `self.models`.

    Subclasses set `name`, read their arguments from the YAML `policy:` section (passed as `args`; unknown
    arguments are an error), and implement `route`; `send` / `receive` defaults follow R2R: drop the
    triggering token, the target produces one token, then hands back.
    """

    name: ClassVar[str] = ""
    # Arguments every policy accepts; subclasses add theirs in `ARGS` (name -> default).
    COMMON_ARGS: ClassVar[dict[str, Any]] = {"seed": 0}
    ARGS: ClassVar[dict[str, Any]] = {}
    # `route` reads only the host: the requests and `host_step_values(result)`, not `result`'s device tensors. Then
    # a model may launch its next step before `route` runs (ModelConfig.step_ahead), and that step's output may
    # overwrite those tensors (a CUDA graph's buffers) or hold more rows than the batch. Every built-in policy
    # does; a policy that computes on the device in `route` leaves it False and its models never step ahead.
    HOST_ROUTE: ClassVar[bool] = False
    # `route`, called for a row under a lease that decides, changes nothing: its answer for that row is ignored, and
    # it writes no per-request state for it. Then a model may commit such a row's token without a step, and so
    # without calling `route` (ModelConfig.shadow_decode: the token was decoded while the request was away). Every
    # built-in policy's does; a policy whose `route` keeps state on leased rows leaves it False: no shadow rows.
    PURE_LEASED_ROUTE: ClassVar[bool] = False

    def __init__(self, models: list[str], model: str, args: dict[str, Any] | None = None) -> None:
        self.models = list(models)
        self.model = model
        defaults = {**self.COMMON_ARGS, **self.ARGS}
        args = dict(args or {})
        unknown = sorted(set(args) - set(defaults))
        if unknown:
            raise ValueError(f"policy {self.name!r}: unknown argument(s) {unknown}; known: {sorted(defaults)}")
        self.args = {**defaults, **args}
        self.seed = _seed_arg(self.name, self.args["seed"])

    # -- lifecycle ------------------------------------------------------------------------------------

    # The deployment's tokenizer (None for token-id-only models), set by the subserver before `setup`,
    # for policies whose rule depends on text (e.g. a step delimiter).
    tokenizer: Any = None

    def setup(self, device: torch.device, dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        """Called once in the subserver after its model loaded (e.g. build the router network there)."""

    def initial_state(self, prompt_ids: list[int]) -> dict[str, Any]:
        """Per-request state at admission (travels with the request)."""
        return {}

    def step_tensors(self, result: StepResult) -> torch.Tensor | None:
        """The device work of `route` ([S] or [S, k] per-row values, e.g. a router network's logits), or None.

        The engine runs it right after the forward pass on the greedy tokens, inside the step's CUDA graph
        when there is one, and copies its output to the host in the step's single synchronization; `route`
        reads it through `host_step_values`. So it must be graph-safe: tensor ops on the given shapes only,
        no host copies (`.item()`, `.tolist()`), no branches on tensor values. Rows may include padding.
        """
        return None

    def host_step_values(self, result: StepResult) -> torch.Tensor | None:
        """This step's `step_tensors` on the host: the engine's copy, or computed now (e.g. in a reference)."""
        if result.step_values is not None:
            return result.step_values
        values = self.step_tensors(result)
        return None if values is None else values.cpu()

    # -- the three functions --------------------------------------------------------------------------

    @abstractmethod
    def route(self, batch: list[RouteRequest], result: StepResult) -> list[RouteDecision]:
        """One decision per request: a model name, or for two-model policies a bool (True = the peer)."""

    def send(self, req: RouteRequest, target: str, token: int) -> bool:
        """Commit the token that triggered the switch (True) or drop it and let the target produce one."""
        return False

    def receive(self, req: RouteRequest, source: str) -> Lease | None:
        """How `req`, arriving from `source`, resumes on `self.model`; None: as usual, `route` decides.

        Default (R2R): the first model (the small one) resumes as usual; any other produces one token and
        hands back."""
        if self.model == self.models[0]:
            return None
        return Lease(return_to=source, max_tokens=1)

    # -- helpers --------------------------------------------------------------------------------------

    @property
    def peer(self) -> str:
        if len(self.models) != 2:
            raise ValueError(f"policy {self.name!r}: 'the peer' is only defined for two models, got {self.models}")
        return self.models[1] if self.model == self.models[0] else self.models[0]

    def uniform(self, req: RouteRequest, salt: str = "") -> float:
        """A reproducible U[0, 1) draw for this request at its current length: the same in any batch, any
        deployment, and in a naive reference that follows the same rule."""
        key = f"{self.seed}|{salt}|{len(req.token_ids)}|{_prompt_text(tuple(req.token_ids[: req.num_prompt_tokens]))}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


@lru_cache(maxsize=64)
def _prompt_text(prompt: tuple[int, ...]) -> str:
    """The prompt as the draw's key spells it (a list's repr). Cached: a request asks at every token of every
    step, and writing out a 100-token prompt costs ~5x the rest of the draw (16 vs 3 us on the CI machine). The
    prompts of more requests than a step holds at once; each entry keeps its prompt twice (ids and text)."""
    return repr(list(prompt))


def step_hook(policy: Policy, embed_tokens: torch.nn.Module):
    """`policy.step_tensors` as a runner's step hook: (logits, hidden, greedy tokens) -> per-row values, run (and
    captured in CUDA graphs) right after each forward pass."""

    def hook(logits: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor | None:
        return policy.step_tensors(StepResult(logits, hidden, greedy, embed_tokens))

    return hook


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy findable by its `name` from YAML."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name`")
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str, module: str | None = None) -> type[Policy]:
    """The policy registered as `name`, after importing the built-ins and `module` (a dotted path), so a
    policy of your own registers itself without changes here."""
    import importlib

    import tokenrouter.routing.policies  # noqa: F401  (registers the built-in policies)

    if module is not None:
        if not isinstance(module, str) or not module:
            raise ValueError(f"policy 'module' must be a dotted module path, got {module!r}")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"policy module {module!r} could not be imported: {e}") from None
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; available: {sorted(POLICIES)}")
    return POLICIES[name]


def make_policy(name: str, models: list[str], model: str, args: dict[str, Any] | None = None) -> Policy:
    """An instance of the policy registered as `name` for `model`; `args["module"]` is imported first."""
    args = dict(args or {})
    return policy_class(name, args.pop("module", None))(models, model, args)


def check_policy(name: str, models: list[str], args: dict[str, Any] | None = None) -> None:
    """Raise ValueError when `name` is unknown or its arguments are refused on any model, without loading
    anything: policies check their arguments when constructed and build networks only in `setup`."""
    for model in models:
        make_policy(name, models, model, args)


def resolve(policy: Policy, decisions: list[RouteDecision]) -> list[str]:
    """Model names from `route`'s answers, with clear errors for anything else."""
    out = []
    for d in decisions:
        if isinstance(d, bool):
            out.append(policy.peer if d else policy.model)
        elif isinstance(d, str) and d in policy.models:
            out.append(d)
        else:
            raise ValueError(f"policy {policy.name!r} routed to {d!r}, which is not one of the models {policy.models}")
    return out
