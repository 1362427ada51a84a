"""Std. Serving's per-LLM Triton model (Python backend, decoupled): a plain single-model server.

One in-process `tokenrouter.Engine` with this one model, in background mode (its own decoding-loop thread,
continuous batching, prefix caching), so a dispatcher that sends the whole context for every token pays
only for the tokens the cache does not hold. Its policy is `probe`: the routed policy's per-token signal is
computed inside the step and returned as `step_values`, so the dispatcher routes on exactly what the routed
engine routes on.

    in:  input_ids INT32 [-1] (the whole context), max_tokens INT32 [1] (default 1), ignore_eos BOOL [1]
    out: output_ids INT32 [-1], step_values FP32 [-1, K] ([n, 0] when the policy computes none),
         finish_reason STRING [1]; one response with the FINAL flag, or an error for that request alone.

Copied into `<model>/1/model.py` by std_serving/repository.py, next to std.json (which says where the
engine config and perf/ are).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # how often kept Triton objects are checked for expiry


def _settings(args: dict) -> dict[str, str]:
    folder = os.path.join(args["model_repository"], args["model_version"])
    with open(os.path.join(folder, "std.json")) as f:
        settings = json.load(f)
    return {k: os.path.normpath(os.path.join(folder, v)) for k, v in settings.items()}


def _input(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _scalar(request: Any, name: str, default: Any) -> Any:
    value = _input(request, name)
    if value is None:
        return default
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from tokenrouter.serving.lifeline import watch_parent

        watch_parent()  # end with tritonserver, however it ends
        settings = _settings(args)
        if settings["perf_dir"] not in sys.path:
            sys.path.insert(0, settings["perf_dir"])
        import std_serving.probe_policy  # noqa: F401  (registers `probe`)
        from tokenrouter import Engine, SamplingParams, load_config
        from tokenrouter.serving.metrics import SubserverMetrics
        from tokenrouter.serving.router_model import KEEP_TRITON_OBJECTS_S, _Graveyard

        self.SamplingParams = SamplingParams
        config = load_config(settings["config"])
        (mcfg,) = config.models.values()
        if args.get("model_instance_kind") == "GPU":
            mcfg.device = f"cuda:{args['model_instance_device_id']}"
        self.engine = Engine(config)
        self.engine.start()
        # Triton 2.51 frees tensors' numpy arrays without the GIL when C++ drops the last reference; keep
        # every request, sender and response referenced from Python well past its use (see _Graveyard).
        self.graveyard = _Graveyard(KEEP_TRITON_OBJECTS_S)
        self.stop = threading.Event()
        self.live: dict[int, tuple[Any, Any]] = {}  # id(sender) -> (request, sender), not yet answered
        self.lock = threading.Lock()
        # The generic counters (KV blocks, requests held, steps) as the product's subservers export them.
        self.metrics = SubserverMetrics(pb_utils, args["model_name"], self.engine.entry)
        self.threads = [
            threading.Thread(target=self._sweep_forever, name="std-sweep", daemon=True),
            threading.Thread(target=self.metrics.update_forever, args=(self.stop,), name="std-metrics", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            with self.lock:
                self.live[id(sender)] = (request, sender)
            try:
                ids = _input(request, "input_ids")
                if ids is None or ids.ndim != 1:
                    raise ValueError("input_ids must be a 1-D INT32 tensor of token ids")
                params = self.SamplingParams(
                    max_new_tokens=int(_scalar(request, "max_tokens", 1)),
                    temperature=float(_scalar(request, "temperature", 0.0)),
                    top_p=float(_scalar(request, "top_p", 1.0)),
                    top_k=int(_scalar(request, "top_k", 0)),
                    ignore_eos=bool(_scalar(request, "ignore_eos", False)),
                )
                self.engine.add_request(ids.tolist(), params, listener=lambda out, s=sender: self._on_output(s, out))
            except ValueError as e:  # bad input: this request alone gets the error
                self._send(sender, error=str(e))
        return None

    def _on_output(self, sender: Any, out: Any) -> None:
        """On the engine's coordinator thread (never the decoding loop): answer once the request is final.
        Answering here, not via another thread, saves a thread hop on every token the dispatcher asks for."""
        if not out.finished:
            return
        rows = self.engine.entry.policy.take(out.request_id)
        if out.finish_reason in ("error", "abort"):
            self._send(sender, error=out.error or f"request ended: {out.finish_reason}")
            return
        self.metrics.tokens.increment(len(out.token_ids))
        values = np.array(rows, dtype=np.float32) if rows else np.zeros((len(out.token_ids), 0), np.float32)
        tensors = [
            pb_utils.Tensor("output_ids", np.array(out.token_ids, dtype=np.int32)),
            pb_utils.Tensor("step_values", values),  # [n, K]
            pb_utils.Tensor("finish_reason", np.array([out.finish_reason.encode()], dtype=np.object_)),
        ]
        self._send(sender, tensors)

    def _send(self, sender: Any, tensors: list[Any] | None = None, error: str | None = None) -> None:
        """The request's one final response (a second answer to the same request is dropped)."""
        with self.lock:
            request = self.live.pop(id(sender), (None, None))[0]
        if request is None:
            return
        if error is not None:
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error))
        else:
            response = pb_utils.InferenceResponse(output_tensors=tensors)
        self.graveyard.keep(request, sender, response, tensors)
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client went away
            log.debug("could not send a response")

    def _sweep_forever(self) -> None:
        while not self.stop.wait(SWEEP_S):
            self.graveyard.sweep()

    def finalize(self) -> None:
        self.engine.shutdown()
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)
        with self.lock:
            unanswered = [sender for _, sender in self.live.values()]
        for sender in unanswered:
            self._send(sender, error="the server is shutting down")
