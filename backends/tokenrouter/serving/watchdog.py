"""Liveness of a served deployment's model processes (`EngineConfig.watchdog_timeout_s`).

Until a model's socket closes, the router takes it for alive: a process that stops making progress without
exiting held its requests for ever. Two ways that happens, each watched where it can be seen:

- The decoding loop is stuck inside a step or a message (a GPU that never finishes a kernel, a deadlock) while
  the process's other threads still run. The process watches its own loop (`LoopWatchdog`, on its response
  thread) and exits, with the loop's stack in its log. SGLang's `watchdog_timeout` does the same for its
  scheduler.
- The whole process stands still (stopped by a signal, or a thread holding Python's lock inside C code): it can
  watch nothing. Every subserver sends a heartbeat on a connection that has carried nothing for HEARTBEAT_S, and
  the router kills a model of its own machine that sent nothing for the timeout (`kill_silent`).

Either way the socket closes and the router's usual path follows: the requests the model held fail with an error
that names it, and the model is reloaded (`RouterModel._revive`). On a peer server the gateway
(serving/peer_model.py) does the router's part for the subserver it offers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from tokenrouter.transport import ipc

log = logging.getLogger(__name__)

# A subserver's connection that carried nothing for this long gets a heartbeat (config.WATCHDOG_MIN_S is two).
HEARTBEAT_S = 1.0
# The status a subserver exits with when its loop is stuck (os._exit: a clean shutdown would wait on that loop).
STUCK_EXIT_STATUS = 70


class LoopWatchdog:
    """A subserver's check of its own decoding loop. `beat()` is when the loop last went round (None before it
    runs); `check` is called often (every 0.1 s) from another thread of the process."""

    def __init__(self, model: str, beat: Callable[[], float | None], loop_thread: threading.Thread,
                 timeout_s: float, exit: Callable[[int], Any] = os._exit) -> None:
        self.model, self.beat, self.loop_thread, self.timeout_s = model, beat, loop_thread, timeout_s
        self._exit = exit

    def check(self, now: float) -> bool:
        """True (after exiting the process, unless `exit` returned) if the loop has not gone round for the
        timeout."""
        beat = self.beat()
        if beat is None or now - beat < self.timeout_s:
            return False
        frame = sys._current_frames().get(self.loop_thread.ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop thread has ended)\n"
        log.critical("%s: the decoding loop has not gone round for %.1f s (watchdog_timeout_s %g): exiting, so that "
                     "the router fails the requests held here and restarts this model. The loop is at:\n%s",
                     self.model, now - beat, self.timeout_s, where.rstrip())
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(STUCK_EXIT_STATUS)
        return True


def kill_silent(links: Mapping[str, Any], timeout_s: float, now: float,
                kill: Callable[[int, int], None] = os.kill) -> list[str]:
    """The router's check: kill each model of this machine whose process has sent nothing (events or heartbeats)
    for `timeout_s`; returns their names. Its socket then closes, which fails what it held and revives it."""
    killed = []
    for model, link in links.items():
        if not isinstance(link, ipc.ModelLink):  # a model on a peer server: not ours to kill
            continue
        silent, pid = link.silent_for(now), link.pid
        if silent is None or silent < timeout_s or pid is None:
            continue
        link.last_heard = now  # once per timeout: its socket closes as it dies, and a revival starts it afresh
        if pid == os.getpid():  # a listener in the router's own process (tests): nothing to kill
            continue
        log.error("model %r (process %d) sent nothing, not even its heartbeat, for %.1f s (watchdog_timeout_s %g): "
                  "it is stopped or hung; killing it, so that its requests fail and it restarts",
                  model, pid, silent, timeout_s)
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited meanwhile: its socket's close does the rest
            continue
        killed.append(model)
    return killed
