"""serve's CUDA MPS handling (serving/mps.py) against stand-in daemon processes: a daemon that has quit but was
never reaped (its parent is init, which on the GPU machine does not reap) is not running, and `stop` reports a
quit daemon as gone. Before, the zombie counted as a running daemon: every serve's stop warned that the daemon
"did not quit within 30 s", and the device scripts waited 40 s for it to vanish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenrouter.serving import mps

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _fake_daemon(tmp_path: Path) -> subprocess.Popen:
    """A child of this test that names itself as the MPS daemon (its comm, as `ps` and /proc show it), then sleeps."""
    code = ("import time\nopen('/proc/self/comm', 'w').write('nvidia-cuda-mps-control')\n"
            "open(__import__('sys').argv[1], 'w').close()\ntime.sleep(300)\n")
    ready = tmp_path / f"named-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)])
    for _ in range(500):
        if ready.exists():
            return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("the stand-in daemon did not name itself within 5 s")


def _zombie(proc: subprocess.Popen) -> None:
    """Kill `proc` and wait until it is a zombie: exited, not reaped (no wait() on it yet)."""
    proc.send_signal(signal.SIGKILL)
    for _ in range(200):
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not become a zombie (state {state})")


@pytest.fixture
def pipe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "pipe"
    d.mkdir()
    (d / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(d))
    return d


def test_a_zombie_daemon_is_not_running(tmp_path: Path, pipe_dir: Path) -> None:
    daemon = _fake_daemon(tmp_path)
    try:
        assert daemon.pid in mps._live_daemon_processes()
        assert daemon.pid in mps._live_daemon_processes(os.getuid())
        assert daemon.pid not in mps._live_daemon_processes(os.getuid() + 1)  # stop() waits for its user's only
        assert mps.running()
        _zombie(daemon)
        assert daemon.pid not in mps._live_daemon_processes()
        assert not mps.running()
    finally:
        daemon.kill()
        daemon.wait()


def test_no_control_pipe_is_not_running(tmp_path: Path, pipe_dir: Path) -> None:
    daemon = _fake_daemon(tmp_path)
    try:
        (pipe_dir / "control").unlink()
        assert not mps.running()
    finally:
        daemon.kill()
        daemon.wait()


def test_stop_reports_a_daemon_that_quit_as_gone(tmp_path: Path, pipe_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The control client (a stand-in that kills the stand-in daemon on `quit`, as the real one asks the daemon to
    exit) returns; the daemon stays a zombie, as under an init that does not reap: stop() is True at once."""
    daemon = _fake_daemon(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.DAEMON
    control.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                       f"if sys.stdin.read().strip() == 'quit':\n    os.kill({daemon.pid}, signal.SIGKILL)\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    try:
        assert mps.daemon_path() == str(control)
        t0 = time.monotonic()
        assert mps.stop(timeout=10.0)
        assert time.monotonic() - t0 < 5.0
        assert Path(f"/proc/{daemon.pid}").exists()  # a zombie, not reaped: still listed in /proc
        assert not mps.running()
    finally:
        daemon.kill()
        daemon.wait()


def test_stop_reports_a_daemon_that_stays(tmp_path: Path, pipe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon still alive after the control client returned is reported once `timeout` has passed."""
    daemon = _fake_daemon(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.DAEMON
    control.write_text(f"#!{sys.executable}\nimport sys\nsys.stdin.read()\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    try:
        t0 = time.monotonic()
        assert not mps.stop(timeout=2.0)
        assert time.monotonic() - t0 >= 2.0
        assert mps.running()
    finally:
        daemon.kill()
        daemon.wait()
