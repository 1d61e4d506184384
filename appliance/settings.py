"""One typed settings tree, built once at start-up and passed down.

Precedence: defaults < TOML config file < ``APPLIANCE_*`` environment < command-line flags.
Every field carries its documentation, its bounds and its flag in ``field(metadata=...)``;
the CLI flags and the table in docs/configuration.md are derived from (and tested against)
these fields.
Nothing here reads the environment at import time: :func:`load` is called once in ``main()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "APPLIANCE_"
CONFIG_NAME = "appliance.toml"
"""The config file every command reads from the data folder when none is named, so the
daemon and ``appliance job``/``user`` (which share that folder's database) agree."""


def _opt(default: Any, help: str, *, lo: float | None = None, hi: float | None = None,
         choices: Sequence[str] | None = None) -> Any:
    meta = {"help": help, "lo": lo, "hi": hi, "choices": tuple(choices) if choices else None}
    return field(default=default, metadata=meta)


def default_data_dir() -> str:
    if sys.platform == "darwin":
        return str(Path.home() / "Library" / "Application Support" / "appliance")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "appliance")


@dataclass(slots=True)
class ServerSettings:
    host: str = _opt("127.0.0.1", "Address to listen on. Use 0.0.0.0 to serve the LAN.")
    port: int = _opt(8080, "TCP port of the HTTP server.", lo=1, hi=65535)
    max_queue_depth: int = _opt(
        32, "Requests that may wait for a slot; beyond this new ones get HTTP 503.", lo=1, hi=100_000)
    shutdown_timeout: float = _opt(
        30.0, "Seconds SIGTERM waits for running requests to finish before cancelling them.",
        lo=0, hi=3600)
    log_level: str = _opt("info", "Logging level.", choices=("debug", "info", "warning", "error"))
    max_connections: int = _opt(
        1000, "Open HTTP connections at once; a new one beyond this is answered 503 and closed. "
        "Always kept below the open-file limit, which serve raises to the hard limit.",
        lo=8, hi=1_000_000)
    header_timeout: float = _opt(
        10.0, "Seconds a connection may take to send a whole request head, and may stay idle "
        "between requests; then it is closed.", lo=0.5, hi=3600)
    body_timeout: float = _opt(
        30.0, "Seconds a request may take to send its whole body once its head has arrived; "
        "then it is answered 408 and the connection closed (a body sent a byte at a time "
        "cannot hold a connection).", lo=0.5, hi=3600)
    address_connection_share: float = _opt(
        0.25, "Largest share of --max-connections that one client address may hold; its "
        "further connections are answered 503 (Retry-After) and closed at once, while other "
        "addresses still get in. Trusted proxies are not limited.", lo=0.01, hi=1.0)
    trusted_proxies: str = _opt(
        "", "Comma-separated addresses or networks of reverse proxies whose X-Forwarded-For "
        "and X-Forwarded-Proto are believed (client address, https). Empty: nobody's.")
    shared_device_idle_minutes: int = _opt(
        10, "Minutes of inactivity after which a browser session logged in with 'Shared "
        "device' (the kitchen tablet) ends; such a session's cookie also ends with the "
        "browser.", lo=1, hi=24 * 60)
    pdf_read_seconds: float = _opt(
        60.0, "Longest time (wall and CPU) reading the text of one PDF attached in the chat "
        "may take, in a process of its own; past it the reading is stopped and the person "
        "told why.", lo=0.5, hi=3600.0)
    pdf_read_memory_mb: int = _opt(
        768, "Most memory (MiB of address space) that process may use.", lo=128, hi=65536)
    chat_titles: bool = _opt(
        True, "After a conversation's first answer, the model writes it a short title (a "
        "background request in the asker's name); off: the first question, cut on a word.")


@dataclass(slots=True)
class EngineSettings:
    model: str = _opt(
        "", "Model directory, a Hugging Face repo id pulled into the models folder, a model "
        "imported there (appliance model import), or 'demo'. Empty: SmolLM2-135M-Instruct "
        "when install.sh has imported it, else the bundled demo model.")
    max_batch_size: int = _opt(
        8, "Most sequences prefilling or decoding at once.", lo=1, hi=1024)
    ctx_size: int = _opt(
        0, "Context length per sequence (prompt + output). 0: the model's own limit.",
        lo=0, hi=1_048_576)
    prefill_chunk_size: int = _opt(
        -1, "Prompt tokens per prefill chunk. -1: sized in time, as many as fit the tick "
        "target (see itl_target_ms, ttft_target_ms) by a cost model fitted to the engine's "
        "own measured ticks; N fixes it; 0 disables chunking.", lo=-1, hi=1_048_576)
    prefill_grant_interval: int = _opt(
        16, "A parked prefill still gets a chunk at least every this many decode ticks.",
        lo=1, hi=10_000)
    no_batch: bool = _opt(False, "Serve one sequence at a time (max batch size 1).")
    default_max_tokens: int = _opt(
        512, "Output tokens when a request does not say.", lo=1, hi=1_048_576)
    kv_cache_budget: str = _opt(
        "auto", "KV cache budget: bytes (suffix K, M or G allowed), 'auto' (half of the memory "
        "available once the model is loaded, less 1 GiB, at least 64 MiB) or 'none'.")
    prompt_cache_entries: int = _opt(
        64, "Finished requests whose KV is kept so the same user's next turn reuses it "
        "(scoped per user); 0 turns the prompt cache off.", lo=0, hi=100_000)
    kv_admission_watermark: float = _opt(
        0.01, "Share of the KV budget admission keeps free while a decode batch runs.",
        lo=0.0, hi=0.5)
    enable_preemption: bool = _opt(
        False, "Admit on prompt + first token and preempt when the KV budget runs out (else "
        "each request reserves prompt + max_tokens and nothing is preempted).")
    class_preemption: bool = _opt(
        True, "When every slot is taken and a higher-class request waits (voice over "
        "interactive over background), one lower-class request yields its slot; its KV is "
        "parked in the prompt cache so it resumes without recomputing.")
    share_preemption: bool = _opt(
        True, "fair policy: when every slot is taken, a user holding more than their "
        "weighted share of the batch, and ahead of the next waiting user on the counters, "
        "yields one request's slot (its KV is parked as for class preemption), so two busy "
        "users are served in the ratio of their weights, not one request each in turn.")
    preemption_policy: str = _opt(
        "fair", "Victim order: 'fair' (lowest effective class, then highest counter), "
        "'longest-first' or 'lowest-priority'.",
        choices=("fair", "longest-first", "lowest-priority"))
    native: bool = _opt(
        True, "The appliance's native code where MLX runs on the CPU (the skinny_matmul "
        "kernel, the fast CPU ops, malloc kept big buffers). Off (APPLIANCE_NATIVE=off): MLX "
        "as shipped, with the BLAS the blas setting chooses. Metal and CUDA never use it.")
    blas: str = _opt(
        "auto", "Linux only: 'openblas' loads Debian's OpenBLAS in place of the slow reference "
        "BLAS bundled in the mlx[cpu] wheel; 'auto' does so when it is installed.",
        choices=("auto", "openblas", "bundled"))
    skinny_matmul: bool = _opt(
        True, "Linux with OpenBLAS: matrix products of at most 32 rows (the decode steps of "
        "small batches, with short prompt chunks riding in them) run the appliance's own kernel, which reads the weights once where "
        "OpenBLAS's gemm first copies them (decode steps 1.2-1.5x faster on a 2-core x86); a row "
        "gets the same bits alone and in a batch.")
    fast_cpu_ops: bool = _opt(
        True, "MLX on the CPU: attention's softmax, the MLP's SwiGLU, RoPE and RMSNorm run the "
        "appliance's own operations (appliance/backend/native/mlx_fast.cpp) instead of MLX's, which "
        "compute exp one element at a time and have no CPU kernels for RoPE and RMSNorm "
        "(prefill 1.7-2.3x faster, long-context decode steps up to 1.8x, on a 2-core x86); "
        "the logits agree with MLX's to float32 rounding.")
    simd: str = _opt(
        "auto", "The instruction set of all the native CPU code (skinny_matmul, the quantized "
        "products, the fast operations and the fused layer, float16 KV caches), chosen once: "
        "'auto' takes the widest the processor runs; 'avx512', "
        "'avx2' or 'portable' ask for one (taken when the processor runs it), for comparisons "
        "and tests. The variants agree to rounding, not to the bit (FMA).",
        choices=("auto", "avx512", "avx2", "portable"))
    quant_act: str = _opt(
        "auto", "How the native 4- and 8-bit products take their activations: 'int16' "
        "(rounded to 16 bits once a product, the weights read from tiles; faster at every "
        "row count on AVX2 and AVX-512) or 'float'; 'auto' takes int16 there and float on "
        "the portable variant.", choices=("auto", "float", "int16"))
    quant_threads: int = _opt(
        0, "Threads of the native code's one pool (skinny_matmul's float products, the "
        "quantized products, the fused decode layer, the fast operations' big ones), the "
        "caller included. 0: the cores this process may run on (its affinity mask), at "
        "most 8.", lo=0, hi=64)
    kv_dtype: str = _opt(
        "float16", "The KV cache of a quantized model on the CPU with the fast operations: "
        "'float16' (half the bytes a decode step reads and half the KV budget's; llama.cpp "
        "keeps float16 too) or 'float32' (the numbers bit for bit mlx-lm's). Other models keep "
        "their own dtype.", choices=("float16", "float32"))
    draft_tokens: int = _opt(
        8, "Speculative decoding by prompt lookup: while one to four streams decode, "
        "the tokens that followed each one's last words where they occurred before (in its prompt or "
        "output) are checked in one forward, at most this many, and kept as far as they "
        "agree with what it samples (the same tokens greedy and seeded; as many as pay for "
        "their forward on this machine, fitted as it runs, in a forward no longer than "
        "itl_factor plain steps). 0 turns it off.", lo=0, hi=32)
    gather_ms: float = _opt(
        20.0, "When requests arrive while nothing runs, the engine waits this long for "
        "another before planning a tick (again after each further one, five at most), so "
        "requests sent together are read in one tick and start together. 0: plan at once.",
        lo=0.0, hi=1000.0)
    itl_target_ms: float = _opt(
        0.0, "Inter-token latency objective: the longest tick while a batch decodes (prefill "
        "chunks are sized to fit). 0: itl_factor times the predicted decode step.",
        lo=0.0, hi=600_000.0)
    itl_factor: float = _opt(
        2.0, "With itl_target_ms 0, a tick may last this many predicted decode steps.",
        lo=1.0, hi=1000.0)
    ttft_target_ms: float = _opt(
        1000.0, "Time-to-first-token objective: no tick is planned longer than half of it, "
        "so an arrival waits for at most one bounded tick, decoding or not; once a burst of "
        "arrivals has waited half of it unread, or nothing decodes and several wait unread, "
        "a tick may last all of it to read them together.",
        lo=1.0, hi=600_000.0)
    presence_s: float = _opt(
        60.0, "Someone counts as about for this many seconds after a voice or interactive "
        "request of theirs was last live; meanwhile other people's work that can wait (a "
        "chunk of a long document, a background job's prompt) is read in ticks of about one "
        "arrival_tokens turn's reading, so their chat turns and voice commands wait short "
        "ticks. 0: only while such a request is live.",
        lo=0.0, hi=86400.0)
    arrival_tokens: int = _opt(
        64, "The chat turn or voice command the presence rule keeps ticks short for: while "
        "someone is about, a tick of other people's work that can wait lasts about what "
        "reading this many prompt tokens alone takes (never under an 8-token chunk's time).",
        lo=1, hi=1_000_000)
    debug_invariants: bool = _opt(
        False, "Check the scheduler's invariants on every tick (slower; tests turn it on).")
    engine_stall_timeout: float = _opt(
        120.0, "Seconds the engine may go without finishing a tick while requests wait "
        "before it is declared stalled: waiting requests get HTTP 503, /health answers 503 "
        "and the daemon exits with status 70 so systemd/launchd restart it. 0: never.",
        lo=0.0, hi=86400.0)


@dataclass(slots=True)
class SchedSettings:
    policy: str = _opt(
        "fair", "Who goes next: 'fair' (class with aging, then the lowest virtual token "
        "counter) or 'fcfs' (class, then arrival).", choices=("fair", "fcfs"))
    w_in: float = _opt(1.0, "Counter cost of one computed prompt token.", lo=0.0, hi=1000.0)
    w_out: float = _opt(2.0, "Counter cost of one output token.", lo=0.0, hi=1000.0)
    aging_seconds: float = _opt(
        30.0, "A waiting request rises one class per this many seconds (fair); 0: no aging.",
        lo=0.0, hi=86400.0)
    background_reserve: int = _opt(
        1, "Batch slots kept for backlogged background work (fair).", lo=0, hi=1024)


@dataclass(slots=True)
class StoreSettings:
    data_dir: str = _opt(default_data_dir(), "Folder for the database, pulled models and logs.")
    ledger_backlog: int = _opt(
        1000, "Ledger rows kept in memory while the database takes no writes (disk full, "
        "read-only); with this many waiting, new model requests get 503 storage_unavailable "
        "until the disk is back and the rows are written.", lo=1, hi=1_000_000)
    backup_interval_minutes: int = _opt(
        60, "Minutes between copies of the database to appliance.db.backup in the data "
        "folder (one is always taken at start); 0: only the one at start.", lo=0, hi=7 * 24 * 60)


@dataclass(slots=True)
class JobsSettings:
    timezone: str = _opt(
        "", "The household's time zone for job schedules (an IANA name such as "
        "'Europe/Paris'). Empty: the machine's local time zone.")
    url_allow: str = _opt(
        "", "Private or loopback addresses that admins' url jobs and webhooks may reach, "
        "comma separated: an IP or CIDR, optionally with ':port' (e.g. "
        "'192.168.1.10:8123, 10.0.0.0/8'). Members' jobs always reach public addresses only.")
    fetch_max_bytes: int = _opt(
        5 << 20, "Most bytes a url job downloads per run; a bigger answer is an error.",
        lo=1024, hi=1 << 30)
    fetch_timeout: float = _opt(
        20.0, "Seconds a url job's download may take, redirects included.", lo=1, hi=600)
    document_max_bytes: int = _opt(
        2 << 20, "Most bytes of text a job summarises per run (a pasted document, or the text "
        "taken from a page, feed or conversations).", lo=1024, hi=1 << 30)
    output_max_tokens: int = _opt(
        2000, "Upper bound of a job's output tokens (each job sets its own limit below it).",
        lo=16, hi=1_048_576)
    chunk_tokens: int = _opt(
        0, "Source tokens per map step of a long document. 0: half the context less the "
        "instructions and the output, at most 4096.", lo=0, hi=1_048_576)
    misfire_grace: float = _opt(
        6 * 3600.0, "Seconds a scheduled run may be late (daemon down or busy) and still "
        "run, once; older slots are skipped.", lo=1, hi=7 * 86400)
    webhook_retries: int = _opt(
        3, "Attempts to deliver a job's result to its webhook before recording a failure.",
        lo=1, hi=10)
    member_min_interval: int = _opt(
        300, "Shortest schedule a member's job may have, in seconds: an interval below it is "
        "refused (400), and so is a cron expression whose runs come closer. Lower it only to "
        "test.", lo=1, hi=86400)
    admin_min_interval: int = _opt(
        60, "Shortest schedule an admin's job may have, in seconds (as for members). Lower it "
        "only to test.", lo=1, hi=86400)
    runs_keep: int = _opt(
        100, "Finished runs kept per job (the newest); older ones are deleted after each run.",
        lo=1, hi=100_000)
    runs_keep_days: float = _opt(
        90.0, "Days a finished run is kept (its output, errors and counts); older ones are "
        "deleted after each run of the job. 0: no age limit.", lo=0, hi=36500)


@dataclass(slots=True)
class DistributedSettings:
    hostfile: str = _opt(
        "", "MLX ring hostfile (JSON: one list of 'host:port' per machine, this one first) to "
        "serve one model across machines (docs/distributed.md). Empty: one machine.")
    control_port: int = _opt(
        40480, "TCP port on the first machine where the others join (appliance join).",
        lo=1, hi=65535)
    join_timeout: float = _opt(
        20.0, "Seconds the first machine waits for the others at start; then it serves "
        "alone if the model fits, else it exits 70 to be restarted.", lo=1.0, hi=3600.0)
    step_timeout: float = _opt(
        10.0, "Seconds a forward may wait in a ring operation, with no machine computing, "
        "before the group is declared lost (a machine that computes and beats is waited "
        "for).", lo=0.5, hi=3600.0)
    heartbeat_timeout: float = _opt(
        3.0, "Seconds without a word from a machine before it is declared lost.",
        lo=0.2, hi=600.0)
    memory_budget: int = _opt(
        0, "Bytes of this machine's memory the model's weights may take (0: what is "
        "available now, less 1 GiB); layers are split by these budgets.", lo=0)


@dataclass(slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    sched: SchedSettings = field(default_factory=SchedSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    jobs: JobsSettings = field(default_factory=JobsSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)

    @property
    def models_dir(self) -> Path:
        return Path(self.store.data_dir).expanduser() / "models"


SECTIONS: tuple[str, ...] = ("server", "engine", "sched", "store", "jobs", "distributed")


def iter_fields() -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Every leaf setting as (section, field), in documentation order."""
    for section in dataclasses.fields(Settings):
        for f in dataclasses.fields(_section_type(section.name)):
            yield section.name, f


def _section_type(name: str) -> type:
    return {"server": ServerSettings, "engine": EngineSettings, "sched": SchedSettings,
            "store": StoreSettings, "jobs": JobsSettings,
            "distributed": DistributedSettings}[name]


def flag_name(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field[Any]) -> str:
    return ENV_PREFIX + f.name.upper()


def _field_type(f: dataclasses.Field[Any]) -> type:
    return type(f.default)


def _coerce(f: dataclasses.Field[Any], raw: Any, origin: str) -> Any:
    kind = _field_type(f)
    try:
        if kind is bool:
            if isinstance(raw, bool):
                value: Any = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError(raw)
        elif kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            value = int(raw)
        elif kind is float:
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{origin}: {f.name} must be {kind.__name__}, got {raw!r}") from None
    meta = f.metadata
    if meta.get("lo") is not None and value < meta["lo"]:
        raise ValueError(f"{origin}: {f.name} must be >= {meta['lo']}, got {value}")
    if meta.get("hi") is not None and value > meta["hi"]:
        raise ValueError(f"{origin}: {f.name} must be <= {meta['hi']}, got {value}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"{origin}: {f.name} must be one of {', '.join(meta['choices'])}, "
                         f"got {value!r}")
    return value


def add_flags(parser: argparse.ArgumentParser, sections: Sequence[str] | None = None,
              suppress: bool = False) -> None:
    """Add one flag per setting (of ``sections``, default all); unset flags stay None so
    lower layers show through. ``suppress``: unset flags leave no attribute at all, for a
    subcommand's parser whose parent parser has the same flags (``appliance job add
    --url-allow ...`` as well as ``appliance job --url-allow ... add``)."""
    unset = argparse.SUPPRESS if suppress else None
    parser.add_argument("--config", type=Path, default=unset,
                        help=f"TOML config file (sections {', '.join(SECTIONS)}; default: "
                        f"{CONFIG_NAME} in the data folder, when there).")
    for section, f in iter_fields():
        if sections is not None and section not in sections:
            continue
        if _field_type(f) is bool:
            # --x and --no-x; a flag that is itself a negation (--no-batch) only sets True
            # (BooleanOptionalAction would read "--no-batch" as False)
            if flag_name(f).startswith("--no-"):
                parser.add_argument(flag_name(f), dest=f.name, default=unset,
                                    action="store_const", const=True, help=f.metadata["help"])
            else:
                parser.add_argument(flag_name(f), dest=f.name, default=unset,
                                    action=argparse.BooleanOptionalAction,
                                    help=f.metadata["help"])
        else:
            parser.add_argument(flag_name(f), dest=f.name, default=unset,
                                help=f"{f.metadata['help']} (default: {f.default!r}; "
                                f"[{section}] {f.name} / {env_name(f)})")


def load(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
         config_path: Path | None = None) -> Settings:
    """Build the settings tree once: defaults < TOML < environment < flags."""
    env = os.environ if env is None else env
    if config_path is None and args is not None:
        config_path = getattr(args, "config", None)
    if config_path is None and env.get(ENV_PREFIX + "CONFIG"):
        config_path = Path(env[ENV_PREFIX + "CONFIG"])
    if config_path is None:
        config_path = _default_config(args, env)
    toml: dict[str, Any] = {}
    if config_path is not None:
        with open(config_path, "rb") as fh:
            toml = tomllib.load(fh)
        unknown = set(toml) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{config_path}: unknown sections {sorted(unknown)}")
    settings = Settings()
    for section, f in iter_fields():
        target = getattr(settings, section)
        table = toml.get(section, {})
        if f.name in table:
            setattr(target, f.name, _coerce(f, table[f.name], str(config_path)))
        if env_name(f) in env:
            setattr(target, f.name, _coerce(f, env[env_name(f)], env_name(f)))
        if args is not None and getattr(args, f.name, None) is not None:
            setattr(target, f.name, _coerce(f, getattr(args, f.name), flag_name(f)))
    for section in SECTIONS:
        known = {f.name for s, f in iter_fields() if s == section}
        extra = set(toml.get(section, {})) - known
        if extra:
            raise ValueError(f"{config_path}: unknown settings in [{section}]: {sorted(extra)}")
    parse_bytes(settings.engine.kv_cache_budget)  # fail at start-up, not at first use
    if settings.engine.no_batch:
        settings.engine.max_batch_size = 1
    return settings


def _default_config(args: argparse.Namespace | None, env: Mapping[str, str]) -> Path | None:
    """``appliance.toml`` in the data folder (from the flag, the environment or the
    platform's default), when it exists."""
    data_dir = getattr(args, "data_dir", None) if args is not None else None
    data_dir = data_dir or env.get(ENV_PREFIX + "DATA_DIR") or default_data_dir()
    path = Path(data_dir).expanduser() / CONFIG_NAME
    return path if path.is_file() else None


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(value: str) -> int | str | None:
    """'auto' -> 'auto', 'none' -> None, '512M' -> 536870912; anything else is a ValueError."""
    text = value.strip().upper().removesuffix("B")
    if text in ("AUTO", "NONE"):
        return "auto" if text == "AUTO" else None
    unit = text[-1:] if text[-1:] in _UNITS and not text[-1:].isdigit() else ""
    number = text[: len(text) - len(unit)]
    try:
        amount = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"kv_cache_budget must be bytes (e.g. 2G), 'auto' or 'none', got "
                         f"{value!r}") from None
    if amount < 1:
        raise ValueError(f"kv_cache_budget must be positive, got {value!r}")
    return int(amount)
