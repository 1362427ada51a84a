"""Stub processes end with their tritonserver.

A Python-backend stub is a child of tritonserver. When tritonserver dies without unloading its models (a
crash, SIGKILL, the OOM killer), Triton 2.51's stub notices from a health thread, but its teardown can
deadlock: a subserver stub was seen with every thread waiting on a futex, the GIL held by a thread blocked
on the dead server's shared memory. Such orphans keep their memory, GPU memory and sockets forever. A
watchdog *thread* cannot help (it needs the GIL too), so each stub starts a tiny watchdog *process*
(`/bin/sh`, builtins and `sleep`) that SIGKILLs the stub once tritonserver is gone (a zombie, or no longer
the stub's parent), and exits when the stub ends on its own.
"""

from __future__ import annotations

import os
import subprocess

# $1: the stub's pid, $2: tritonserver's pid. /proc/PID/stat reads "pid (comm) STATE PPID ...".
_WATCHDOG = r"""
stub=$1 server=$2
while :; do
  read -r stat < /proc/$stub/stat 2>/dev/null || exit 0
  set -- ${stat##*) }
  case $1 in Z|X) exit 0 ;; esac
  parent=$2 state=X
  if read -r sstat < /proc/$server/stat 2>/dev/null; then set -- ${sstat##*) }; state=$1; fi
  if [ "$parent" != "$server" ] || [ "$state" = Z ] || [ "$state" = X ]; then
    kill -9 "$stub"
    exit 0
  fi
  sleep 1
done
"""


def watch_parent() -> subprocess.Popen | None:
    """Start the watchdog for this process and its current parent (None where there is no /proc)."""
    if not os.path.isdir("/proc/self"):
        return None
    return subprocess.Popen(
        ["/bin/sh", "-c", _WATCHDOG, "tokenrouter-lifeline", str(os.getpid()), str(os.getppid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
    )
