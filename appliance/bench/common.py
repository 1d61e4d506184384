"""Shared helpers for the benchmarks: server subprocesses, a streaming client, statistics.

Nothing here imports MLX: the benchmark process only launches servers and talks HTTP to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

OPENBLAS_PATH = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
"""Debian's OpenBLAS (apt package `libopenblas0-pthread`), preloaded into both servers."""

# --------------------------------------------------------------------------------------
# statistics (pure)
# --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Same definition as numpy's default (`method="linear"`). None for an empty sequence.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    weight = rank - low
    return float(ordered[low] * (1.0 - weight) + ordered[high] * weight)


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for an empty sequence."""
    return sum(values) / len(values) if values else None


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# --------------------------------------------------------------------------------------
# one streamed request
# --------------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    """What the client saw of one streamed request. Times are seconds since it was sent."""

    client: int
    index: int
    duration_s: float
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        """Request sent → first chunk carrying generated text."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens when available, else the number of text chunks."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """A compact JSON-able record (no per-chunk times)."""
        return {
            "client": self.client,
            "index": self.index,
            "ok": self.ok,
            "error": self.error,
            "duration_s": round(self.duration_s, 6),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "chunks": len(self.chunk_times),
            "usage_tokens": self.usage_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """All generated text in one `chat.completion.chunk` (content and reasoning deltas)."""
    parts: list[str] = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            value = delta.get(key)
            if isinstance(value, str):
                parts.append(value)
    return "".join(parts)


def usage_completion_tokens(chunk: Mapping[str, Any]) -> int | None:
    """`usage.completion_tokens` of a chunk, if it carries one."""
    return _usage_int(chunk, "completion_tokens")


def _usage_int(chunk: Mapping[str, Any], key: str, detail: str | None = None) -> int | None:
    usage = chunk.get("usage")
    if not isinstance(usage, Mapping):
        return None
    value = usage.get(key)
    if detail is not None:
        value = value.get(detail) if isinstance(value, Mapping) else None
    return value if isinstance(value, int) else None


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    payload: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    client_id: int = 0,
    index: int = 0,
) -> RequestTiming:
    """POST a streaming chat completion and time every chunk that carries text."""
    start = time.perf_counter()
    timing = RequestTiming(client=client_id, index=index, duration_s=0.0)
    try:
        async with client.stream("POST", url, json=dict(payload), headers=dict(headers)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {body[:300]}"
            else:
                await _consume_stream(resp, timing, start)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.duration_s = time.perf_counter() - start
    return timing


async def _consume_stream(resp: httpx.Response, timing: RequestTiming, start: float) -> None:
    async for line in resp.aiter_lines():
        data = sse_data(line)
        if not data:
            continue
        if data == "[DONE]":
            return
        now = time.perf_counter() - start
        chunk = json.loads(data)
        if "error" in chunk:
            timing.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk_text(chunk):
            timing.chunk_times.append(now)
        tokens = usage_completion_tokens(chunk)
        if tokens is not None:
            timing.usage_tokens = tokens
            timing.prompt_tokens = _usage_int(chunk, "prompt_tokens")
            timing.cached_tokens = _usage_int(chunk, "prompt_tokens_details", "cached_tokens")


# --------------------------------------------------------------------------------------
# server subprocesses
# --------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def running(server: ServerProcess, stop_timeout_s: float = 20.0) -> Iterator[ServerProcess]:
    """Start `server` and always stop it (by its own PID) on the way out."""
    try:
        server.start()
        yield server
    finally:
        server.stop(stop_timeout_s)


class ServerStartError(RuntimeError):
    """A server under test exited or never became ready."""


async def wait_ready(
    server: ServerProcess,
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


# --------------------------------------------------------------------------------------
# environment facts for the report
# --------------------------------------------------------------------------------------


def server_env(blas: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every server gets: ours plus `LD_PRELOAD` of OpenBLAS, or without it."""
    env = dict(os.environ if base is None else base)
    env.pop("LD_PRELOAD", None)
    if blas == "openblas":
        env["LD_PRELOAD"] = str(OPENBLAS_PATH)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def default_blas() -> str:
    """`openblas` when Debian's OpenBLAS is installed (Linux), else `bundled`."""
    return "openblas" if platform.system() == "Linux" and OPENBLAS_PATH.exists() else "bundled"


def git_commit(repo: Path) -> str:
    """Short HEAD commit, with `-dirty` when the work tree has changes; `unknown` without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def safetensors_summary(model_dir: Path) -> dict[str, Any]:
    """Parameter count and dtypes from the safetensors headers (no weights are read)."""
    params = 0
    dtypes: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtypes.add(str(info["dtype"]))
            params += math.prod(info["shape"])
    return {"parameters": params, "dtypes": sorted(dtypes)}


MODEL_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def model_facts(model_dir: Path) -> dict[str, Any]:
    """The shape of the model under test, from `config.json` and the weight headers."""
    facts: dict[str, Any] = {"path": str(model_dir.resolve())}
    config_path = model_dir / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        facts.update({key: config[key] for key in MODEL_SHAPE_KEYS if key in config})
        quant = config.get("quantization")
        if isinstance(quant, Mapping):
            facts["quantization"] = dict(quant)
    facts.update(safetensors_summary(model_dir))
    return facts


def describe_model(facts: Mapping[str, Any]) -> str:
    """One line: `llama, 30 layers, hidden 576, ...`."""
    parts = [str(facts.get("model_type", "?"))]
    labels = (
        ("num_hidden_layers", "layers"),
        ("hidden_size", "hidden"),
        ("num_attention_heads", "heads"),
        ("num_key_value_heads", "kv heads"),
        ("intermediate_size", "ffn"),
        ("vocab_size", "vocab"),
    )
    parts += [f"{label} {facts[key]}" for key, label in labels if key in facts]
    if facts.get("parameters"):
        parts.append(f"{facts['parameters'] / 1e6:.1f}M params")
    if facts.get("dtypes"):
        parts.append("/".join(facts["dtypes"]))
    if facts.get("quantization"):
        parts.append(f"quantized {facts['quantization']}")
    return ", ".join(parts)


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


def write_report(output_dir: Path, markdown: str, report: Mapping[str, Any],
                 json_path: Path | None) -> None:
    """Print the Markdown; keep it and the JSON in the run's folder (and at --json)."""
    print(markdown)
    (output_dir / "report.md").write_text(markdown + "\n")
    text = json.dumps(report, indent=2) + "\n"
    (output_dir / "results.json").write_text(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
