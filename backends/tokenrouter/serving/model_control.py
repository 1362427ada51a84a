"""Reloading a model of this Triton server whose Python-backend process died (Triton 2.51's Python backend
never restarts a dead stub itself): the router does it for its local models (router_model.py), a peer's
gateway for the model it offers to routers on other servers (peer_model.py)."""

from __future__ import annotations

import logging
import os
import urllib.error
from typing import Any

from tokenrouter.serving.server import (
    ADMIN_KEY_ENV,
    CONTROL_GRPC_ENV,
    CONTROL_URL_ENV,
    ControlUnreachable,
    control_request,
    model_states,
    reload_over_grpc,
)

RELOAD_TIMEOUT_S = 1800.0  # a large model's weights take minutes to load
# Between reload attempts: the first wait, doubling up to the last.
REVIVE_BACKOFF_S = 0.2
REVIVE_BACKOFF_MAX_S = 5.0


def reload_model(model: str, pb_utils: Any) -> None:
    """Unload and load `model` (a load of a model Triton still counts as loaded does nothing). Through the
    server's model-control API when `tokenrouter serve` said where it is: pb_utils.load_model holds the
    calling process's GIL for the whole reload, which stalls every request for as long as the model takes
    to load. Over gRPC, whose frontend runs a load or unload on a thread of its own; Triton 2.51's HTTP frontend
    runs it on the HTTP worker thread that took it, for as long as it takes, and the client streams that thread
    serves meanwhile lose their responses (server.reload_over_grpc). Over HTTP only where no gRPC address is given.
    Raises what the server answers (e.g. a server without explicit model control refuses)."""
    address, key = os.environ.get(CONTROL_GRPC_ENV), os.environ.get(ADMIN_KEY_ENV)
    if address is not None:
        reload_over_grpc(model, address, key, timeout=RELOAD_TIMEOUT_S)
        return
    url = os.environ.get(CONTROL_URL_ENV)
    if url is None:
        pb_utils.unload_model(model_name=model)
        pb_utils.load_model(model_name=model)
        return
    for action in ("unload", "load"):
        try:
            control_request(url, f"/v2/repository/models/{model}/{action}", key, timeout=RELOAD_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{action} of {model!r} refused: {e.read().decode(errors='replace')}") from None


def cannot_reload(error: Exception) -> bool:
    """Whether a reload failed because this server does not allow one (no explicit model control): retrying
    cannot help."""
    if isinstance(error, UnloadedOnPurpose):  # (its message names the model, which may say anything)
        return False
    return "not allowed" in str(error) or "explicit" in str(error).lower()


def reload_failure(error: Exception) -> str:
    """A failed reload's cause in one line, the same line for the same cause: a reviver retrying every few
    seconds logs each cause once (at shutdown, Triton stops serving HTTP before it unloads the router, so
    every attempt is refused until the router goes)."""
    if isinstance(error, ControlUnreachable):
        return str(error)
    if isinstance(getattr(error, "reason", None), ConnectionRefusedError):
        return (
            f"this server's HTTP endpoint ({os.environ.get(CONTROL_URL_ENV)}) refuses connections: it is "
            "shutting down, or does not serve HTTP"
        )
    return f"{type(error).__name__}: {error}"


class ReviveAttempts:
    """What a reviver's retries share (the router's for its local models, a peer's gateway for the model it offers):
    the wait before the next attempt, REVIVE_BACKOFF_S doubling up to REVIVE_BACKOFF_MAX_S, and each cause of a
    failed reload logged once, in one line (`reload_failure`), until another cause replaces it."""

    def __init__(self, logger: logging.Logger, who: str) -> None:
        self.logger, self.who = logger, who
        self.delay = REVIVE_BACKOFF_S
        self.failure: str | None = None  # the last cause logged

    def failed(self, error: Exception) -> None:
        if (why := reload_failure(error)) != self.failure:
            if isinstance(error, UnloadedOnPurpose):  # nothing failed: the reviver waits until it is loaded
                self.logger.info("%s: %s", self.who, error)
            else:
                self.logger.warning("%s: reload failed (%s); retrying", self.who, why)
            self.failure = why

    def wait(self) -> float:
        """Seconds to wait before the next attempt (each wait doubles the next, up to the cap)."""
        delay, self.delay = self.delay, min(2 * self.delay, REVIVE_BACKOFF_MAX_S)
        return delay


class UnloadedOnPurpose(RuntimeError):
    """Triton unloads, or has unloaded, the model on request (a stopping server unloads every model): reloading
    it would undo that. It serves again once loaded."""


def check_not_unloaded(model: str) -> None:
    """Raise UnloadedOnPurpose when Triton says `model` is unloading, loading or was unloaded on request (an
    admin, or a stopping server): not the reviver's to undo or to repeat. A model whose process died is still
    READY to Triton 2.51, so that is the one a reviver reloads. When the state cannot be read,
    a reload through the same API cannot work either (a stopping server answered one all the same): that
    raises too. Without a control URL (pb_utils reloads) there is nothing to check."""
    url = os.environ.get(CONTROL_URL_ENV)
    if url is None:
        return
    try:
        state = model_states(url, os.environ.get(ADMIN_KEY_ENV), timeout=5).get(model)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"cannot read this server's model states: {reload_failure(e)}") from None
    if state is not None and (state[0] in ("UNLOADING", "LOADING") or state == ("UNAVAILABLE", "unloaded")):
        raise UnloadedOnPurpose(f"Triton unloaded {model!r} on request (a server that stops does so too): "
                                "it is not reloaded, and serves again once loaded")
