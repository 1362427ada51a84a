"""A Triton model repository for a deployment: the `tokenrouter` router plus one subserver per model.

Each model is two small files: config.pbtxt (backend, instance placement and, when the stubs should run a
given Python environment, its EXECUTION_ENV_PATH; `auto_complete_config` declares the tensors) and
1/model.json (the deployment YAML, relative to it, and the role). Paths are written relative to the model
folder, so a repository keeps working when it is moved together with what it points at.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenrouter.config import load_config
from tokenrouter.serving.tensors import ROLE_PARAMETER

ROUTER = "tokenrouter"
PEER_PREFIX = "peer_"


def peer_name(model: str) -> str:
    """The Triton model through which a router on another server reaches `model` (serving/peer_model.py)."""
    return PEER_PREFIX + model


def _pbtxt(kind: str, gpu: int | None, env: str | None, role: str) -> str:
    if kind == "KIND_GPU":
        group = f"instance_group [{{ kind: KIND_GPU, count: 1, gpus: [{gpu}] }}]"
    else:
        group = "instance_group [{ kind: KIND_CPU, count: 1 }]"
    text = f'backend: "tokenrouter"\n{group}\n'
    if role != "router":
        # auto_complete reads it: a subserver gets the internal interface, not the client one.
        text += f'parameters: {{ key: "{ROLE_PARAMETER}", value: {{ string_value: "{role}" }} }}\n'
    if env is not None:
        # Triton's documented way to give a Python-backend model its interpreter's packages.
        text += f'parameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{env}" }} }}\n'
    return text


def _write(folder: Path, pbtxt: str, settings: dict) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(pbtxt)
    (folder / "1" / "model.json").write_text(json.dumps(settings, indent=2) + "\n")


def write_repository(
    config_path: str | os.PathLike, out: str | os.PathLike, execution_env: str | os.PathLike | None = None,
    peer: bool = False,
) -> Path:
    """Write (or refresh) the repository for the deployment YAML at `config_path` under `out`; with
    `execution_env` (a Python environment folder with bin/activate) every model's stub runs that Python.
    `peer`: this server offers its models to a router on another server: no router here, and a gateway
    `peer_<model>` beside each subserver."""
    config_path = Path(config_path).resolve()
    cfg = load_config(config_path)
    if ROUTER in cfg.models:
        raise ValueError(f"a model may not be named {ROUTER!r}: that is the router's name")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def rel(folder: Path) -> str:
        return os.path.relpath(config_path, (folder / "1").resolve())

    def env(folder: Path) -> str | None:
        if execution_env is None:
            return None
        return "$$TRITON_MODEL_DIRECTORY/" + os.path.relpath(Path(execution_env).resolve(), folder.resolve())

    router = out / ROUTER
    if not peer:
        (router / "1").mkdir(parents=True, exist_ok=True)
        _write(router, _pbtxt("KIND_CPU", None, env(router), "router"), {"role": "router", "config": rel(router)})
    for name, m in cfg.models.items():
        folder = out / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        kind = "KIND_GPU" if m.gpu is not None else "KIND_CPU"
        settings = {"role": "subserver", "config": rel(folder), "model": name}
        _write(folder, _pbtxt(kind, m.gpu, env(folder), "subserver"), settings)
        if peer:
            gate = out / peer_name(name)
            (gate / "1").mkdir(parents=True, exist_ok=True)
            gate_settings = {"role": "peer", "config": rel(gate), "model": name}
            _write(gate, _pbtxt("KIND_CPU", None, env(gate), "peer"), gate_settings)
    # Models of an earlier deployment in the same folder would be loaded too: remove ours that are stale.
    keep = set(cfg.models) | ({peer_name(m) for m in cfg.models} if peer else {ROUTER})
    for stale in out.iterdir():
        if stale.is_dir() and stale.name not in keep:
            settings = stale / "1" / "model.json"
            if settings.is_file() and json.loads(settings.read_text()).get("role") in ("subserver", "peer", "router"):
                for f in sorted(stale.rglob("*"), reverse=True):
                    f.unlink() if f.is_file() else f.rmdir()
                stale.rmdir()
    return out
