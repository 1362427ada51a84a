"""A config that cannot be served is refused by `load_config`, before any model loads, with one line naming
the key and what it accepts: wrong types, values out of range, unknown policies or policy arguments, and
files that are missing, a directory, or not YAML. The CLI prints that line and exits 2."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from tokenrouter.cli import main
from tokenrouter.config import ConfigError, load_config
from tokenrouter.serving.server import free_ports


@pytest.fixture(scope="module")
def two(tiny_dir: Path) -> dict:
    return {
        "models": {"small": {"path": str(tiny_dir / "small")}, "large": {"path": str(tiny_dir / "large")}},
        "entry": "small",
    }


def with_model(cfg: dict, **kw) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["models"]["small"].update(kw)
    return cfg


MODEL_VALUES = [
    (dict(kv_cache_tokens="16k"), r"models\.small\.kv_cache_tokens must be an integer or null, got '16k'"),
    (dict(kv_cache_tokens=1.5), r"models\.small\.kv_cache_tokens must be an integer or null, got 1\.5"),
    (dict(block_size="16"), r"models\.small\.block_size must be an integer >= 1, got '16'"),
    (dict(kv_memory_fraction="0.5"), r"models\.small\.kv_memory_fraction must be a number in \(0, 1\], got '0\.5'"),
    (dict(kv_memory_fraction=float("nan")), r"kv_memory_fraction must be a number in \(0, 1\], got nan"),
    (dict(kv_memory_fraction=0), r"models\.small\.kv_memory_fraction must be in \(0, 1\], got 0"),
    (dict(kv_memory_fraction=1.5), r"models\.small\.kv_memory_fraction must be in \(0, 1\], got 1\.5"),
    (dict(enable_prefix_caching="yes"), r"models\.small\.enable_prefix_caching must be true or false, got 'yes'"),
    (dict(enable_prefix_caching=1), r"models\.small\.enable_prefix_caching must be true or false, got 1"),
    (dict(seed="x"), r"models\.small\.seed must be an integer, got 'x'"),
    (dict(max_num_seqs=True), r"models\.small\.max_num_seqs must be an integer >= 1, got True"),
    (dict(max_num_batched_tokens=0), r"models\.small\.max_num_batched_tokens must be >= 1, got 0"),
    (dict(max_model_len="4k"), r"models\.small\.max_model_len must be an integer >= 2 or null, got '4k'"),
    (dict(dtype=32), r"models\.small\.dtype must be one of \('float32', 'bfloat16', 'float16'\), got 32"),
    (dict(attention="flash"), r"models\.small\.attention must be one of \('auto', 'torch', 'triton'\)"),
    (dict(load_format=None), r"models\.small\.load_format must be one of \('auto', 'dummy'\), got None"),
    (dict(device=0), r"models\.small\.device must be a string, got 0"),
    (dict(device="cuda:x"), r"models\.small\.device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
    (dict(path=5), r"models\.small\.path must be a string, got 5"),
    (dict(cuda_graph_max_batch=2.0), r"models\.small\.cuda_graph_max_batch must be an integer >= 0"),
    (dict(stream_priority=-1), r"models\.small\.stream_priority must be one of \('normal', 'high'\), got -1"),
    (dict(skinny_gemm="on"), r"models\.small\.skinny_gemm must be true or false, got 'on'"),
    (dict(num_sms=-8), r"models\.small\.num_sms must be an integer >= 0 \(0: all SMs\), got -8"),
    (dict(num_sms=0.5), r"models\.small\.num_sms must be an integer >= 0 \(0: all SMs\), got 0\.5"),
    (dict(cublas_sm_carveout=-16), r"models\.small\.cublas_sm_carveout must be an integer >= 0 \(0: none\), got -16"),
    (dict(num_sms=64, cublas_sm_carveout=48), r"models\.small: num_sms \(64\) and cublas_sm_carveout \(48\) do not"),
    (dict(num_sms=64, stream_priority="high"), r"models\.small: num_sms \(64\) and stream_priority 'high' do not"),
]


@pytest.mark.parametrize(("kw", "msg"), MODEL_VALUES, ids=lambda v: str(v)[:40])
def test_wrong_model_values_name_the_key(two: dict, kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_config(with_model(two, **kw))


TOP_VALUES = [
    ({"cpu_kv_cache_tokens": 1.5}, r"^cpu_kv_cache_tokens must be an integer >= 1, got 1\.5$"),
    ({"cpu_kv_cache_tokens": 0}, r"^cpu_kv_cache_tokens must be >= 1, got 0$"),
    ({"entry": 1}, r"^entry must be a string, got 1$"),
    ({"tokenizer": 5}, r"^tokenizer must be a string or null, got 5$"),
    ({"policy": ["random"]}, r"^policy must be a mapping, got \['random'\]$"),
    ({"batching": {"max_wait_ms": "5ms"}}, r"^batching\.max_wait_ms must be a number >= 0, got '5ms'$"),
    ({"batching": {"max_wait_ms": -1}}, r"^batching\.max_wait_ms must be >= 0, got -1$"),
    ({"batching": {"auto_interval_s": 0}}, r"^batching\.auto_interval_s must be > 0, got 0$"),
    ({"batching": {"thresholds": "4"}}, r"batching\.thresholds must be .*an integer >= 1 or 'auto', got '4'$"),
    ({"batching": {"thresholds": True}}, r"batching\.thresholds must be .*, got True$"),
    ({"batching": {"thresholds": {"small": "2"}}}, r"batching\.thresholds must be a mapping \{name: an integer >= 1\}"),
    ({"batching": {"thresholds": {"small": 0}}}, r"^batching\.thresholds must be >= 1, got 0$"),
    ({"batching": {"thresholds": 0}}, r"^batching\.thresholds must be >= 1, got 0$"),
    ({"batching": {"thresholds": {"tiny": 2}}}, r"batching\.thresholds names unknown model\(s\) \['tiny'\]"),
    ({"batching": 4}, r"^batching must be a mapping, got int$"),
    ({"request_timeout_s": 0}, r"^request_timeout_s must be > 0, got 0$"),
    ({"model_down": "fallback"}, r"^model_down must be one of \('refuse', 'route_around'\), got 'fallback'$"),
    ({"watchdog_timeout_s": "5m"}, r"^watchdog_timeout_s must be a number > 0 or null, got '5m'$"),
    ({"watchdog_timeout_s": 1},
     r"^watchdog_timeout_s must be at least 2\.005 \(2 s plus batching\.max_wait_ms\), got 1;"),
    ({"watchdog_timeout_s": 2.1, "batching": {"max_wait_ms": 500}}, r"^watchdog_timeout_s must be at least 2\.5 \("),
    ({"request_timeout_s": "2s"}, r"^request_timeout_s must be a number > 0 or null, got '2s'$"),
    ({"request_timeout_s": True}, r"^request_timeout_s must be a number > 0 or null, got True$"),
    # An integer beyond any float (YAML reads 1 and 400 zeros as one): refused, not an OverflowError.
    ({"request_timeout_s": 10**400}, r"^request_timeout_s must be a number > 0 or null, got 1000"),
]


@pytest.mark.parametrize(("text", "spelling"), [("1e308", "1.0e+308"), ("5e-1", "5.0e-1"), ("2.5E3", "2.5e+3")])
def test_yaml_exponent_strings_get_a_hint(two: dict, text: str, spelling: str) -> None:
    """YAML 1.1 reads 1e308 (no dot, unsigned exponent) as a string: the error says so and gives a spelling that
    YAML reads as a number, and that spelling loads."""
    doc = yaml.safe_dump({"request_timeout_s": text}).replace(f"'{text}'", text)  # unquoted, as a user writes it
    value = yaml.safe_load(doc)["request_timeout_s"]
    assert value == text  # YAML kept it a string
    hint = f"got {text!r} (YAML reads {text!r} as a string: write {spelling})"
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_config({**copy.deepcopy(two), "request_timeout_s": value})
    fixed = yaml.safe_load(f"request_timeout_s: {spelling}")["request_timeout_s"]
    assert load_config({**copy.deepcopy(two), "request_timeout_s": fixed}).request_timeout_s == float(text)


@pytest.mark.parametrize(("extra", "msg"), TOP_VALUES, ids=lambda v: str(v)[:40])
def test_wrong_top_level_values_name_the_key(two: dict, extra: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_config({**copy.deepcopy(two), **extra})


def test_well_typed_values_pass(two: dict) -> None:
    cfg = load_config(
        {
            **with_model(two, kv_memory_fraction=1, max_model_len=None, kv_cache_tokens=64, cuda_graph_max_batch=0),
            "batching": {"thresholds": "auto", "max_wait_ms": 0, "auto_interval_s": 1},  # ints where floats go
            "policy": "random",
        }
    )
    assert cfg.models["small"].kv_memory_fraction == 1 and cfg.batching.thresholds == "auto"
    per_model = load_config({**copy.deepcopy(two), "batching": {"thresholds": {"small": 2}}})
    assert per_model.batching.threshold_of("small") == 2


def test_a_built_config_is_checked_too(two: dict) -> None:
    cfg = load_config(copy.deepcopy(two))
    cfg.models["large"].block_size = "16"
    with pytest.raises(ConfigError, match=r"models\.large\.block_size must be an integer >= 1, got '16'"):
        load_config(cfg)


def test_yaml_strings_are_not_numbers(tmp_path: Path, tiny_dir: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  small:\n    path: {tiny_dir / 'small'}\n    kv_cache_tokens: 16k\n")
    with pytest.raises(ConfigError, match=r"models\.small\.kv_cache_tokens must be an integer or null, got '16k'"):
        load_config(path)


# -- the routing policy, before any model loads ------------------------------------------------------------


POLICIES = [
    ({"name": "nope"}, r"unknown routing policy 'nope'; available: \[.*'always'.*'random'.*\]"),
    ({"name": "random", "p": 2}, r"policy 'random': argument 'p' must be in \[0, 1\], got 2"),
    ({"name": "random", "seed": "x"}, r"^policy 'random': argument 'seed' must be an integer in \[0, \d+\], got 'x'$"),
    ({"name": "r2r", "seed": -1}, r"^policy 'r2r': argument 'seed' must be an integer in \[0, 9223372036854775807\]"),
    ({"name": "query", "seed": 1.5}, r"^policy 'query': argument 'seed' must be an integer in \[0, \d+\], got 1\.5$"),
    ({"name": "mixture", "seed": True}, r"^policy 'mixture': argument 'seed' must be an integer .*, got True$"),
    (
        {"name": "r2r", "checkpoint": "/no/such/router.pt"},
        r"^policy 'r2r': argument 'checkpoint': router checkpoint '/no/such/router\.pt' does not exist$",
    ),
    # A relative checkpoint resolves like a model path (here a dict config: against the working directory).
    ({"name": "citer", "checkpoint": "no-such-router.pt"},
     r"^policy 'citer': .* '/.*/no-such-router\.pt' does not exist$"),
    ({"name": "collm", "checkpoint": 5}, r"^policy 'collm': argument 'checkpoint' must be a file path or null, got 5$"),
    ({"name": "always", "model": "huge"}, r"policy 'always': argument 'model' must be one of \['small', 'large'\]"),
    ({"name": "rstitch", "tau": 1}, r"policy 'rstitch': unknown argument\(s\) \['tau'\]"),
    ({"name": "mixture", "weights": [1.0]}, r"policy 'mixture'"),
    ({"name": "r2r", "module": "no_such_module_xyz"}, r"policy module 'no_such_module_xyz' could not be imported"),
    ({"name": "r2r", "module": 5}, r"policy 'module' must be a dotted module path, got 5"),
]


@pytest.mark.parametrize(("policy", "msg"), POLICIES, ids=lambda v: str(v)[:40])
def test_policy_refused_before_models_load(
    two: dict, policy: dict, msg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenrouter.engine import engine as engine_module

    def no_loading(*a, **kw):
        raise AssertionError("a model started loading before the policy was checked")

    monkeypatch.setattr(engine_module, "Subserver", no_loading)
    with pytest.raises(ConfigError, match=msg):
        engine_module.Engine.from_config({**copy.deepcopy(two), "policy": policy})


def test_router_checkpoint_is_checked_before_models_load(two: dict, tmp_path: Path) -> None:
    for name in ("r2r", "citer", "collm"):
        with pytest.raises(ConfigError, match=rf"^policy '{name}': .*'{re.escape(str(tmp_path))}' is a directory"):
            load_config({**copy.deepcopy(two), "policy": {"name": name, "checkpoint": str(tmp_path)}})
        # A file that exists passes the check (whether it fits the network is known only once the model has
        # loaded and its hidden size is known); none, or null, means a seeded random router.
        ckpt = tmp_path / f"{name}.pt"
        ckpt.write_bytes(b"")
        for checkpoint in (str(ckpt), None):
            policy = {"name": name, "checkpoint": checkpoint, "seed": 7.0}
            assert load_config({**copy.deepcopy(two), "policy": policy}).policy == policy


def test_every_two_model_policy_is_accepted_with_its_defaults(two: dict) -> None:
    for name in ("always", "random", "query", "r2r", "citer", "rstitch", "collm", "mixture", "glimprouter"):
        assert load_config({**copy.deepcopy(two), "policy": name}).policy == {"name": name}


# -- the file itself -------------------------------------------------------------------------------------


def bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    flow = tmp_path / "flow.yaml"
    flow.write_text("models:\n  small: {path: x\nentry: small\n")
    indent = tmp_path / "indent.yaml"
    indent.write_text("models:\n  small:\n    path: x\n   dtype: float32\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00models")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return [
        (flow, r"config file '.*flow\.yaml' is not valid YAML: line 3, column \d+: .*"),
        (indent, r"config file '.*indent\.yaml' is not valid YAML: line 4, column 4: .*"),
        (binary, r"config file '.*binary\.yaml' is not UTF-8 text"),
        (folder, r"config file '.*folder\.yaml' is a directory, not a YAML file"),
        (tmp_path / "missing.yaml", r"config file '.*missing\.yaml' does not exist"),
    ]


def test_bad_config_files(tmp_path: Path) -> None:
    for path, msg in bad_files(tmp_path):
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_bad_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    for path, msg in bad_files(tmp_path):
        argv = [command, "--config", str(path)]
        if command == "generate":
            argv += ["--prompt", "x"]
        else:
            http, grpc, metrics = free_ports(3)
            argv += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
            argv += ["--model-repository", str(tmp_path / "repo")]
        assert main(argv) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
        assert re.search(msg, lines[0]), lines[0]
        assert not (tmp_path / "repo").exists()


def test_cli_bad_values_fail_before_loading(two: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**with_model(two, block_size="16"), "policy": "random"}, sort_keys=False))
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == "error: models.small.block_size must be an integer >= 1, got '16'\n"
    path.write_text(yaml.safe_dump({**two, "policy": "nope"}, sort_keys=False))
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown routing policy 'nope'; available: [")
    path.write_text(yaml.safe_dump(two, sort_keys=False))
    assert main(["generate", "--config", str(path), "--prompt", "x", "--max-tokens", "0"]) == 2
    assert capsys.readouterr().err == "error: --max-tokens must be an integer >= 1, got 0\n"  # the flag's name


def test_models_with_different_vocabularies_are_refused_before_loading(tiny_dir: Path, tmp_path: Path) -> None:
    """Routed models hand each other token ids: the engine refuses a pair whose vocabularies differ, and
    does so from their configs, before it builds any model (the odd model here has only a config.json)."""
    import json

    from tokenrouter import Engine

    odd = tmp_path / "odd"
    odd.mkdir()
    arch = json.loads((tiny_dir / "large" / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**arch, "vocab_size": arch["vocab_size"] + 8}))
    cfg = {"models": {"small": {"path": str(tiny_dir / "small")}, "large": {"path": str(odd), "load_format": "dummy"}},
           "entry": "small", "tokenizer": str(tiny_dir / "tokenizer")}
    with pytest.raises(ValueError, match=r"routed models must share one vocabulary; vocab sizes: .*'large': 1032"):
        Engine.from_config(cfg)


def test_model_folders_are_checked_before_models_load(two: dict, tiny_dir: Path, tmp_path: Path) -> None:
    """What a model folder must hold, refused by load_config with the key named (found by a pass as a new
    operator): weights where load_format is auto, a config.json that is JSON, and a context within the model's
    positions (a billion asked the RoPE tables for 32 GB before failing); a model entry without its path."""
    import json

    arch = json.loads((tiny_dir / "small" / "config.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(arch))
    with pytest.raises(ConfigError, match=r"^models\.small\.path: no \*\.safetensors weights in '.*bare' \(use "
                       r"load_format: dummy for random\)$"):
        load_config(with_model(two, path=str(bare)))
    assert load_config(with_model(two, path=str(bare), load_format="dummy")).models["small"].path == str(bare)
    (bare / "config.json").write_text("{'not': json}")
    with pytest.raises(ConfigError, match=r"^models\.small\.path: '.*bare/config\.json' is not a readable JSON file "
                       r"\(Expecting property name"):
        load_config(with_model(two, path=str(bare), load_format="dummy"))
    limit = arch["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"^models\.small\.max_model_len must be at most the model's "
                       rf"max_position_embeddings \({limit}\), got 1000000000$"):
        load_config(with_model(two, max_model_len=10**9))
    assert load_config(with_model(two, max_model_len=limit)).models["small"].max_model_len == limit
    cfg = copy.deepcopy(two)
    del cfg["models"]["small"]["path"]
    with pytest.raises(ConfigError, match=r"^models\.small: missing required key\(s\) \['path'\]$"):
        load_config(cfg)


@pytest.mark.skipif(__import__("torch").cuda.device_count() > 8, reason="a machine with more than 8 GPUs")
def test_cli_refuses_a_gpu_this_machine_lacks(two: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model on a GPU the machine does not have is one line and exit 2 from the commands that serve, before
    any model loads or tritonserver starts (it was a traceback, or ~70 lines of tritonserver's log); writing the
    config is fine (load_config: a build host has no GPU)."""
    cfg = with_model(two, device="cuda:8")
    assert load_config(cfg).models["small"].device == "cuda:8"
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    ports = [str(p) for p in free_ports(3)]
    for argv in (["generate", "--config", str(path), "--prompt", "x"],
                 ["serve", "--config", str(path), "--http-port", ports[0], "--grpc-port", ports[1],
                  "--metrics-port", ports[2], "--model-repository", str(tmp_path / "repo")]):
        assert main(argv) == 2
        assert re.fullmatch(r"error: models\.small\.device is 'cuda:8', but this machine has (no CUDA device|\d "
                            r"CUDA device\(s\))\n", capsys.readouterr().err)


@pytest.mark.parametrize("url", ["fe80::1", "host", "host:0", "host:99999", "[:8001", "h:80/x"])
def test_a_peer_url_must_be_host_and_port(two: dict, url: object) -> None:
    with pytest.raises(ConfigError, match=r"models\.small\.url must be a peer server's gRPC address"):
        load_config(with_model(two, url=url))


def test_the_entry_model_must_be_listed_first(two: dict) -> None:
    """Listed large first, the routing policies took the large model for the small one and the entry model never
    routed: no error, only a large-model share of 0."""
    cfg = copy.deepcopy(two)
    cfg["models"] = {"large": cfg["models"]["large"], "small": cfg["models"]["small"]}
    with pytest.raises(ConfigError, match=r"^entry 'small' must be the first model listed: list the models small "
                       r"to large .*listed: \['large', 'small'\]$"):
        load_config(cfg)
    cfg["entry"] = "large"  # first, so accepted (which model is larger is not the config's to know)
    assert load_config(cfg).entry == "large"
