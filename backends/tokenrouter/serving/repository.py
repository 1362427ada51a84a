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
from tokenrouter.transport.grpc_link import peer_model_name

ROUTER = "tokenrouter"


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
    `peer`: this server is the peer that the deployment's models with a `url:` name: it serves those models
    (with the whole deployment's policy and model list, as the router's server would) and a gateway
    `peer_<model>` beside each, and no router."""
    config_path = Path(config_path).resolve()
    cfg = load_config(config_path)
    if ROUTER in cfg.models:
        raise ValueError(f"a model may not be named {ROUTER!r}: that is the router's name")
    gateways = {peer_model_name(n) for n, m in cfg.models.items() if m.url is not None}
    if clash := sorted(gateways & set(cfg.models)):
        raise ValueError(f"model name(s) {clash} are the peer gateways' names of the models with a url: rename them")
    served = [n for n, m in cfg.models.items() if (m.url is not None) == peer]
    if peer and not served:
        raise ValueError("no model names a url: a peer serves the deployment's models that do")
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
        if name not in served:
            continue  # a router's server leaves the peers' models to them; a peer serves only those
        folder = out / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        kind = "KIND_GPU" if m.gpu is not None else "KIND_CPU"
        settings = {"role": "subserver", "config": rel(folder), "model": name}
        _write(folder, _pbtxt(kind, m.gpu, env(folder), "subserver"), settings)
        if peer:
            gate = out / peer_model_name(name)
            (gate / "1").mkdir(parents=True, exist_ok=True)
            gate_settings = {"role": "peer", "config": rel(gate), "model": name}
            _write(gate, _pbtxt("KIND_CPU", None, env(gate), "peer"), gate_settings)
    # Models of an earlier deployment in the same folder would be loaded too: remove ours that are stale.
    keep = set(served) | ({peer_model_name(m) for m in served} if peer else {ROUTER})
    for stale in out.iterdir():
        if stale.is_dir() and stale.name not in keep:
            settings = stale / "1" / "model.json"
            if settings.is_file() and json.loads(settings.read_text()).get("role") in ("subserver", "peer", "router"):
                for f in sorted(stale.rglob("*"), reverse=True):
                    f.unlink() if f.is_file() else f.rmdir()
                stale.rmdir()
    return out
