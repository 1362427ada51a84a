"""Triton Python-based backend `tokenrouter`: a thin adapter over the package.

`1/model.json` next to each model's config.pbtxt names the deployment YAML and the role:
  {"role": "router", "config": "<yaml>"}                   the `tokenrouter` entry model
  {"role": "subserver", "config": "<yaml>", "model": "small"}  one model's decoding loop
  {"role": "peer", "config": "<yaml>", "model": "large"}       `peer_large`: that model for a remote router
Everything below `initialize` lives in tokenrouter.serving and is testable without Triton.
"""

from __future__ import annotations

import json
import os

import triton_python_backend_utils as pb_utils

from tokenrouter.serving.tensors import auto_complete


def _settings(args: dict) -> dict:
    folder = os.path.join(args["model_repository"], args["model_version"])
    path = os.path.join(folder, "model.json")
    with open(path) as f:
        settings = json.load(f)
    if settings.get("role") not in ("router", "subserver", "peer"):
        raise ValueError(f"{path}: 'role' must be 'router', 'subserver' or 'peer', got {settings.get('role')!r}")
    config = settings.get("config")
    if not config:
        raise ValueError(f"{path}: 'config' (the deployment YAML) is required")
    settings["config"] = os.path.normpath(os.path.join(folder, os.path.expandvars(config)))
    return settings


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return auto_complete(auto_complete_model_config)

    def initialize(self, args: dict) -> None:
        from tokenrouter.serving.lifeline import watch_parent

        watch_parent()  # end with tritonserver, however it ends
        settings = _settings(args)
        if settings["role"] == "router":
            from tokenrouter.serving.router_model import RouterModel

            self.impl = RouterModel(args, settings, pb_utils)
        elif settings["role"] == "peer":
            from tokenrouter.serving.peer_model import PeerModel

            self.impl = PeerModel(args, settings, pb_utils)
        else:
            from tokenrouter.serving.subserver_model import SubserverModel

            self.impl = SubserverModel(args, settings, pb_utils)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self) -> None:
        self.impl.finalize()
