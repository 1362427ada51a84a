"""Reloading a dead model through this server's model-control API (gRPC, or HTTP where no gRPC address is given):
what a failed attempt says. The reviver retries every few seconds for as long as the model is down, so one cause
must read the same on every attempt (it is logged once), and a refused connection must say what it most likely
means."""

from __future__ import annotations

import logging
import socket

import pytest

from tokenrouter.serving.model_control import (
    REVIVE_BACKOFF_MAX_S,
    REVIVE_BACKOFF_S,
    ControlUnreachable,
    ReviveAttempts,
    UnloadedOnPurpose,
    reload_failure,
    reload_model,
)
from tokenrouter.serving.server import CONTROL_GRPC_ENV, CONTROL_URL_ENV


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_causes(error: type[Exception]) -> list[str]:
    """Two reload attempts that fail with `error`: what the reviver would log for each."""
    causes = []
    for _ in range(2):
        with pytest.raises(error) as e:
            reload_model("large", pb_utils=None)
        causes.append(reload_failure(e.value))
    return causes


def test_a_refused_reload_says_the_server_is_not_serving_http(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv(CONTROL_URL_ENV, url)
    causes = _two_causes(OSError)
    assert causes[0] == causes[1]
    assert url in causes[0] and "shutting down" in causes[0]


def test_a_refused_grpc_reload_says_the_server_is_not_serving_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviver reloads over gRPC where it is told the address (TritonServer.start tells it), HTTP or not."""
    address = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv(CONTROL_GRPC_ENV, address)
    monkeypatch.setenv(CONTROL_URL_ENV, f"http://127.0.0.1:{_closed_port()}")
    causes = _two_causes(ControlUnreachable)
    assert causes[0] == causes[1]
    assert address in causes[0] and "shutting down" in causes[0]


def test_other_failures_keep_their_type_and_message() -> None:
    error = RuntimeError("load of 'large' refused: boom")
    assert reload_failure(error) == "RuntimeError: load of 'large' refused: boom"


def test_revive_attempts_back_off_and_log_each_cause_once(caplog: pytest.LogCaptureFixture) -> None:
    """The revivers' retries (router and peer gateway): waits doubling from REVIVE_BACKOFF_S up to
    REVIVE_BACKOFF_MAX_S, and a failed reload logged once per cause, again when the cause changes."""
    logger = logging.getLogger("test-revive")
    attempts = ReviveAttempts(logger, "model 'large'")
    waits = [attempts.wait() for _ in range(8)]
    assert waits[0] == REVIVE_BACKOFF_S and max(waits) == REVIVE_BACKOFF_MAX_S
    assert all(b == min(2 * a, REVIVE_BACKOFF_MAX_S) for a, b in zip(waits, waits[1:]))
    unloaded = UnloadedOnPurpose("Triton unloaded 'large' on request: it is not reloaded, and serves again once loaded")
    with caplog.at_level(logging.INFO, logger="test-revive"):
        for e in (RuntimeError("refused"), RuntimeError("refused"), OSError("gone"), RuntimeError("refused"),
                  unloaded, unloaded):
            attempts.failed(e)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "test-revive"] == [
        ("WARNING", "model 'large': reload failed (RuntimeError: refused); retrying"),
        ("WARNING", "model 'large': reload failed (OSError: gone); retrying"),
        ("WARNING", "model 'large': reload failed (RuntimeError: refused); retrying"),
        # A model unloaded on request (an admin's, or a stopping server's): no failure, no retry; said once.
        ("INFO", "model 'large': Triton unloaded 'large' on request: it is not reloaded, and serves again once loaded"),
    ]
