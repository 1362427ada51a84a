"""Liveness of a served deployment's model processes (`EngineConfig.watchdog_timeout_s`).

Until a model's socket closes, the router takes it for alive: a process that stops making progress without
exiting held its requests for ever. Two ways that happens, each watched where it can be seen:

- The decoding loop is stuck inside a step or a message (a GPU that never finishes a kernel, a deadlock) while
  the process's other threads still run. The process watches its own loop (`LoopWatchdog`, on a thread of its
  own that never waits on tritonserver) and exits, with the loop's stack in its log. SGLang's `watchdog_timeout`
  does the same for its scheduler.
- The whole process stands still (stopped by a signal, or a thread holding Python's lock inside C code): it can
  watch nothing. Every subserver sends a heartbeat on a connection that has carried nothing for HEARTBEAT_S, and
  the router kills a model of its own machine that sent nothing for the timeout (`SilenceWatch`).

Either way the socket closes and the router's usual path follows: the requests the model held fail with an error
that names it, and the model is reloaded (`RouterModel._revive`). On a peer server the gateway
(serving/peer_model.py) does the router's part for the subserver it offers.

Neither blames a model for a stall that is not its own (found by a fault-injection pass, 2026-12-05): a checker
that itself stood still (its whole process stopped, or held by a call into a stalled tritonserver, which the
Python backend makes holding the GIL) starts its count afresh; and the router kills nothing while tritonserver
itself does not answer (`server_answers`): a paused server stalls every model process with it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from tokenrouter.serving.server import CONTROL_URL_ENV
from tokenrouter.transport import ipc

log = logging.getLogger(__name__)

# A subserver's connection that carried nothing for this long gets a heartbeat (config.WATCHDOG_MIN_S is two).
HEARTBEAT_S = 1.0
# The status a subserver exits with when its loop is stuck (os._exit: a clean shutdown would wait on that loop).
STUCK_EXIT_STATUS = 70


# A checker that has not run for this long stood still itself: its count starts afresh (checks run every
# CHECK_EVERY_S at most).
CHECK_EVERY_S = 0.25
STOOD_STILL_S = 1.0
# How long tritonserver must have answered, at every check, before the router kills a model silent all along.
CONFIRM_S = 1.0


class _Count:
    """Time since an event, counted only while its checker ran: a gap between two checks (`tick`) longer than
    STOOD_STILL_S means the checker stood still with what it watches, and every count restarts there."""

    def __init__(self) -> None:
        self._last_tick: float | None = None
        self.start = float("-inf")

    def tick(self, now: float) -> None:
        if self._last_tick is not None and now - self._last_tick > STOOD_STILL_S:
            self.start = now
        self._last_tick = now

    def since(self, event: float, now: float) -> float:
        return now - max(event, self.start)


class LoopWatchdog:
    """A subserver's check of its own decoding loop. `beat()` is when the loop last went round (None before it
    runs); `check` is called every CHECK_EVERY_S from a thread of its own (one that never waits on tritonserver)."""

    def __init__(self, model: str, beat: Callable[[], float | None], loop_thread: threading.Thread,
                 timeout_s: float, exit: Callable[[int], Any] = os._exit) -> None:
        self.model, self.beat, self.loop_thread, self.timeout_s = model, beat, loop_thread, timeout_s
        self._exit = exit
        self._count = _Count()

    def check(self, now: float) -> bool:
        """True (after exiting the process, unless `exit` returned) if the loop has not gone round for the
        timeout."""
        self._count.tick(now)
        beat = self.beat()
        if beat is None or (stuck := self._count.since(beat, now)) < self.timeout_s:
            return False
        frame = sys._current_frames().get(self.loop_thread.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop thread has ended)\n"
        log.critical("%s: the decoding loop has not gone round for %.1f s (watchdog_timeout_s %g): exiting, so that "
                     "the router fails the requests held here and restarts this model. The loop is at:\n%s",
                     self.model, stuck, self.timeout_s, where.rstrip())
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(STUCK_EXIT_STATUS)
        return True


def server_answers(timeout: float = 1.0) -> bool:
    """Whether this process's tritonserver answers its liveness endpoint (True where nothing says where it is)."""
    url = os.environ.get(CONTROL_URL_ENV)
    if url is None:
        return True
    try:
        with urllib.request.urlopen(f"{url}/v2/health/live", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


class SilenceWatch:
    """The router's check of the model processes of its machine (or a peer gateway's of its one): `check` kills
    each whose process has sent nothing (events or heartbeats) for the timeout, and returns their names. Its
    socket then closes, which fails what it held and revives it. It may block for a second (`server_answers`):
    call it off an event loop."""

    def __init__(self, timeout_s: float, server_alive: Callable[[], bool] = server_answers,
                 kill: Callable[[int, int], None] = os.kill,
                 on_kill: Callable[[str], None] = lambda model: None) -> None:
        """`on_kill(model)` runs before a model is killed (the router then says why to the requests it held)."""
        self.timeout_s, self.server_alive, self.kill, self.on_kill = timeout_s, server_alive, kill, on_kill
        self._count = _Count()
        self._answering_since: float | None = None  # tritonserver answered at every check since (models silent)

    def check(self, links: Mapping[str, Any], now: float) -> list[str]:
        """Called every CHECK_EVERY_S."""
        self._count.tick(now)
        silent: list[tuple[str, ipc.ModelLink, float]] = []
        for model, link in links.items():
            if not isinstance(link, ipc.ModelLink):  # a model on a peer server: its gateway watches it
                continue
            if not link.connected or link.pid is None:
                continue
            quiet = self._count.since(link.last_heard, now)
            if quiet >= self.timeout_s:
                silent.append((model, link, quiet))
        if not silent:
            self._answering_since = None
            return []
        if not self.server_alive():  # tritonserver stalls, and every model process with it: not theirs to pay for
            log.warning("tritonserver does not answer: not judging models %s silent for now", [m for m, _, _ in silent])
            self._count.start, self._answering_since = now, None
            return []
        # Killed only once tritonserver has answered for CONFIRM_S: a model stalled with a server that just came
        # back sends its heartbeat within a check or two.
        if self._answering_since is None:
            self._answering_since = now
        if now - self._answering_since < CONFIRM_S:
            return []
        self._answering_since = None
        killed = []
        for model, link, quiet in silent:
            pid = link.pid
            link.last_heard = now  # once per timeout: its socket closes as it dies, and a revival starts it afresh
            if pid is None or pid == os.getpid():  # a listener in the router's own process (tests): nothing to kill
                continue
            log.error("model %r (process %d) sent nothing, not even its heartbeat, for %.1f s (watchdog_timeout_s "
                      "%g): it is stopped or hung; killing it, so that its requests fail and it restarts",
                      model, pid, quiet, self.timeout_s)
            self.on_kill(model)
            try:
                self.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile: its socket's close does the rest
                continue
            killed.append(model)
        return killed
