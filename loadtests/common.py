"""What the load experiments share: the environment of the processes they start, the
service's status, waiting on it, polling it, the Locust command line, and percentiles.

``experiment`` (ramp, compare), ``overload`` and ``soak`` all start ``serve run``
(``serve_process``) and Locust as child processes (``env``), read
``GET /v1/speculation`` (``get_status``), wait for the service (``wait_healthy``,
``wait_idle``), poll it in a thread (``StatusPoller``) and run Locust on a shape
(``locust_command``, ``run_locust``, ``constant_load``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[loadtests {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def env() -> dict[str, str]:
    """The environment of ``serve run`` and Locust: this checkout importable, this
    interpreter's scripts first on PATH, Ray's token auth off (local runs)."""
    e = dict(os.environ)
    e["RAY_AUTH_MODE"] = "disabled"
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["PATH"] = os.pathsep.join([str(BIN), e.get("PATH", "")])
    return e


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linearly interpolated; nan if empty."""
    return float(np.percentile(xs, 100 * q)) if len(xs) else float("nan")


# -- the service's status ---------------------------------------------------------------------


def get_status(url: str, timeout_s: float = 5.0) -> dict | None:
    """``GET /v1/speculation`` (the controller's status), or None if it does not answer."""
    with contextlib.suppress(requests.RequestException, ValueError):
        r = requests.get(f"{url}/v1/speculation", timeout=timeout_s)
        if r.status_code == 200:
            return r.json()
    return None


def poll_until(check: Callable[[], T | None], timeout_s: float, what: str, period_s: float = 0.5) -> T:
    """``check()`` every ``period_s`` until it returns something truthy (returned);
    TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if result := check():
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f} s")
        time.sleep(period_s)


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``GET /health`` answers 200; raises at once if ``proc`` (``serve run``) exits."""

    def healthy() -> bool | None:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode} before the service was ready")
        with contextlib.suppress(requests.RequestException):
            return requests.get(f"{url}/health", timeout=2).status_code == 200
        return None

    poll_until(healthy, timeout_s, f"{url}/health not ready")


def is_idle(status: dict | None) -> bool:
    """Every replica reports no running or queued request and no KV cache block held."""
    return bool(status and status["replicas"]) and all(
        r["active"] == 0 and r["queued"] == 0 and not r.get("kv_cache_usage") for r in status["replicas"].values())


def wait_idle(url: str, timeout_s: float = 60.0) -> dict:
    """The controller status once the service is idle (``is_idle``)."""
    last = None

    def idle() -> dict | None:
        nonlocal last
        last = get_status(url)
        return last if is_idle(last) else None

    try:
        return poll_until(idle, timeout_s, "service not idle")
    except TimeoutError as err:
        raise TimeoutError(f"{err}: {last}") from None


class StatusPoller:
    """Reads ``/v1/speculation`` every ``period_s`` in a thread; ``rows_of(status, t)``
    turns one answer (``t``: seconds since ``start``) into rows, kept in ``rows``."""

    def __init__(self, url: str, period_s: float, rows_of: Callable[[dict, float], list[dict]]) -> None:
        self.url, self.period_s, self.rows_of = url, period_s, rows_of
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()

    def start(self) -> StatusPoller:
        self.t0 = time.time()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        nxt = time.time()
        while not self._stop.is_set():
            st = get_status(self.url)
            if st is not None:
                self.rows.extend(self.rows_of(st, time.time() - self.t0))
            nxt += self.period_s
            self._stop.wait(max(nxt - time.time(), 0.0))


def port_open(host: str, port: int) -> bool:
    """Something accepts TCP connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def wait_port_closed(host: str, port: int, timeout_s: float, what: str) -> None:
    """Until nothing listens on ``host:port``; TimeoutError naming ``what`` after ``timeout_s``."""
    poll_until(lambda: not port_open(host, port), timeout_s, what)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_group(cmd: list[str], logf) -> subprocess.Popen:
    """``cmd`` in its own session (so a signal reaches its whole process group), output to
    ``logf``, SIGINT at its default even when this process ignores it: a runner started
    in the background by a non-interactive shell ignores SIGINT (POSIX), its children
    inherit that, and ``serve run`` then never shuts down on SIGINT (every stop took the
    30 s to SIGKILL, which leaves Ray's actors to die on their own)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_sigint_default)


def service_url(stack: contextlib.ExitStack, url: str | None, config: Path, out: Path, port: int | None,
                ready_timeout_s: float) -> str:
    """The base URL to load: ``url`` (a running service) once healthy, else a ``serve_process``
    of ``config`` held open by ``stack``."""
    if url:
        url = url.rstrip("/")
        wait_healthy(url, ready_timeout_s)
        return url
    return stack.enter_context(serve_process(config, out, port, ready_timeout_s))


@contextlib.contextmanager
def serve_process(config: Path, out: Path, port: int | None = None,
                  ready_timeout_s: float = 300.0, stop_timeout_s: float = 60.0) -> Iterator[str]:
    """``serve run config`` in its own process group; yields the base URL; SIGINT to the
    group afterwards (SIGKILL if it lingers), returning once the port is free.

    The port must be free before the start (waited for up to ``stop_timeout_s``: a
    service stopped just before may still be going down). Otherwise the readiness check
    could be answered by the old service: in one comparison a service was "ready in
    0 s" on its predecessor's proxy, and its first cell measured 0 tok/s."""
    cfg = yaml.safe_load(config.read_text())
    http = cfg.setdefault("http_options", {})
    if port is not None:
        http["port"] = port
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    url = f"http://{host}:{port}"
    wait_port_closed(host, port, stop_timeout_s, f"{url} is still served by another process")
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    run_cfg = raw / "serve-config.yaml"
    run_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_path = raw / f"serve-{config.stem}.log"
    logf = open(log_path, "a")  # noqa: SIM115 - closed below; every service of a run appends
    logf.write(f"\n==== serve run {config} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    logf.flush()
    log(f"serve run {config} -> {url} (log: {log_path})")
    proc = start_group([str(BIN / "serve"), "run", str(run_cfg)], logf)
    try:
        t0 = time.time()
        wait_healthy(url, ready_timeout_s, proc)
        log(f"service ready in {time.time() - t0:.0f} s")
        yield url
    finally:
        t0 = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log("serve run still up 30 s after SIGINT: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logf.close()
        wait_port_closed(host, port, stop_timeout_s, f"{url} still served {stop_timeout_s:.0f} s after the stop")
        log(f"service stopped in {time.time() - t0:.0f} s")


# -- Locust -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadArgs:
    """What every simulated user sends."""

    max_tokens: int = 64
    temperature: float = 0.0
    stream: bool = True
    model: str = ""          # served model name ("" = the first of /v1/models)
    chat: bool = False


def locust_command(url: str, shape: str, prefix: Path, load: LoadArgs, *,
                   stop_timeout_s: int | None = None) -> list[str]:
    """Headless Locust on ``loadtests/locustfile.py`` and a ``loadtests.shapes`` spec;
    per-request records in ``{prefix}-records.jsonl``, Locust's CSVs at ``prefix``.
    ``stop_timeout_s``: let in-flight requests finish when the shape ends."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"),
           "--headless", "--host", url, "--shape", shape, "--records", f"{prefix}-records.jsonl",
           "--csv", str(prefix), "--csv-full-history", "--only-summary", "--exit-code-on-error", "0",
           "--max-tokens", str(load.max_tokens), "--temperature", str(load.temperature),
           "--loglevel", "WARNING"]
    if stop_timeout_s is not None:
        cmd += ["--stop-timeout", str(stop_timeout_s)]
    if not load.stream:
        cmd.append("--no-stream")
    if load.model:
        cmd += ["--model", load.model]
    if load.chat:
        cmd.append("--chat")
    return cmd


def read_records(path: Path) -> list[dict]:
    """The per-request JSON lines Locust's users wrote (``--records``); none if absent."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_locust(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run a ``locust_command`` (output to ``log_path``) -> (exit code, wall seconds)."""
    t0 = time.time()
    with open(log_path, "w") as lf:
        rc = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=lf, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode
    return rc, time.time() - t0


def constant_load(url: str, users: int, duration_s: int, prefix: Path, max_tokens: int, stop_timeout_s: int,
                  model: str = "") -> tuple[int, float]:
    """Constant ``users`` for ``duration_s``, every in-flight request let finish -> (rc, wall s)."""
    cmd = locust_command(url, f"const:{users}:{duration_s}", prefix, LoadArgs(max_tokens=max_tokens, model=model),
                         stop_timeout_s=stop_timeout_s)
    Path(f"{prefix}-records.jsonl").unlink(missing_ok=True)
    log(" ".join(cmd[2:]))
    return run_locust(cmd, Path(f"{prefix}-locust.log"), duration_s + stop_timeout_s + 120)
