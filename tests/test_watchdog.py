"""The watchdog of a served deployment's model processes (serving/watchdog.py): a subserver whose decoding loop
is stuck exits with the loop's stack in its log; the router kills a model process that sent nothing for the
timeout, found by its socket's credentials, and only such a one. (Served end to end: test_faults.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

from tokenrouter.serving.watchdog import STUCK_EXIT_STATUS, LoopWatchdog, kill_silent
from tokenrouter.transport import codec, ipc
from tokenrouter.transport.messages import Heartbeat


def _stuck_in_a_step(release: threading.Event) -> None:
    release.wait()


def test_a_stuck_loop_exits_with_its_stack(caplog) -> None:
    release = threading.Event()
    loop = threading.Thread(target=_stuck_in_a_step, args=(release,), daemon=True)
    loop.start()
    exits: list[int] = []
    beat: list[float | None] = [None]
    dog = LoopWatchdog("large", lambda: beat[0], loop, timeout_s=5.0, exit=exits.append)
    try:
        now = time.monotonic()
        assert not dog.check(now)  # the loop has not started
        beat[0] = now - 4.9
        assert not dog.check(now) and exits == []
        beat[0] = now - 5.0
        with caplog.at_level(logging.CRITICAL, logger="tokenrouter.serving.watchdog"):
            assert dog.check(now)
        assert exits == [STUCK_EXIT_STATUS]
        (record,) = caplog.records
        assert "large: the decoding loop has not gone round for 5.0 s" in record.message
        assert "in _stuck_in_a_step" in record.message  # where it is stuck
    finally:
        release.set()


def test_heartbeats_cross_the_socket() -> None:
    assert codec.decode(codec.encode([Heartbeat("small")])) == [Heartbeat("small")]


_LISTENER = textwrap.dedent("""
    import sys, time
    from tokenrouter.transport import ipc
    ipc.ModelListener("large", lambda peer, msgs: None, lambda peer: None, addr="\\0" + sys.argv[1])
    print("listening", flush=True)
    time.sleep(600)
""")


def test_the_router_kills_a_silent_model_process_and_only_that() -> None:
    addr = f"\0tokenrouter-test/{os.getpid()}/{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", _LISTENER, addr[1:]], stdout=subprocess.PIPE, text=True)
    lost = threading.Event()
    link = ipc.ModelLink("large", lambda events: None, lost.set, addr=addr)
    unconnected = ipc.ModelLink("small", lambda events: None, lambda: None, addr=addr + "-none")
    links = {"small": unconnected, "large": link}
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "listening"
        link.connect(timeout=10)
        assert link.pid == child.pid  # the socket's credentials name the model's process
        kills: list[tuple[int, int]] = []
        now = time.monotonic()
        assert kill_silent(links, 30.0, now + 29.0, kill=lambda pid, sig: kills.append((pid, sig))) == []
        assert kill_silent(links, 30.0, now + 31.0, kill=lambda pid, sig: kills.append((pid, sig))) == ["large"]
        assert kills == [(child.pid, signal.SIGKILL)]
        # Once per timeout: the next check does not kill it again while its socket closes.
        assert kill_silent(links, 30.0, now + 32.0, kill=lambda pid, sig: kills.append((pid, sig))) == []
        # For real: the process dies and its socket's close reaches the router's side (which revives a model).
        assert kill_silent(links, 30.0, now + 61.0) == ["large"]  # a timeout after the last try
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert lost.wait(10) and not link.connected
        assert kill_silent(links, 30.0, now + 200.0) == []  # nothing connected: nothing to kill
    finally:
        link.close()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_router_never_kills_its_own_process() -> None:
    """A listener in the router's own process (as in tests) is never killed, however silent."""
    addr = f"\0tokenrouter-test/{os.getpid()}/{uuid.uuid4().hex}"
    listener = ipc.ModelListener("small", lambda peer, msgs: None, lambda peer: None, addr=addr)
    link = ipc.ModelLink("small", lambda events: None, lambda: None, addr=addr)
    try:
        link.connect(timeout=5)
        assert link.pid == os.getpid()
        kills: list[int] = []
        assert kill_silent({"small": link}, 2.0, time.monotonic() + 10, kill=lambda pid, sig: kills.append(pid)) == []
        assert kills == []
    finally:
        link.close()
        listener.close()
