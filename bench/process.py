"""Process control for the benchmarks: servers under test as child processes (started,
polled until ready, always stopped by their own PID), their environment (which BLAS) and
what each really mapped (OpenBLAS, skinny_matmul), and a SIGTERM that unwinds through the
``finally`` blocks that stop them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from appliance.backend.blas import CORETYPE, wanted_coretype
from bench.report import display_command, relative

T = TypeVar("T")


OPENBLAS_PATH = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
"""Debian's OpenBLAS (apt package `libopenblas0-pthread`), preloaded into both servers."""


def resident(pid: int | None) -> dict[str, int] | None:
    """A live process's resident memory in bytes (Linux's /proc): ``rss`` now and ``peak``
    (the high-water mark since it started); None where there is no such file."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:  # "VmRSS:   123456 kB"
        return {key: int(fields[name].split()[0]) * 1024
                for key, name in (("rss", "VmRSS"), ("peak", "VmHWM"))}
    except (KeyError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """One server under test, run as a child process with its output in a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            # Own session: a Ctrl-C in the terminal reaches the benchmark only, which then
            # stops the server itself (by PID) in its `finally`.
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def mapped_libraries(self) -> str:
        """The process's memory map (Linux), to check which BLAS it really loaded."""
        if self.pid is None:
            return ""
        try:
            return Path(f"/proc/{self.pid}/maps").read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class ServerGroup:
    """One server on several ranks (``bench.ranks``): rank 0 serves HTTP and stands for
    the group (its PID, command, log, mapped libraries); the group has exited as soon as
    any rank has, and stops rank 0 first, then each other rank by its own PID."""

    ranks: list[ServerProcess]
    follower_grace_s: float = 5.0
    """How long a follower may take to leave by itself once rank 0 is gone."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a server group needs at least one rank")

    @property
    def leader(self) -> ServerProcess:
        return self.ranks[0]

    @property
    def name(self) -> str:
        return self.leader.name

    @property
    def argv(self) -> list[str]:
        return self.leader.argv

    @property
    def env(self) -> dict[str, str]:
        return self.leader.env

    @property
    def log_path(self) -> Path:
        return self.leader.log_path

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.leader.proc

    @property
    def pid(self) -> int | None:
        return self.leader.pid

    def start(self) -> None:
        """Followers first, so that they are listening when the leader comes up."""
        for rank in reversed(self.ranks):
            rank.start()

    def exited(self) -> int | None:
        codes = [rank.exited() for rank in self.ranks]
        return next((code for code in codes if code is not None), None)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        code = self.leader.stop(timeout_s)
        for rank in self.ranks[1:]:
            if rank.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rank.proc.wait(timeout=self.follower_grace_s)
            rank.stop(timeout_s)
        return code

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(f"-- rank {i} ({rank.log_path}):\n{rank.log_tail(lines)}"
                         for i, rank in enumerate(self.ranks))

    def mapped_libraries(self) -> str:
        return self.leader.mapped_libraries()

    def rank_facts(self) -> list[dict[str, Any]]:
        """Per rank: its command, PID and exit code (for the report)."""
        return [{"rank": i, "command": display_command(rank.argv), "pid": rank.pid,
                 "log": relative(rank.log_path),
                 "exit_code": rank.proc.returncode if rank.proc else None}
                for i, rank in enumerate(self.ranks)]


class Server(Protocol):
    """What the harnesses need of a server under test: one process or a group of ranks."""

    @property
    def name(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def pid(self) -> int | None: ...
    def start(self) -> None: ...
    def exited(self) -> int | None: ...
    def stop(self, timeout_s: float = 20.0) -> int | None: ...
    def log_tail(self, lines: int = 30) -> str: ...
    def mapped_libraries(self) -> str: ...


S = TypeVar("S", bound=Server)


def server_group(name: str, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                 log_path: Path) -> ServerGroup:
    """One ServerProcess per rank; rank R > 0 logs beside rank 0 as ``STEM-rankR.log``."""
    ranks = [ServerProcess(name=name if r == 0 else f"{name} rank {r}", argv=list(argv),
                           env=env, log_path=log_path if r == 0 else
                           log_path.with_name(f"{log_path.stem}-rank{r}{log_path.suffix}"))
             for r, (argv, env) in enumerate(zip(argvs, envs, strict=True))]
    return ServerGroup(ranks)


@contextlib.contextmanager
def running(server: S, stop_timeout_s: float = 20.0) -> Iterator[S]:
    """Start `server` and always stop it (by its own PID) on the way out."""
    try:
        server.start()
        yield server
    finally:
        server.stop(stop_timeout_s)


class ServerStartError(RuntimeError):
    """A server under test exited or never became ready."""


async def wait_ready(
    server: Server,
    base_url: str,
    headers: Mapping[str, str],
    timeout_s: float,
) -> dict[str, Any]:
    """Poll `GET /health` until it answers 200 with `{"status": "ok"}`; return that JSON."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            code = server.exited()
            if code is not None:
                raise ServerStartError(
                    f"{server.name} exited with code {code} before it was ready; "
                    f"log {server.log_path}:\n{server.log_tail()}"
                )
            try:
                resp = await client.get(f"{base_url}/health", headers=dict(headers))
                body = resp.json() if resp.content else {}
                if (
                    resp.status_code == 200
                    and isinstance(body, dict)
                    and body.get("status") == "ok"
                ):
                    return body
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.25)
    raise ServerStartError(
        f"{server.name} not ready after {timeout_s:.0f}s (last: {last}); "
        f"log {server.log_path}:\n{server.log_tail()}"
    )


def server_env(blas: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every server gets: ours plus `LD_PRELOAD` of OpenBLAS, or without it."""
    env = dict(os.environ if base is None else base)
    env.pop("LD_PRELOAD", None)
    if blas == "openblas":
        env["LD_PRELOAD"] = str(OPENBLAS_PATH)
        # the kernels our daemon asks OpenBLAS for, for every peer on it too
        core = wanted_coretype(str(OPENBLAS_PATH))
        if core is not None:
            env.setdefault(CORETYPE, core)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def default_blas() -> str:
    """`openblas` when Debian's OpenBLAS is installed (Linux), else `bundled`."""
    return "openblas" if platform.system() == "Linux" and OPENBLAS_PATH.exists() else "bundled"


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_guarded(coro: Coroutine[Any, Any, T], output_dir: Path) -> T | None:
    """Run the benchmark's event loop; SIGTERM unwinds through the ``finally`` blocks that
    stop the servers. None when interrupted (Ctrl-C)."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        print(f"[bench] interrupted; logs in {output_dir}", file=sys.stderr)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def blas_facts(server: Server) -> dict[str, bool | None]:
    """What the server process really mapped: OpenBLAS (not numpy's libscipy_openblas) and
    our skinny_matmul (:mod:`appliance.backend.blas`); None where /proc is unavailable."""
    maps = server.mapped_libraries()
    return {"openblas_loaded": "/libopenblas" in maps if maps else None,
            "skinny_matmul_loaded": "/_skinny_matmul" in maps if maps else None}


def blas_report(blas: str, servers: Mapping[str, Mapping[str, Any]]) -> str:
    """Which BLAS was asked for, and whether each server process really mapped OpenBLAS."""
    seen = ", ".join(
        f"{name}: {_openblas_state(s.get('openblas_loaded'))}"
        f"{', skinny_matmul mapped' if s.get('skinny_matmul_loaded') else ''}"
        for name, s in servers.items()
    )
    if blas == "openblas":
        return f"OpenBLAS via LD_PRELOAD={OPENBLAS_PATH} ({seen})"
    return f"the BLAS bundled with the mlx wheel, no LD_PRELOAD ({seen})"


def _openblas_state(loaded: bool | None) -> str:
    if loaded is None:
        return "unchecked"
    return "libopenblas mapped" if loaded else "no libopenblas mapped"
