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

from tokenrouter.serving.watchdog import STUCK_EXIT_STATUS, LoopWatchdog, SilenceWatch
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
        # The checker stood still 10 s too (its process stopped, or stalled in a call to tritonserver): the loop is
        # not blamed for that time; its count starts where the checks resume (every 0.25 s from there).
        now += 10.0
        for k in range(20):
            assert not dog.check(now + 0.25 * k) and exits == []
        with caplog.at_level(logging.CRITICAL, logger="tokenrouter.serving.watchdog"):
            assert dog.check(now + 5.0)
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


def _checks(watch: SilenceWatch, links: dict, start: float, end: float) -> list[str]:
    """`watch` checking every 0.25 s from `start` to `end` (times on the monotonic clock); the models killed."""
    killed: list[str] = []
    for k in range(int((end - start) / 0.25) + 1):
        killed += watch.check(links, start + 0.25 * k)
    return killed


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
        told: list[str] = []
        watch = SilenceWatch(30.0, server_alive=lambda: True, kill=lambda pid, sig: kills.append((pid, sig)),
                             on_kill=told.append)
        now = link.last_heard
        assert _checks(watch, links, now, now + 29.75) == [] and kills == []
        # Silent for the timeout: killed once tritonserver has answered for a second (CONFIRM_S).
        assert _checks(watch, links, now + 30.0, now + 30.75) == []
        assert _checks(watch, links, now + 31.0, now + 31.0) == ["large"]
        assert kills == [(child.pid, signal.SIGKILL)] and told == ["large"]
        # Once per timeout: the next checks do not kill it again while its socket closes.
        assert _checks(watch, links, now + 31.25, now + 60.75) == []
        # tritonserver not answering: nothing is killed (a stalled server stalls its models) and the count starts
        # again; when it answers again, a model that sends its heartbeat within a second is not killed either.
        alive = [False]
        stalled = SilenceWatch(30.0, server_alive=lambda: alive[0], kill=lambda pid, sig: kills.append((pid, sig)))
        assert _checks(stalled, links, now + 40.0, now + 90.75) == []
        alive[0] = True
        assert _checks(stalled, links, now + 91.0, now + 91.0) == []
        link.last_heard = now + 91.25  # its heartbeat, once the server is back
        assert _checks(stalled, links, now + 91.25, now + 100.0) == [] and len(kills) == 1
        # For real: the process dies and its socket's close reaches the router's side (which revives a model).
        real = SilenceWatch(30.0, server_alive=lambda: True)
        assert _checks(real, links, now + 122.0, now + 123.0) == ["large"]
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert lost.wait(10) and not link.connected
        assert _checks(real, links, now + 123.25, now + 250.0) == []  # nothing connected: nothing to kill
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
        watch = SilenceWatch(2.0, server_alive=lambda: True, kill=lambda pid, sig: kills.append(pid))
        assert _checks(watch, {"small": link}, link.last_heard, link.last_heard + 10) == [] and kills == []
    finally:
        link.close()
        listener.close()
