"""Deployment config: YAML (or the same dict) -> validated dataclasses, parsed once.

Example::

    models:
      small: {path: models/tiny/small, dtype: float32, device: cpu}
    entry: small

Relative model paths, the tokenizer's and a policy's file arguments (a router `checkpoint`, GlimpRouter's
`tokenizer`) resolve against the YAML file's folder (or the working directory for a dict); `$VARS` and `~` expand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

# The shortest watchdog_timeout_s: two of a subserver's heartbeats (serving/watchdog.HEARTBEAT_S).
WATCHDOG_MIN_S = 2.0


class ConfigError(ValueError):
    """A deployment config that cannot be served: the message names the offending key."""


def _spec(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None, accepts: str = ""
) -> Any:
    """A field default plus the range `_check_fields` holds the number (or each value of a mapping) to;
    `accepts` words the accepted values where the range alone says too little."""
    meta = {"ge": ge, "gt": gt, "le": le, "accepts": accepts}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None and v != ""})


def _is_address(url: object) -> bool:
    """host:port with a port in 1..65535; an IPv6 host in brackets."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or "/" in url or not url:
        return False
    try:
        parts = urlsplit("//" + url)
        return bool(parts.hostname) and parts.port is not None and 0 < parts.port < 65536
    except ValueError:
        return False


@dataclass
class ModelConfig:
    """One model (one subserver): where its weights are, where it runs, and how its KV cache is sized."""

    name: str
    path: str
    # Served by a peer Triton server (`tokenrouter serve --peer` there) at this gRPC address, host:port; the
    # router reaches it over Triton gRPC streaming. `path` must still hold the model's config.json (the
    # router reads its architecture); its weights load on the peer. Triton deployment only.
    url: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    load_format: Literal["auto", "dummy"] = "auto"
    # Seed of the random weights when load_format is dummy.
    seed: int = 0
    # Context limit; None takes max_position_embeddings from config.json.
    max_model_len: int | None = _spec(None, ge=2)
    block_size: int = _spec(16, ge=1)
    # KV pool size: an explicit token budget wins; otherwise, on CUDA, this model may use
    # kv_memory_fraction of the whole GPU for its weights plus its KV pool (models sharing a GPU split it:
    # their fractions must sum to <= 1); on the CPU, `cpu_kv_cache_tokens`.
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = _spec(0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    # Attention backend: torch (exact, any device), triton (GPU kernels), auto (triton on CUDA when
    # the triton package is importable, else torch).
    attention: Literal["auto", "torch", "triton"] = "auto"
    # CUDA graphs (GPU with the triton attention backend): decode steps of up to cuda_graph_max_batch
    # sequences and extends of up to cuda_graph_max_tokens tokens (in steps of 16 up to 256, then of 64; past 128
    # tokens over at most 16 sequences: short prefills too) replay captured graphs; 0 or enforce_eager turns them
    # off. Capture takes memory (one shared pool, plus each graph's logits) and a few seconds at startup.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = _spec(64, ge=0, accepts="an integer >= 0 (0 turns CUDA graphs off)")
    cuda_graph_max_tokens: int = _spec(512, ge=0, accepts="an integer >= 0 (0 turns CUDA graphs off)")
    # The routing policy's tensor work (`step_tensors`) runs inside the forward step, in its CUDA graph, and
    # its values reach the host in the step's one synchronization. false: after the step, as separate kernels
    # with a synchronization of their own (how a router outside the serving loop runs; an ablation switch).
    route_in_step: bool = True
    # Step ahead: while every row of a step decodes on here next as far as the host can tell (greedy, no lease that
    # decides, nothing else waiting), launch the next step before this one's tokens reach the host, fed them on
    # the device: the host's routing, commits and input building then overlap the GPU instead of leaving it idle
    # between steps. A row whose token went elsewhere after all is dropped from that step. Needs route_in_step.
    step_ahead: bool = True
    # Shadow decoding (engine/shadow.py): after handing a request back under a lease (R2R: one token, then back),
    # decode its next token here anyway in the next step; if the request is sent straight back, that token commits
    # on its arrival, without a step. Greedy rows only; the outputs are the same either way.
    shadow_decode: bool = True
    # Small batches run each layer's four matmuls as Triton skinny GEMMs with the norms, SwiGLU's activation and
    # the residual adds fused in (runner/skinny_gemm.py): seven kernels a layer instead of eleven. Only as far
    # as the tuned table (runner/skinny_gemm_tuned.json) measured them faster on this GPU for this model's
    # shapes; elsewhere cuBLAS. Needs the triton attention backend (part of that fused path); false: cuBLAS.
    skinny_gemm: bool = True
    # CUDA stream priority of this model's steps (and of its captured graphs). Models sharing a GPU compete for
    # its SMs: `high` lets the model whose short steps everything waits on (the small model that routes every
    # token) get SMs as soon as they free up, rather than queue behind the large model's long matmuls.
    stream_priority: Literal["normal", "high"] = "normal"
    # SMs this model's steps may use (CUDA green contexts, torch.cuda.green_contexts; 0: all of them). A model
    # beside it on the same GPU then always finds the other SMs free: the large model's matmuls, bound by memory
    # bandwidth, may lose little on fewer SMs, and the small model's short kernels stop queueing behind them.
    # Green contexts also work in an MPS client (the served layout: probed, not served). Measured in process on an
    # H200, 0.6B + 32B: the 0.6B's steps got faster, the 32B's slower, routed throughput no higher
    # (perf/results/green_h200_2026-12-03), hence off by default. Hopper hands out SMs in groups of 8. A green
    # context's stream has the normal priority.
    num_sms: int = _spec(0, ge=0, accepts="an integer >= 0 (0: all SMs)")
    # SMs this model's captured cuBLAS matmuls leave to others: its graphs of up to 112 tokens (bound by memory
    # bandwidth; runner/model_runner.py CARVEOUT_MAX_TOKENS) are captured through cuBLASLt with torch's SM
    # carve-out, whose heuristics then size the matmuls' grids for the SMs left (0: cuBLAS as torch picks it, all
    # SMs). A soft partition: the model's other kernels still use every SM, and a matmul sized for fewer SMs runs
    # no partial wave (a green context, `num_sms`, leaves cuBLAS sizing for the whole GPU). Larger graphs and
    # eager steps (prefills) keep torch's default. On an H200, 48 for the 32B beside the 0.6B: its steps 2-10 %
    # faster alone, the 0.6B's served beside it 23 % faster (perf/results/sm_carveout_h200_2026-12-04). Not with
    # num_sms (the carve-out counts the whole GPU's SMs).
    cublas_sm_carveout: int = _spec(0, ge=0, accepts="an integer >= 0 (0: none)")
    # Before the model reports ready, run throwaway batches through it (prefills, extends, mixed and sampled
    # batches, a chunked prompt) so that no request pays for a kernel compile (engine/warmup.py). GPU only.
    warmup: bool = True
    max_num_seqs: int = _spec(256, ge=1)
    # Token budget of one forward pass; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = _spec(2048, ge=1)

    @property
    def gpu(self) -> int | None:
        """The index of the GPU this model is placed on (`cuda` means GPU 0), or None on the CPU."""
        if self.device == "cpu":
            return None
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def validate(self) -> None:
        where = f"models.{self.name}"
        _check_fields(self, f"{where}.")
        if self.url is not None and not _is_address(self.url):
            raise ConfigError(f"{where}.url must be a peer server's gRPC address, host:port (IPv6 in brackets), "
                              f"got {self.url!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"{where}.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not os.path.isdir(self.path):
            raise ConfigError(f"{where}.path: model directory {self.path!r} does not exist")
        arch_file = os.path.join(self.path, "config.json")
        if not os.path.isfile(arch_file):
            raise ConfigError(f"{where}.path: {self.path!r} has no config.json")
        try:
            with open(arch_file) as f:
                arch = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}.path: {arch_file!r} is not a readable JSON file ({e})") from None
        limit = arch.get("max_position_embeddings") if isinstance(arch, dict) else None
        if self.max_model_len is not None and isinstance(limit, int) and self.max_model_len > limit:
            # (the RoPE tables are sized by it: a billion positions asked for 32 GB before failing)
            raise ConfigError(f"{where}.max_model_len must be at most the model's max_position_embeddings ({limit}), "
                              f"got {self.max_model_len}")
        if self.url is None and self.load_format == "auto":
            from tokenrouter.runner.weights import checkpoint_files  # (torch: only where a model is local)

            try:
                checkpoint_files(self.path)
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{where}.path: {e}") from None
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(
                f"{where}.kv_cache_tokens must hold at least one block ({self.block_size}), got {self.kv_cache_tokens}"
            )
        if self.num_sms and self.cublas_sm_carveout:
            raise ConfigError(f"{where}: num_sms ({self.num_sms}) and cublas_sm_carveout ({self.cublas_sm_carveout}) "
                              "do not combine (the carve-out counts the whole GPU's SMs); set one of them")
        if self.num_sms and self.stream_priority != "normal":
            raise ConfigError(f"{where}: num_sms ({self.num_sms}) and stream_priority {self.stream_priority!r} do not "
                              "combine (a green context's stream has the normal priority); set one of them")


@dataclass
class BatchingConfig:
    """Delayed batching: a subserver steps once `thresholds[model]` requests are ready, or the oldest ready
    one waited `max_wait_ms`. `auto` re-solves thresholds from measured latencies and routing rates."""

    thresholds: dict[str, int] | int | Literal["auto"] = _spec(1, ge=1)
    max_wait_ms: float = _spec(5.0, ge=0.0)
    # With thresholds: auto, how often the Markov-chain model is re-solved while serving (the first solves of a
    # fresh deployment come sooner: engine/autotune.py, EARLY_INTERVAL_S).
    auto_interval_s: float = _spec(2.0, gt=0.0)

    def validate(self, models: list[str]) -> None:
        _check_fields(self, "batching.")
        if isinstance(self.thresholds, dict):
            unknown = sorted(set(self.thresholds) - set(models))
            if unknown:
                raise ConfigError(f"batching.thresholds names unknown model(s) {unknown}; models: {models}")

    def threshold_of(self, model: str) -> int:
        t = self.thresholds
        if isinstance(t, dict):
            return t.get(model, 1)
        return 1 if isinstance(t, str) else t


@dataclass
class EngineConfig:
    models: dict[str, ModelConfig]
    entry: str
    # Routing policy: {name: <registered policy>, ...its arguments}; default: everything stays on `entry`.
    policy: dict[str, Any] = field(default_factory=lambda: {"name": "always"})
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # Tokenizer directory; defaults to the entry model's directory.
    tokenizer: str | None = None
    # KV pool size on the CPU when kv_cache_tokens is not given.
    cpu_kv_cache_tokens: int = _spec(65536, ge=1)
    # In-process engine only (a served deployment runs every model in its own process): true gives every model
    # its own decoding-loop thread; false steps the models in turn on one thread, so one model's step waits for
    # the other's (an ablation switch).
    independent_loops: bool = True
    # Served deployments: a request still unfinished this many seconds after it arrived is aborted on every
    # model (its KV freed) and answered with an error. Bounds the work of clients that went away unnoticed
    # (Triton 2.51 reports no disconnect of a non-streaming HTTP request). None: no limit.
    request_timeout_s: float | None = _spec(None, gt=0.0)
    # Served deployments: a model's process whose decoding loop has not gone round for this many seconds (a hung
    # GPU, a deadlock), or that sent the router nothing, not even its heartbeat, for as long (stopped, or holding
    # Python's lock), is killed; the router fails the requests it held and restarts it (serving/watchdog.py).
    # Far above any step: on a 32B, a step of 2,048 tokens takes well under a second. None: no watchdog.
    watchdog_timeout_s: float | None = _spec(300.0, gt=0.0)
    # Served deployments, while a model other than the entry is down (its process died and is being restarted):
    # `refuse` answers every new request with an error until it is back, and fails the requests it held, since any
    # request may be routed to it. `route_around` serves on without it: nothing is routed to it, and a request it
    # was decoding goes on at the entry model, from the KV the entry model kept (no prefill again); the routed
    # output then differs from what the full deployment gives. The entry model down refuses in either mode.
    model_down: Literal["refuse", "route_around"] = "refuse"
    source: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        _check_fields(self, "")
        if not self.models:
            raise ConfigError("'models' must name at least one model")
        if self.entry not in self.models:
            raise ConfigError(f"entry {self.entry!r} is not one of the models {sorted(self.models)}")
        if self.entry != next(iter(self.models)):
            # The policies take the first model listed as the small one, where requests start: listed large
            # first, the entry model never routed (no error, only the large model's share at 0).
            raise ConfigError(f"entry {self.entry!r} must be the first model listed: list the models small to large "
                              f"(the routing policies take the first as the small one); listed: {list(self.models)}")
        for m in self.models.values():
            m.validate()
        if not isinstance(self.policy, dict) or not isinstance(self.policy.get("name"), str):
            raise ConfigError("'policy' must be a mapping with a 'name' (e.g. {name: r2r, threshold: 0.5})")
        self.batching.validate(list(self.models))
        least = WATCHDOG_MIN_S + self.batching.max_wait_ms / 1000
        if self.watchdog_timeout_s is not None and self.watchdog_timeout_s < least:
            # An idle loop goes round every max_wait_ms; heartbeats leave every second.
            raise ConfigError(f"watchdog_timeout_s must be at least {least:g} ({WATCHDOG_MIN_S:g} s plus "
                              f"batching.max_wait_ms), got {self.watchdog_timeout_s:g}; null turns the watchdog off")
        self._validate_shared_devices()
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            hint = ""
            if os.path.basename(self.tokenizer).startswith("bench-tokenizer"):
                # Generated, not shipped (models/ is not in git): say how to make it.
                hint = f" (build it: tokenrouter make-bench-tokenizer --out {self.tokenizer} --vocab-size <vocab_size>)"
            raise ConfigError(f"tokenizer directory {self.tokenizer!r} does not exist{hint}")
        self._validate_policy()

    def _validate_policy(self) -> None:
        """An unknown policy, or arguments it refuses, fail here rather than after every model has loaded.
        Policies check their arguments when constructed and load router weights only in `setup`, so one
        instance per model is cheap."""
        # Imported here: the routing package pulls in torch and every built-in policy.
        from tokenrouter.routing.policy import check_policy

        name, args = self.policy_spec()
        try:
            check_policy(name, list(self.models), args)
        except (ValueError, TypeError) as e:
            msg = str(e)  # the built-in policies name themselves and the argument; a bare int() error does not
            raise ConfigError(msg if repr(name) in msg else f"policy {name!r}: {msg}") from None

    def _validate_shared_devices(self) -> None:
        """Models sized by memory fraction on one GPU split that GPU: their fractions may not add up past 1
        (each model checks only its own share when it loads, so an overcommit would surface as an out-of-memory
        error in whichever model loads last)."""
        shares: dict[str, list[ModelConfig]] = {}
        for m in self.models.values():
            if m.gpu is not None and m.kv_cache_tokens is None:
                shares.setdefault(f"cuda:{m.gpu}", []).append(m)
        for device, ms in shares.items():
            total = sum(m.kv_memory_fraction for m in ms)
            if len(ms) > 1 and total > 1.0 + 1e-9:
                parts = ", ".join(f"{m.name}: {m.kv_memory_fraction}" for m in ms)
                raise ConfigError(
                    f"models on {device} claim kv_memory_fraction {total:g} of it in total ({parts}); "
                    "the fractions of models sharing a GPU must sum to <= 1"
                )

    def check_devices(self) -> None:
        """ConfigError unless every GPU a model served here names exists on this machine. Not part of `validate`:
        a host that only writes a deployment's repository (a Docker build) has no GPU to see. The commands that
        serve call it before anything starts: a `cuda` model on a machine without one was a traceback from the
        in-process engine, and ~70 lines of tritonserver's log from `serve`."""
        wanted = {name: m.gpu for name, m in self.models.items() if m.url is None and m.gpu is not None}
        if not wanted:
            return
        import torch

        count = torch.cuda.device_count()  # through NVML where it can: no CUDA initialized here (serving/server.py)
        for name, gpu in wanted.items():
            if gpu >= count:
                have = "no CUDA device" if count == 0 else f"{count} CUDA device(s)"
                raise ConfigError(f"models.{name}.device is {self.models[name].device!r}, but this machine has {have}")

    def policy_spec(self) -> tuple[str, dict[str, Any]]:
        """(policy name, its arguments); `always` without a model keeps everything on the entry model."""
        args = dict(self.policy)
        name = args.pop("name")
        if name == "always" and "model" not in args:
            args["model"] = self.entry
        return name, args

    @property
    def one_device(self) -> bool:
        """Two or more models, all served here on one device (one GPU, or the CPU): their steps slow each other, and
        the threshold tuner models that (engine/sharing.py)."""
        ms = list(self.models.values())
        return len(ms) > 1 and all(m.url is None for m in ms) and len({m.gpu for m in ms}) == 1

    @property
    def entry_model(self) -> ModelConfig:
        return self.models[self.entry]

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.entry_model.path


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _matches(tp: Any, v: object) -> bool:
    """Whether a (YAML-parsed) value fits a field's annotation. A float field takes an int; a bool is no
    number; NaN and infinities are no numbers either."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(a, v) for a in args)
    if origin is Literal:
        return any(type(v) is type(a) and v == a for a in args)
    if origin is dict:
        return isinstance(v, dict) and all(_matches(args[0], k) and _matches(args[1], x) for k, x in v.items())
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return _is_number(v) and _finite(v)
    return isinstance(v, tp)  # bool, str, None, a nested config


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer beyond any float (YAML reads 1 followed by 400 zeros as one)
        return False


def _yaml_number_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads exponent numbers without a dot and a signed exponent, such as 1e-9 or 1e308, as
    strings: say so, with the spelling it reads as a number."""
    if not isinstance(value, str):
        return ""
    m = re.fullmatch(r"([-+]?\d+)(?:\.(\d*))?[eE]([-+]?)(\d+)", value.strip())
    if m is None:
        return ""
    return f" (YAML reads {value!r} as a string: write {m[1]}.{m[2] or '0'}e{m[3] or '+'}{m[4]})"


def _describe(tp: Any, rng: str) -> str:
    """An annotation in the words of an error message, e.g. 'an integer >= 2 or null'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        parts = [_describe(a, rng) for a in args if a is not type(None)]
        text = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else f"one of {args}"
    if origin is dict:
        return "a mapping" if args[1] is Any else f"a mapping {{name: {_describe(args[1], rng)}}}"
    if tp in (int, float):
        return f"{'an integer' if tp is int else 'a number'} {rng}".rstrip()
    return {bool: "true or false", str: "a string"}.get(tp, "a mapping")


def _range_text(meta: typing.Mapping[str, Any]) -> str:
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    lo = ge if ge is not None else gt
    if lo is not None and le is not None:
        return f"in {'[' if ge is not None else '('}{lo:g}, {le:g}]"
    if lo is not None:
        return f"{'>=' if ge is not None else '>'} {lo:g}"
    return f"<= {le:g}" if le is not None else ""


def _in_range(v: float, meta: typing.Mapping[str, Any]) -> bool:
    return (
        ("ge" not in meta or v >= meta["ge"])
        and ("gt" not in meta or v > meta["gt"])
        and ("le" not in meta or v <= meta["le"])
    )


def _check_fields(obj: Any, prefix: str) -> None:
    """Every field of a config dataclass against its annotation and its `_spec` range: the one place a
    wrongly typed or out-of-range value is refused, by its key, before anything compares or uses it."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, meta = getattr(obj, f.name), f.metadata
        rng = _range_text(meta)
        if not _matches(hints[f.name], value):
            accepts = meta.get("accepts") or _describe(hints[f.name], rng)
            raise ConfigError(f"{prefix}{f.name} must be {accepts}, got {value!r}{_yaml_number_hint(value)}")
        for v in value.values() if isinstance(value, dict) else [value]:
            if rng and _is_number(v) and not _in_range(v, meta):
                raise ConfigError(f"{prefix}{f.name} must be {meta.get('accepts') or rng}, got {v!r}")


# Policy arguments that name files or folders (learned routers' `checkpoint`, GlimpRouter's `tokenizer`).
POLICY_PATH_ARGS = ("checkpoint", "tokenizer")


def resolve_path(value: str, base: Path) -> str:
    """A config path as the config means it: `$VARS` and `~` expanded, relative ones against `base`."""
    expanded = os.path.expanduser(os.path.expandvars(str(value)))
    p = Path(expanded)
    return str(p if p.is_absolute() else (base / p).resolve())


def _build(cls: type, data: dict[str, Any], where: str, **fixed: Any) -> Any:
    """Dataclass from a dict, refusing keys the dataclass does not know (values are checked by `validate`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} - set(fixed) - {"source"}
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) in {where}: {unknown}; known keys: {sorted(known)}")
    try:
        return cls(**fixed, **data)
    except TypeError as e:  # missing required key
        missing = re.findall(r"'(\w+)'", str(e).partition("missing")[2])
        raise ConfigError(f"{where}: missing required key(s) {missing}" if missing else f"{where}: {e}") from None


def read_config_file(path: str | os.PathLike) -> Any:
    """The parsed YAML of a config file; a missing, unreadable or malformed file is a one-line ConfigError."""
    name = str(path)
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {name!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {name!r} does not exist")
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"config file {name!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name!r} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {name!r} is not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message (with a source excerpt) as one line: 'line L, column C: problem'."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        context = f" ({e.context})" if e.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}"
    return " ".join(str(e).split())


def load_config(source: str | os.PathLike | dict[str, Any] | EngineConfig) -> EngineConfig:
    """Parse and validate a deployment config from a YAML path, a dict of the same shape, or pass one through."""
    if isinstance(source, EngineConfig):
        source.validate()
        return source
    if isinstance(source, dict):
        data, base, origin = dict(source), Path.cwd(), None
    else:
        data = read_config_file(source) or {}
        base, origin = Path(source).resolve().parent, str(source)
    if not isinstance(data, dict):
        raise ConfigError("config must be a mapping with 'models' and 'entry'")
    data = dict(data)
    raw_models = data.pop("models", None)
    if not isinstance(raw_models, dict) or not raw_models:
        raise ConfigError("config needs 'models': a mapping of model name -> {path, dtype, device, ...}")
    models = {}
    for name, m in raw_models.items():
        m = {} if m is None else m
        if isinstance(m, dict) and isinstance(m.get("path"), str):
            m = {**m, "path": resolve_path(m["path"], base)}
        models[str(name)] = _build(ModelConfig, m, f"models.{name}", name=str(name))
    if "entry" not in data and len(models) == 1:
        data["entry"] = next(iter(models))
    if "batching" in data:
        data["batching"] = _build(BatchingConfig, data["batching"] or {}, "batching")
    if isinstance(data.get("policy"), str):
        data["policy"] = {"name": data["policy"]}
    policy = data.get("policy")
    if isinstance(policy, dict):
        # Like model paths: a deployment's router files travel with it (a server's working directory is not
        # the YAML's).
        data["policy"] = {k: resolve_path(v, base) if k in POLICY_PATH_ARGS and isinstance(v, str) and v else v
                          for k, v in policy.items()}
    if isinstance(data.get("tokenizer"), str):
        data["tokenizer"] = resolve_path(data["tokenizer"], base)
    cfg = _build(EngineConfig, data, "config", models=models)
    cfg.source = origin
    cfg.validate()
    return cfg
