"""`tokenrouter serve`: write the model repository, start CUDA MPS if models share a GPU, start tritonserver.

Also the `TritonServer` process wrapper the end-to-end tests and benchmarks use. Triton's admin APIs
(`ADMIN_APIS`) answer only requests carrying the admin key; inference, health and metadata stay open.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from tokenrouter.config import ConfigError, EngineConfig, load_config
from tokenrouter.serving import mps, stub_env, triton_install
from tokenrouter.serving.repository import ROUTER, write_repository
from tokenrouter.transport.grpc_link import keepalive_flags

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO_ROOT / "config" / "r2r" / "pair-small_pair-large.yaml"

# The APIs tritonserver can restrict (`--http-restricted-api`, `--grpc-restricted-protocol`).
TRITON_APIS = (
    "health", "metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics", "trace",
    "logging",
)  # fmt: skip
# Restricted by default: model control (a load request can carry model files, i.e. code for the Python backend),
# shared memory (clients name regions the server then reads and writes), trace and logging (settings that make
# the server record requests or flood its disk). model-config and statistics stay open: they are read-only,
# the metrics port publishes the same counters with no header at all, and perf_analyzer reads both over gRPC,
# where it cannot send headers.
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_HEADER = "admin-key"
# Set in tritonserver's environment (its stubs inherit it): where the router reaches model control. Over HTTP it
# reads the models' states and the server's liveness; it loads and unloads over gRPC (model_control.reload_model).
CONTROL_URL_ENV = "TOKENROUTER_MODEL_CONTROL_URL"
CONTROL_GRPC_ENV = "TOKENROUTER_MODEL_CONTROL_GRPC"
# ... and the file whose time the router's loop renews every second (serving/watchdog.py), for `tokenrouter serve`
# to find a router that is stopped or hung.
ROUTER_BEAT_ENV = "TOKENROUTER_ROUTER_BEAT"
# When a server stops: how long the models get to unload, of that the router (a client's open gRPC stream keeps
# Triton from unloading the router until the stream closes), then tritonserver to exit once all are unloaded.
DRAIN_S = 20.0
DRAIN_ROUTER_S = 5.0
DRAINED_EXIT_S = 5.0
STUB = "triton_python_backend_stub"
# How often `tokenrouter serve` checks that the router model's process is alive (its only reviver), and sweeps the
# shared memory of revived models' dead stubs.
ROUTER_CHECK_S = 2.0
# A model-control answer slower than this: tritonserver itself stalls (a router's silence then is not its own).
SERVER_STALL_S = 1.0
# tritonserver that dies by itself is restarted by `tokenrouter serve`, this many times within this window at most
# (a crash loop then ends `serve`, with an error, for whatever supervises it).
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
PORTS_FREE_WAIT_S = 30.0  # before a restart, for the dead server's ports (a new one on a held port exits at once)
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # Triton prefixes the key of a gRPC restriction
ADMIN_KEY_ENV = "TOKENROUTER_ADMIN_KEY"
_KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: a valid HTTP header and gRPC metadata value


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the kernel SIGTERM the child when this process dies, however it dies (the
    child's own session keeps it out of our process group, so a kill of that group would miss it). Only
    from the main thread: the kernel sends it when the *thread* that started the child exits."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child may not import
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


def restriction_args(admin_key: str, apis: Sequence[str] = ADMIN_APIS) -> list[str]:
    """tritonserver flags that make `apis` answer only requests carrying `admin_key`: HTTP header `admin-key`,
    gRPC metadata `triton-grpc-protocol-admin-key`. ValueError for an unknown API or an unusable key."""
    if not apis:
        return []
    unknown = sorted(set(apis) - set(TRITON_APIS))
    if unknown:
        raise ValueError(f"unknown Triton API(s) {unknown}; known: {', '.join(TRITON_APIS)}")
    if not _KEY_CHARS.fullmatch(admin_key):
        raise ValueError("the admin key must be non-empty visible ASCII (no spaces): it travels as a header value")
    group = f"{','.join(apis)}:{ADMIN_HEADER}={admin_key}"
    return [f"--http-restricted-api={group}", f"--grpc-restricted-protocol={group}"]


def write_secret(path: Path, secret: str) -> None:
    """Write `secret` to `path`, readable by this user only: a new 0600 file renamed into place, so neither the
    mode of an older file nor a symlink planted at `path` decides who can read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on the loopback (bound together so they differ, released before use)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ensure_models(config_path: Path) -> None:
    """Build what a config points at and this repository generates, if it is missing: the tiny local
    models and the benchmark tokenizer of dummy-weight deployments (nothing is fetched)."""
    from tokenrouter.tools.bench_tokenizer import ensure_bench_tokenizer
    from tokenrouter.tools.make_tiny import make_tiny

    ensure_bench_tokenizer(config_path)
    cfg_text = config_path.read_text()
    tiny = REPO_ROOT / "models" / "tiny"
    if "models/tiny/" in cfg_text and not (tiny / "MANIFEST.json").exists():
        make_tiny(tiny)


def _gpu_available() -> bool:
    """Counted through NVML where torch can (it falls back to CUDA's count where NVML fails), so that serve itself
    normally never initializes CUDA. `torch.cuda.is_available()` does, and under a running MPS daemon that makes
    the process the daemon's client, whose `quit` then waits for it to exit (a probe on an H100, 2026-12-05)."""
    try:
        import torch

        return torch.cuda.device_count() > 0
    except ImportError:
        return False


class TritonServer:
    """A tritonserver process on a model repository; `with TritonServer(...) as s:` waits until ready.

    `restricted_apis` answer only requests carrying `admin_key` (a random one when not given: read it from
    `.admin_key`); `restricted_apis=()` leaves every API open.
    """

    def __init__(
        self,
        model_repository: Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log_file: Path | None = None,
        verbose: int = 0,
        *,
        admin_key: str | None = None,
        restricted_apis: Sequence[str] = ADMIN_APIS,
    ) -> None:
        self.repo = Path(model_repository)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = log_file
        self.verbose = verbose
        self.restricted_apis = tuple(restricted_apis)
        self.admin_key = (admin_key or secrets.token_urlsafe(32)) if self.restricted_apis else None
        self._restriction = restriction_args(self.admin_key, self.restricted_apis) if self.admin_key else []
        self.proc: subprocess.Popen | None = None
        self._regions: dict[str, str] = {}  # each model's stub's shared memory, as last seen alive
        self.router_beat = self.repo.parent / f"{self.repo.name}.router-beat"  # (beside serve's lock and key)
        # Where this process reaches the server (it listens on every interface).
        self.host = "127.0.0.1"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        backends = triton_install.prepare_backends()
        cmd = [
            str(triton_install.triton_root() / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.verbose}",
            "--exit-on-error=true",
            # A peer's or router's keepalive pings are welcome (two nodes find a silent partition by them).
            *keepalive_flags(),
            # Explicit model control (every model loaded at start): the router reloads a model whose process
            # died through Triton's load API; Triton 2.51's Python backend never restarts a dead stub itself.
            "--model-control-mode=explicit",
            "--load-model=*",
            # tritonserver takes the key only on its command line; it does not log it.
            *self._restriction,
        ]
        if not _gpu_available():
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false"]
        return cmd

    def start(self) -> None:
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 (kept open for the child)
        # Its own process group, so stop() can reach the model stubs even if the server dies first.
        env = triton_install.server_env()
        # The router reloads a model whose process died through this server's own model-control API, over gRPC
        # (pb_utils.load_model would hold the router's GIL for the whole reload and stall every request; over HTTP
        # the reload holds an HTTP worker thread, whose streams lose responses: model_control.reload_model).
        env[CONTROL_URL_ENV] = f"http://127.0.0.1:{self.http_port}"
        env[CONTROL_GRPC_ENV] = f"127.0.0.1:{self.grpc_port}"
        if self.admin_key:
            env[ADMIN_KEY_ENV] = self.admin_key
        self.router_beat.unlink(missing_ok=True)  # a former server's
        env[ROUTER_BEAT_ENV] = str(self.router_beat)
        self.proc = subprocess.Popen(
            self.command(), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True, preexec_fn=_die_with_parent_hook(),
        )

    def ready(self) -> bool:
        """Ready, and every endpoint listens: Triton starts its metrics service after it answers ready on
        HTTP (a scrape right after `wait_ready` was refused once in CI)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.http_port}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            with socket.create_connection((self.host, self.metrics_port), timeout=2):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the server answers ready (True), or `cancelled()` says to give up (False)."""
        where = f"; see {self.log_file}" if self.log_file else " (its log is above)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancelled():
                return False
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}{where}")
            if self.ready():
                return True
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{where}")

    def router_silent_for(self) -> float | None:
        """Seconds since the router's loop last renewed its beat file; None before its first beat."""
        try:
            return time.time() - self.router_beat.stat().st_mtime
        except OSError:
            return None

    def reload_router(self, timeout: float = 300.0) -> None:
        """Unload and load the router model through the gRPC model-control API (explicit model control; not HTTP:
        `reload_over_grpc` says why). Raises RuntimeError (ControlUnreachable, or the server's refusal)."""
        reload_over_grpc(ROUTER, self.grpc_url, self.admin_key, timeout)

    def sweep_replaced_regions(self, stubs: dict[str, tuple[int, str]]) -> list[str]:
        """Remove the shared memory of stubs that died and were replaced (a model revived: the router's by `serve`,
        a subserver's by the router): the server removes a stub's region only when the stub exits through it,
        so each revival left 1-4 MB in /dev/shm. A region goes once its model runs a stub with another one
        (`stubs`: `stubs_by_model()`); the names removed."""
        live = {model: region for model, (_, region) in stubs.items()}
        removed = []
        for model, old in self._regions.items():
            new = live.get(model)
            if new is not None and new != old and os.path.exists(f"/dev/shm/{old}"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{old}")
                    removed.append(old)
        self._regions.update(live)  # a model without a live stub keeps its last region until one replaces it
        return removed

    def stubs_by_model(self) -> dict[str, tuple[int, str]]:
        """Each model's live stub: (pid, shared-memory region) (one instance per model, as this repository has)."""
        if self.proc is None:
            return {}
        roots = {f"{root}/".encode() for root in (self.repo, self.repo.resolve())}  # (as given to tritonserver)
        out = {}
        for pid, argv in _stubs(self.proc.pid):
            root = next((r for r in roots if argv[1].startswith(r)), None)
            if root is not None and b"/" not in argv[2]:
                model = argv[1][len(root):].split(b"/")[0].decode(errors="replace")
                out[model] = (pid, argv[2].decode(errors="replace"))
        return out

    def stop(self) -> None:
        """Unload the models (`drain`), then stop tritonserver. Once they are unloaded nothing is lost by
        not waiting for its open HTTP connections: it is killed after DRAINED_EXIT_S."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            drained = self.drain()
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=DRAINED_EXIT_S if drained else 40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Stubs that outlived the server (it crashed, or one ignored the shutdown) must not linger, nor the
        # shared memory that only their server would have removed: theirs, and that of the stubs last seen alive
        # (`sweep_replaced_regions`), which may have exited meanwhile (a stub exits when its server dies).
        regions = {*_stub_regions(self.proc.pid), *self._regions.values()}
        self._regions = {}  # (a start after this one makes new regions)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for name in regions:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        self.router_beat.unlink(missing_ok=True)

    def drain(self, timeout: float = DRAIN_S) -> bool:
        """Unload the models through the model-control API, then the router; True once all are unloaded.

        Signalled, Triton 2.51 first waits, up to its exit timeout (30 s), for every open HTTP connection to
        close (an idle keep-alive client is enough) and then has no time left to unload anything: it exits at
        once, its model processes killed, their shared memory left in /dev/shm, at times with a segfault.
        Unloaded here, the models end cleanly whatever the clients do: the router fails the requests they
        held, with an error that says the server may be shutting down, and refuses new ones. The router goes
        last; a client's open gRPC stream keeps it loaded until the stream closes (then this says False, and
        the server is stopped as before)."""
        url = f"http://{self.host}:{self.http_port}"
        end = time.monotonic() + timeout

        def within(deadline: float) -> float:
            """An HTTP call's timeout: at most 5 s, and never past `deadline` (a stalled server would otherwise
            hold the drain 5 s a call, past its own bound)."""
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the drain's deadline passed")
            return min(5.0, left)

        def unload(group: list[str], deadline: float) -> bool:
            for name in group:
                control_request(url, f"/v2/repository/models/{name}/unload", self.admin_key, timeout=within(deadline))
            while True:
                states = model_states(url, self.admin_key, timeout=within(deadline))
                if not any(states[n][0] in ("READY", "LOADING", "UNLOADING") for n in group):
                    return True
                if time.monotonic() + 0.1 >= deadline:  # (no poll is begun past the deadline)
                    return False
                time.sleep(0.1)

        try:
            names = list(model_states(url, self.admin_key, timeout=within(end)))
            if not unload([n for n in names if n != ROUTER], end):
                return False
            return unload([n for n in names if n == ROUTER], min(end, time.monotonic() + DRAIN_ROUTER_S))
        except (OSError, ValueError, KeyError, TypeError):  # not serving HTTP, or no model control
            return False

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML (default: R2R on the trained pair)")
    p.add_argument("--model-repository", default=str(REPO_ROOT / ".cache" / "model_repository"))
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--execution-env", help="Python environment (a venv folder) for the model stubs; default: "
                   "this interpreter's venv (see `tokenrouter stub-env`)")
    p.add_argument("--peer", action="store_true",
                   help="serve the deployment's models to a router on another server (its YAML names this server "
                        "under the models' `url:`), through gateways `peer_<model>`, with no router here")
    p.add_argument("--no-mps", action="store_true",
                   help="do not start CUDA MPS when models share a GPU (they then time-slice it)")
    p.add_argument("--admin-key", help=f"key for the restricted admin APIs (header {ADMIN_HEADER!r}; gRPC "
                   f"{GRPC_ADMIN_HEADER!r}); default: ${ADMIN_KEY_ENV}, else a random key per start, written to "
                   "--admin-key-file")
    p.add_argument("--admin-key-file", help="where a generated admin key is written, readable by you only "
                   "(default: <model repository>.admin-key; removed when the server stops)")
    p.add_argument("--restricted-apis", default=",".join(ADMIN_APIS),
                   help=f"Triton APIs that need the admin key (default: %(default)s; known: {', '.join(TRITON_APIS)})")
    p.add_argument("--no-restrict", action="store_true", help="leave every Triton API open to anyone who can connect")


def admin_access(args: argparse.Namespace) -> tuple[tuple[str, ...], str | None, str]:
    """`serve`'s options -> (restricted APIs, admin key or None to generate one, where the given key came from).
    ValueError for an unknown API or an unusable key."""
    if args.no_restrict:
        return (), None, ""
    apis = tuple(a.strip() for a in args.restricted_apis.split(",") if a.strip())
    key, source = None, ""
    if args.admin_key:
        key, source = args.admin_key, "--admin-key"
    elif os.environ.get(ADMIN_KEY_ENV):
        key, source = os.environ[ADMIN_KEY_ENV], f"${ADMIN_KEY_ENV}"
    restriction_args(key or "checked-later", apis)  # the checks only; a generated key always passes them
    return apis, key, source


def _ports_in_use(ports: list[int]) -> list[int]:
    """Ports something already listens on: the server would fail on them, and our readiness probe would
    reach that other process and report ready."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(port)
    return busy


def control_request(url: str, path: str, key: str | None, timeout: float = 10.0) -> Any:
    """POST `path` of the Triton HTTP endpoint at `url` (model control: `/v2/repository/...`) with the admin
    key when there is one; the answer as JSON (None when empty). Raises OSError (urllib's errors) and
    ValueError."""
    headers = {"Content-Type": "application/json", **({ADMIN_HEADER: key} if key else {})}
    request = urllib.request.Request(f"{url}{path}", data=b"{}", headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body.strip() else None


def reload_over_grpc(model: str, address: str, key: str | None, timeout: float) -> None:
    """Unload and load `model` through the gRPC model-control API at `address`. Not over HTTP: Triton 2.51's HTTP
    frontend hands each stream's responses to the worker thread that serves the stream through a non-blocking
    command socket (libevhtp's evthr_defer) and ignores a send that fails: the response is dropped. A load or unload
    over HTTP holds its worker thread until it is done (seconds; minutes for a large model's weights), and the streams
    of that thread lost every response the router sent meanwhile, their final ones too: routing around a killed
    model, the small model finished them during the reload, and they never ended (the strace: sendto(...) = -1
    EAGAIN, 276 times in one second of an unload; tests/test_reload_under_streams.py)."""
    import tritonclient.grpc as grpcclient  # (here: only a reviver needs it)
    from tritonclient.utils import InferenceServerException

    headers = {GRPC_ADMIN_HEADER: key} if key else None
    client = grpcclient.InferenceServerClient(address)
    try:
        for action, call in (("unload", client.unload_model), ("load", client.load_model)):
            try:
                call(model, headers=headers, client_timeout=timeout)
            except InferenceServerException as e:
                if e.status() == "StatusCode.UNAVAILABLE":
                    raise ControlUnreachable(address) from None
                raise RuntimeError(f"{action} of {model!r} refused: {e.message()}") from None
    finally:
        client.close()


class ControlUnreachable(RuntimeError):
    """The gRPC model-control endpoint does not answer (one message for every attempt: the reviver logs it once)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"this server's gRPC endpoint ({address}) does not answer: it is shutting down, or does "
                         "not serve gRPC")


def model_states(url: str, key: str | None, timeout: float = 10.0) -> dict[str, tuple[str, str]]:
    """Each model of the repository: (state, reason) as Triton tells them, e.g. ("READY", ""), ("UNLOADING", ""),
    ("UNAVAILABLE", "unloaded")."""
    index = control_request(url, "/v2/repository/index", key, timeout)
    return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in index}


def _stubs(group: int) -> list[tuple[int, list[bytes]]]:
    """The live Python-backend stubs in process group `group`: (pid, command line). The command line names the
    model.py each one serves, then its shared-memory region (a /dev/shm name). An exited stub its server has not
    reaped has no command line."""
    stubs = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if len(argv) > 2 and argv[0].endswith(STUB.encode()):
            stubs.append((int(stat.parent.name), argv))
    return stubs


def _stub_regions(group: int) -> list[str]:
    """The shared-memory regions (/dev/shm names) of the Python-backend stubs in process group `group`."""
    return [argv[2].decode(errors="replace") for _, argv in _stubs(group) if b"/" not in argv[2]]


def _port_problem(ports: list[int]) -> str | None:
    if any(not 0 < p < 65536 for p in ports):
        return f"ports must be in 1-65535, got {ports}"
    if len(set(ports)) != len(ports):
        return f"the HTTP, gRPC and metrics ports must differ, got {ports}"
    return None


def lock_repository(repo: Path) -> IO[str]:
    """Hold `<repo>.lock` while the returned file stays open (the lock goes with this process, however it ends).
    A second server on the same repository would rewrite it, and replace its admin key, under the first one:
    the first would then reload a dead model from the other deployment. RuntimeError if another process
    holds the lock."""
    path = Path(f"{Path(repo).resolve()}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 (held for the server's lifetime)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RuntimeError(f"the model repository {repo} is in use by a running server ({holder}); give this one its "
                           "own with --model-repository") from None
    f.seek(0)
    f.truncate()
    f.write(f"tokenrouter serve, pid {os.getpid()}")
    f.flush()
    return f


def serve_main(args: argparse.Namespace) -> int:
    config_path = Path(args.config).resolve()
    ports = [args.http_port, args.grpc_port, args.metrics_port]
    problem = _port_problem(ports)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    busy = _ports_in_use(ports)
    if busy:
        print(f"error: port(s) {busy} already in use; pick others with --http-port/--grpc-port/--metrics-port",
              file=sys.stderr)
        return 2
    try:
        ensure_models(config_path)
        config = load_config(config_path)  # fail fast, with the config's own error message
        config.check_devices()
        backends = triton_install.prepare_backends()
    except (ConfigError, FileNotFoundError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = Path(args.execution_env).resolve() if args.execution_env else triton_install.execution_env()
    if env is not None and not (env / "bin" / "activate").is_file():
        print(f"error: --execution-env {env} is not a Python environment (no bin/activate)", file=sys.stderr)
        return 2
    problem = stub_env.check(backends / "python" / "triton_python_backend_stub", env)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        apis, admin_key, key_source = admin_access(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        repo_lock = lock_repository(Path(args.model_repository))
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(args, config_path, config, env, apis, admin_key, key_source)
    finally:
        repo_lock.close()


def _serve(args: argparse.Namespace, config_path: Path, config: EngineConfig, env: Path | None,
           apis: Sequence[str], admin_key: str | None, key_source: str | None) -> int:
    """serve_main once everything is checked and the repository is ours: write it, serve until a signal."""
    repo = write_repository(config_path, args.model_repository, execution_env=env, peer=args.peer)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port, verbose=args.log_verbose,
                          admin_key=admin_key, restricted_apis=apis)
    key_file = None
    if server.admin_key is not None and not key_source:
        # Generated: into a file only this user can read, never to the output (logs travel further).
        key_file = Path(args.admin_key_file or f"{repo.resolve()}.admin-key")
        try:
            write_secret(key_file, server.admin_key)
        except OSError as e:
            print(f"error: cannot write the admin key to {key_file}: {e}", file=sys.stderr)
            return 2
        key_source = f"{key_file} (mode 0600)"
    started_mps = False
    shared = mps.shared_gpus(config)
    if shared and not args.no_mps and not mps.running():
        try:
            mps.start()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            if key_file is not None:
                key_file.unlink(missing_ok=True)
            return 2
        started_mps = True
        print(f"started CUDA MPS: models share GPU(s) {shared}", flush=True)
    print(f"starting tritonserver on {repo} (HTTP :{args.http_port}, gRPC :{args.grpc_port}, "
          f"metrics :{args.metrics_port})", flush=True)
    if apis:
        print(f"admin APIs ({', '.join(apis)}) need header '{ADMIN_HEADER}' (gRPC: '{GRPC_ADMIN_HEADER}'); "
              f"key: {key_source}", flush=True)
    else:
        print("warning: every Triton API (model control included) is open to anyone who can connect",
              file=sys.stderr, flush=True)
    server.start()
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        if stop and server.proc is not None and server.proc.poll() is None:  # a second one: no more waiting
            os.write(2, b"second signal: killing tritonserver\n")  # (print may not re-enter a write under way)
            server.proc.kill()
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # When tritonserver was restarted after dying by itself; None until it was first ready (dying before that, it
    # failed to start: a restart would only fail again).
    restarts: list[float] | None = None
    failed = False  # serving ended other than by a signal: a non-zero exit, for whatever supervises `serve`
    try:
        while True:
            try:
                ready = server.wait_ready(cancelled=lambda: stop)
            except RuntimeError:  # it exited while starting
                if restarts is None:
                    raise
                ready = False
            if ready:
                # Its model processes' shared memory, noted now rather than at the first check: a server that died
                # before it left theirs behind (they exit with it, so a stop no longer finds them; a hostile trial).
                server.sweep_replaced_regions(server.stubs_by_model())
                print("tritonserver is back: ready" if restarts else
                      f"ready: try `python clients/grpc_stream.py --url localhost:{args.grpc_port} "
                      "--prompt 'def main():'`", flush=True)
                restarts = restarts or []
            checked = time.monotonic()
            while not stop and server.proc.poll() is None:
                time.sleep(0.5)
                if not stop and time.monotonic() - checked >= ROUTER_CHECK_S:
                    checked = time.monotonic()
                    _keep_router(server, config.watchdog_timeout_s)
            if stop or restarts is None:
                break
            if not _restart_crashed(server, restarts, lambda: stop):
                # (a signal meanwhile is a clean end; code 0: stopped directly, by someone else, too)
                failed = not stop and server.proc.returncode != 0
                break
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        failed = not stop
    finally:
        server.stop()
        if key_file is not None:
            key_file.unlink(missing_ok=True)  # the key died with the server
        if started_mps and not mps.stop():
            print("warning: the CUDA MPS daemon did not quit within 30 s; stop it with "
                  "`echo quit | nvidia-cuda-mps-control`", file=sys.stderr)
    return 1 if failed else 0


def _restart_crashed(server: TritonServer, restarts: list[float], stopping: Callable[[], bool] = lambda: False) -> bool:
    """tritonserver exited without being asked to (`restarts`: when it was restarted before, kept up to date):
    restart it, unless it exited cleanly (someone stopped it directly) or it already was restarted MAX_RESTARTS
    times within RESTART_WINDOW_S. Its model processes and their shared memory go with the old one. Killing a
    model's process under load aborted Triton 2.51 itself at times (a `boost::interprocess::lock_exception` in its
    Python backend, on a mutex the dead process held), which ended the whole service. Whether it restarted."""
    code = server.proc.returncode
    if code == 0:
        print("tritonserver exited (code 0) without being asked to by this process; stopping", file=sys.stderr)
        return False
    cause = f"code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):  # (a number Python has no name for stays a number)
            cause = f"signal {signal.Signals(-code).name}"
    where = f"see {server.log_file}" if server.log_file else "its log is above"
    print(f"error: tritonserver exited unexpectedly ({cause}; {where}); every request in flight was lost",
          file=sys.stderr, flush=True)
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S]
    if len(restarts) >= MAX_RESTARTS:
        print(f"error: tritonserver was restarted {len(restarts)} times in the last {RESTART_WINDOW_S:.0f} s; "
              "not again", file=sys.stderr, flush=True)
        return False
    server.stop()  # (already exited: its leftover model processes and shared memory)
    ports = [server.http_port, server.grpc_port, server.metrics_port]
    deadline = time.monotonic() + PORTS_FREE_WAIT_S
    while _ports_in_use(ports) and time.monotonic() < deadline and not stopping():
        time.sleep(0.5)
    if stopping():  # a signal meanwhile: nothing to start
        return False
    restarts.append(now)
    print(f"restarting tritonserver ({len(restarts)} of at most {MAX_RESTARTS} restarts in "
          f"{RESTART_WINDOW_S:.0f} s)", file=sys.stderr, flush=True)
    server.start()
    return True


def _keep_router(server: TritonServer, watchdog_timeout_s: float | None) -> None:
    """One check of the router model by `tokenrouter serve`, its only reviver (the router revives the subservers):
    Triton 2.51's Python backend neither restarts a stub that died nor stops calling its model ready, so every
    request then failed with "Stub process ... is not healthy" while health checks passed. A router whose process
    died is reloaded; one whose loop has not renewed its beat for watchdog_timeout_s (stopped, or hung: it held
    every request for ever) is killed, and the next check reloads it (its streams in flight end with it, without
    a final response from Triton 2.51). Then the shared memory of replaced stubs goes. One scan of /proc."""
    stubs = server.stubs_by_model()
    router = stubs.get(ROUTER)

    def hung_for() -> float | None:
        """The router's silence where it has reached watchdog_timeout_s, else None."""
        silent = server.router_silent_for()
        hung = watchdog_timeout_s is not None and silent is not None and silent >= watchdog_timeout_s
        return silent if hung else None

    asked = time.monotonic()
    if (router is None or hung_for() is not None) and _router_ready(server):
        # A tritonserver slow to answer stalls the router with it (its calls into the server wait): not the
        # router's fault. Otherwise the beat is read again, after that answer.
        stalled = time.monotonic() - asked > SERVER_STALL_S
        if router is None:
            print("warning: the router model's process exited; reloading it", file=sys.stderr, flush=True)
            try:
                server.reload_router()
            except RuntimeError as e:  # the next check tries again
                print(f"warning: reloading the router failed: {e}", file=sys.stderr, flush=True)
            else:
                print("the router model is back", file=sys.stderr, flush=True)
        elif not stalled and (silent := hung_for()) is not None:
            print(f"warning: the router model's loop has not gone round for {silent:.0f} s "
                  f"(watchdog_timeout_s {watchdog_timeout_s:g}): its process {router[0]} is stopped or hung; killing "
                  "it, to reload it", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(router[0], signal.SIGKILL)
    server.sweep_replaced_regions(stubs)


def _router_ready(server: TritonServer) -> bool:
    """Whether Triton calls the router READY: a dead stub's model stays READY to Triton 2.51; any other state is an
    unload or load under way (an admin's, or the stop's drain), not the reviver's to undo."""
    try:
        states = model_states(f"http://{server.host}:{server.http_port}", server.admin_key, timeout=5)
    except (OSError, ValueError):
        return False  # the server is going away, or busy: the next check sees
    return states.get(ROUTER, ("",))[0] == "READY"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tokenrouter-serve")
    add_arguments(parser)
    sys.exit(serve_main(parser.parse_args()))

