"""Std. Serving's Triton repository: one plain single-model server per LLM of a routed deployment.

Each model `std_<name>` runs our engine with that one model (same ModelConfig as the routed deployment:
device, dtype, KV budget and prefix caching) and the `probe` policy, which computes the routed policy's
per-token signal beside the model (std_serving/probe_policy.py). Its folder holds config.pbtxt, 1/model.py
(a copy of std_serving/model.py), 1/engine.yaml (the single-model EngineConfig) and 1/std.json (where
that config and perf/ are, relative to 1/, so the stub can import std_serving).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tokenrouter.config import EngineConfig, load_config

PERF_DIR = Path(__file__).resolve().parents[1]
MODEL_PY = Path(__file__).resolve().with_name("model.py")
PREFIX = "std_"
SETTINGS = "std.json"
PROBE_MODULE = "std_serving.probe_policy"


def std_name(model: str) -> str:
    """The Triton model that serves `model` of the routed deployment."""
    return PREFIX + model


def std_config(cfg: EngineConfig, model: str) -> EngineConfig:
    """The single-model EngineConfig of `model`: its ModelConfig as routed (prefix caching on: the baseline
    resends the whole context for every token), thresholds 1, the deployment's tokenizer, and the probe
    policy over the routed policy (so the server reports the routed signal)."""
    name, args = cfg.policy_spec()  # `always` without a model gets the routed entry, as in the engine
    probe = {"name": "probe", "module": PROBE_MODULE, "inner": {"name": name, **args}, "models": list(cfg.models)}
    return dataclasses.replace(
        cfg,
        models={model: dataclasses.replace(cfg.models[model], enable_prefix_caching=True)},
        entry=model,
        policy=probe,
        batching=dataclasses.replace(cfg.batching, thresholds=1),
        tokenizer=cfg.tokenizer or cfg.entry_model.path,
    )


def config_dict(cfg: EngineConfig) -> dict[str, Any]:
    """`cfg` as the mapping load_config reads back (model names are keys, not fields; no `source`)."""
    data = dataclasses.asdict(cfg)
    data.pop("source", None)
    for m in data["models"].values():
        m.pop("name", None)
    return data


def _pbtxt(gpu: int | None, env: str | None) -> str:
    if gpu is not None:
        group = f"instance_group [{{ kind: KIND_GPU, count: 1, gpus: [{gpu}] }}]"
    else:
        group = "instance_group [{ kind: KIND_CPU, count: 1 }]"
    text = f"""backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ] }},
  {{ name: "max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "ignore_eos", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] }},
  {{ name: "step_values", data_type: TYPE_FP32, dims: [ -1, -1 ] }},
  {{ name: "finish_reason", data_type: TYPE_STRING, dims: [ 1 ] }}
]
{group}
"""
    if env is not None:
        text += f'parameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{env}" }} }}\n'
    return text


def write_std_repository(
    config_path: str | os.PathLike, out_dir: str | os.PathLike, execution_env: str | os.PathLike | None = None
) -> Path:
    """Write (or refresh) the Std. Serving repository for the routed deployment YAML at `config_path` under
    `out_dir`. The stubs run `execution_env` (a venv folder), by default this interpreter's venv."""
    from tokenrouter.serving import triton_install

    cfg = load_config(Path(config_path).resolve())
    env_dir = Path(execution_env) if execution_env is not None else triton_install.execution_env()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for model, mcfg in cfg.models.items():
        folder = out / std_name(model)
        version = folder / "1"
        version.mkdir(parents=True, exist_ok=True)
        # sort_keys=False: the model order of a config is meaningful (and kept readable here).
        (version / "engine.yaml").write_text(yaml.safe_dump(config_dict(std_config(cfg, model)), sort_keys=False))
        settings = {"config": "engine.yaml", "perf_dir": os.path.relpath(PERF_DIR, version.resolve())}
        (version / SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
        shutil.copy2(MODEL_PY, version / "model.py")
        env = None
        if env_dir is not None:
            # As the product's repository: Triton's documented way to give a stub its interpreter's packages.
            env = "$$TRITON_MODEL_DIRECTORY/" + os.path.relpath(env_dir.resolve(), folder.resolve())
        (folder / "config.pbtxt").write_text(_pbtxt(mcfg.gpu, env))
    # Std models of an earlier deployment in the same folder would be loaded too: remove them.
    wanted = {std_name(m) for m in cfg.models}
    for stale in out.iterdir():
        if stale.is_dir() and stale.name not in wanted and (stale / "1" / SETTINGS).is_file():
            shutil.rmtree(stale)
    return out


@contextmanager
def serving_std(
    config_path: str | os.PathLike, work_dir: str | os.PathLike, execution_env: str | os.PathLike | None = None
) -> Iterator[Any]:
    """A started, ready tritonserver (`tokenrouter.serving.server.TritonServer`) with Std. Serving's models
    for the routed deployment at `config_path`, on free ports; its `grpc_url` says where it answers. Models
    that share a GPU get CUDA MPS, as `tokenrouter serve` gives the routed deployment. The stubs run
    `execution_env` (a venv; default: this interpreter's)."""
    from _common import running_server

    from tokenrouter.serving import mps
    from tokenrouter.serving.server import ensure_models

    config_path = Path(config_path).resolve()
    ensure_models(config_path)
    cfg = load_config(config_path)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    repo = write_std_repository(config_path, work / "std_repository", execution_env)
    started_mps = False
    if mps.shared_gpus(cfg) and not mps.running():
        mps.start()
        started_mps = True
    try:
        with running_server(repo, work / "tritonserver_std.log", f"Std. Serving of {config_path.name}") as server:
            yield server
    finally:
        if started_mps and not mps.stop():
            print("warning: the CUDA MPS daemon did not quit within 30 s", file=sys.stderr)
