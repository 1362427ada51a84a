"""The GIL's switch interval in a deployment's processes.

Every process of a deployment runs one busy thread (a subserver's decoding loop, the router's event loop) beside
threads that move messages (socket readers, a subserver's response thread). A thread that wakes with a message
takes the GIL only when the busy thread blocks, or when it has waited the switch interval: CPython's default, 5 ms,
is longer than a small model's whole step, so a handoff could wait that long between two processes. A shorter
interval bounds that wait; the busy thread pays a switch every interval, a few microseconds.
"""

from __future__ import annotations

import os
import sys

SWITCH_INTERVAL_ENV = "TOKENROUTER_GIL_SWITCH_MS"
DEFAULT_SWITCH_INTERVAL_MS = 0.5


def set_switch_interval() -> float:
    """Set this process's switch interval (TOKENROUTER_GIL_SWITCH_MS, default 0.5 ms); returns it in seconds.
    ValueError names the variable when its value is not a positive number of milliseconds."""
    raw = os.environ.get(SWITCH_INTERVAL_ENV, "")
    try:
        ms = float(raw) if raw.strip() else DEFAULT_SWITCH_INTERVAL_MS
    except ValueError:
        ms = -1.0
    if not 0 < ms < float("inf"):  # (NaN too)
        raise ValueError(f"{SWITCH_INTERVAL_ENV}={raw!r}: give the GIL switch interval in milliseconds, > 0")
    sys.setswitchinterval(ms / 1000.0)
    return sys.getswitchinterval()
