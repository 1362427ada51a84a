"""The Triton deployment's transport between the router and the subservers: one local socket per model.

Every model of a deployment is its own Triton Python-backend stub process. Messages to a model and its
events back travel over a Unix socket in the abstract namespace (no file to clean up), framed by
`multiprocessing.connection` (bytes only: nothing is unpickled), as the JSON of `transport.codec`.

Why not BLS: the Python backend of Triton 2.51 (python_backend r24.10) destroys a decoupled BLS response
iterator on its cleanup thread without holding the GIL once the Python side has dropped it, and the numpy
arrays behind its responses' tensors are then freed without the GIL (fixed upstream in python_backend
PR #390, r24.12). Under load that corrupts the router's heap: the stub segfaults in numpy or libpython
after a few hundred requests. Its pybind11 also predates numpy 2, so object (TYPE_STRING) tensors built
in a stub with numpy 2 come out corrupt. A socket carries none of that, costs one write per message
batch, and lets either side see at once when the other process is gone.

The address names the tritonserver process (every stub is its child) and the model, so two servers on
one machine never meet. A subserver accepts connections only from processes of its own user.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Any

from tokenrouter.transport import codec

log = logging.getLogger(__name__)

# How long a model that could not be reached is treated as down before the next connect attempt.
RETRY_AFTER_S = 1.0
# `Peer.try_send` writes only this much, onto at most this much unread: far below a Unix socket's send buffer
# (net.core.wmem_default, ~208 KiB counted with per-message overhead; a quarter of it where it is smaller), so the
# write cannot wait for the reader.
NONBLOCKING_SEND_BYTES = 32 << 10


def address(model: str, server_pid: int | None = None) -> str:
    """The abstract-namespace socket of `model` in the tritonserver whose pid is `server_pid` (default: this
    process's parent, which for a Python-backend stub is tritonserver)."""
    pid = os.getppid() if server_pid is None else server_pid
    return f"\0tokenrouter/{pid}/{model}"


def _nonblocking_room(conn: Connection) -> int:
    """What `Peer.try_send` allows on this socket: NONBLOCKING_SEND_BYTES, less where the send buffer is small."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        return min(NONBLOCKING_SEND_BYTES, s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4)


def _unread_bytes(conn: Connection) -> int:
    """Bytes written to a Unix socket that its other side has not read yet (SIOCOUTQ, as TIOCOUTQ)."""
    out = fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return struct.unpack("i", out)[0]


def _peer_cred(conn: Connection) -> tuple[int, int]:
    """(pid, uid) of the process at the connection's other end (for a connecting side: the process that listens)."""
    fmt = "3i"  # struct ucred: pid, uid, gid
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        pid, uid, _ = struct.unpack(fmt, s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))
    return pid, uid


class Peer:
    """One open connection: sends are serialized by a lock (several threads may send)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn, self.name = conn, name
        self._lock = threading.Lock()
        self.closed = False
        self.discarded = False  # closed by this side as one connection too many (ModelLink.connect): no loss
        self.last_sent = time.monotonic()  # when a batch last left through this connection
        self._room: int | None = None  # try_send's bound for this socket, read on first use

    def send(self, items: list[Any]) -> None:
        data = codec.encode(items).encode()
        with self._lock:
            self.conn.send_bytes(data)
            self.last_sent = time.monotonic()

    def try_send(self, items: list[Any]) -> bool:
        """Send `items` only if that cannot block: no other thread is sending here and the socket's buffer has room
        for them with the bytes the other side has not read yet. Returns whether they were sent (False: nothing
        was). For a thread that must never wait on the other process (a subserver's decoding loop)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._room is None:
                self._room = _nonblocking_room(self.conn)
            if _unread_bytes(self.conn) > self._room:
                return False
            data = codec.encode(items).encode()
            if len(data) > self._room:
                return False
            self.conn.send_bytes(data)
            self.last_sent = time.monotonic()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """Shut the socket down: that wakes this side's reader thread (blocked in recv on it, or about to be) with
        the end of the stream and tells the other side. The reader thread closes the descriptor as it ends
        (`_read_forever`): closed here, its number could be reused by the next socket opened while the reader was
        on its way into recv, which would then read that socket's bytes (a reconnect's greeting went missing
        that way in a test under load)."""
        self.closed = True
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _read_forever(peer: Peer, on_items: Callable[[Peer, list[Any]], None], on_close: Callable[[Peer], None]) -> None:
    try:
        while True:
            data = peer.conn.recv_bytes()
            try:
                items = codec.decode(data)
            except (ValueError, TypeError, KeyError) as e:
                log.error("%s: dropping a malformed message batch: %s", peer.name, e)
                continue
            on_items(peer, items)
    except (EOFError, OSError):
        pass
    except Exception:  # closing the connection under a blocked read ends it in other ways too
        if not peer.closed:
            log.exception("%s: connection reader failed", peer.name)
    finally:
        peer.closed = True
        try:
            peer.conn.close()  # (here, not in Peer.close: see there)
        except OSError:
            pass
        on_close(peer)


class ModelListener:
    """The subserver's side: accepts the router's connections; `on_messages(peer, msgs)` runs on the
    connection's reader thread, `on_close(peer)` once when that router goes away, and `on_open(peer)` on the
    accepting thread as a connection opens, before anything is read from it."""

    def __init__(
        self,
        model: str,
        on_messages: Callable[[Peer, list[Any]], None],
        on_close: Callable[[Peer], None],
        addr: str | None = None,
        on_open: Callable[[Peer], None] | None = None,
    ) -> None:
        self.address = addr or address(model)
        self.model = model
        # A plain listening socket rather than multiprocessing's Listener: close() must be able to shut it
        # down, which is what wakes the accept thread (closing an fd another thread is blocked on does not).
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._on_messages, self._on_close, self._on_open = on_messages, on_close, on_open
        self._stopped = False
        self._peers_lock = threading.Lock()
        self._peers: set[Peer] = set()  # the routers' connections now open
        self._thread = threading.Thread(target=self._accept_forever, name=f"tr-{model}-accept", daemon=True)
        self._thread.start()

    def _accept_forever(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
                conn = Connection(sock.detach())
                _, uid = _peer_cred(conn)
            except OSError:
                if self._stopped:
                    return
                log.exception("%s: accept failed", self.model)
                continue
            if uid != os.getuid():
                log.warning("%s: refused a connection from another user", self.model)
                conn.close()
                continue
            peer = Peer(conn, f"{self.model}<-router")
            with self._peers_lock:
                self._peers.add(peer)
            if self._on_open is not None:
                try:
                    self._on_open(peer)
                except OSError:
                    peer.close()  # (its reader thread, started below, then reports it closed)
            threading.Thread(
                target=_read_forever, args=(peer, self._on_messages, self._closed),
                name=f"tr-{self.model}-reader", daemon=True,
            ).start()

    def _closed(self, peer: Peer) -> None:
        with self._peers_lock:
            self._peers.discard(peer)
        self._on_close(peer)

    def peers(self) -> list[Peer]:
        """The routers' connections now open."""
        with self._peers_lock:
            return [p for p in self._peers if not p.closed]

    def close(self) -> None:
        self._stopped = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class ModelLink:
    """The router's side of one model: connects on first use, reads events on its own thread.

    `on_events(events)` runs on the reader thread; `on_lost()` once per outage (a connection that breaks, or a
    connect refused: the model's process exited). A model that was reached once and then lost is not waited for
    again: sends fail at once until `connect` (called off the router's loop, by whoever revives the model)
    succeeds."""

    def __init__(
        self,
        model: str,
        on_events: Callable[[list[Any]], None],
        on_lost: Callable[[], None],
        addr: str | None = None,
        connect_timeout: float = 2.0,
    ) -> None:
        self.model = model
        self.address = addr or address(model)
        self._on_events, self._on_lost = on_events, on_lost
        self.connect_timeout = connect_timeout
        self._peer: Peer | None = None
        self._lock = threading.Lock()
        self._ever_connected = False
        # After a failed connect, sends fail at once for a while: the caller is the router's loop thread,
        # which must not wait connect_timeout per message for a model that is gone.
        self._down_until = 0.0
        self._down_error = ""
        # `on_lost` called for the current outage (its connection closing, or a connect refused): once per outage.
        self._lost_told = False
        # The model's process (from the socket's credentials) and when anything last came from it, for the
        # router's watchdog; both of the current connection.
        self.pid: int | None = None
        self.last_heard = 0.0

    @property
    def connected(self) -> bool:
        peer = self._peer
        return peer is not None and not peer.closed

    def _open(self, timeout: float) -> Peer:
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX")
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"model {self.model!r} is not reachable (is it loaded?): {e}") from None
                time.sleep(0.05)
        pid, _ = _peer_cred(conn)
        peer = Peer(conn, f"router->{self.model}")
        self.pid, self.last_heard = pid, time.monotonic()
        threading.Thread(
            target=_read_forever, args=(peer, self._received, self._closed),
            name=f"tr-link-{self.model}", daemon=True,
        ).start()
        return peer

    def _received(self, _peer: Peer, events: list[Any]) -> None:
        self.last_heard = time.monotonic()
        self._on_events(events)

    def _closed(self, peer: Peer) -> None:
        if peer.discarded:
            return  # a second connection that lost a race to connect: the model is fine
        with self._lock:
            if self._peer is peer:
                self._peer = None
                self._down_until = float("inf")  # until connect() succeeds again
                self._down_error = f"model {self.model!r} is unavailable: its process exited"
            if self._peer is None:
                # A send that found this connection closed and was refused a new one may have told already: one
                # outage, one `on_lost` (each starts a revive, and two would reload the model twice at once).
                tell, self._lost_told = not self._lost_told, True
            else:  # an older connection's close, a newer one open: told as always, the newer one's outage untouched
                tell = True
        if tell:
            self._on_lost()

    def connect(self, timeout: float | None = None) -> None:
        """Connect now (blocking up to `timeout`, default connect_timeout); ConnectionError if not reachable."""
        with self._lock:
            if self.connected:
                return
        peer = self._open(self.connect_timeout if timeout is None else timeout)
        with self._lock:
            if self.connected:  # another thread won the race
                peer.discarded = True
                peer.close()
                return
            self._peer, self._ever_connected, self._down_until, self._lost_told = peer, True, 0.0, False

    def send(self, messages: list[Any]) -> None:
        """Send a batch of messages; ConnectionError when the model cannot be reached. A model this link cannot
        connect to is reported lost (`on_lost`, once): its process may have died while nothing was connected (a
        router revived after it, or not yet sent anything there), and nothing else would have it revived."""
        refused: ConnectionError | None = None
        with self._lock:
            if self._peer is None or self._peer.closed:
                if time.monotonic() < self._down_until:
                    raise ConnectionError(self._down_error)
                try:
                    # Only the first connection waits for the model to come up (the server is starting).
                    self._peer = self._open(0.0 if self._ever_connected else self.connect_timeout)
                    self._ever_connected, self._lost_told = True, False
                except ConnectionError as e:
                    self._down_until, self._down_error = time.monotonic() + RETRY_AFTER_S, str(e)
                    refused, tell, self._lost_told = e, not self._lost_told, True
            peer = self._peer
        if refused is not None:
            if tell:
                self._on_lost()
            raise refused
        try:
            peer.send(messages)
        except OSError as e:
            peer.close()
            raise ConnectionError(f"model {self.model!r} went away: {e}") from None

    def try_send(self, messages: list[Any]) -> bool:
        """Send on the open connection only, and only if that cannot block (`Peer.try_send`): no connecting, no
        waiting. False: nothing was sent (not connected, closed meanwhile, or no room)."""
        peer = self._peer
        if peer is None or peer.closed:
            return False
        try:
            return peer.try_send(messages)
        except OSError:
            return False  # the connection broke: its reader thread sees it close (on_lost)

    def close(self) -> None:
        with self._lock:
            if self._peer is not None:
                self._peer.close()
                self._peer = None
