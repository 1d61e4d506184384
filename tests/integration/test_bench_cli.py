"""`appliance bench` against a started `appliance serve`: the figures of each level, the
daemon found from the settings, and one clear line for each reason it cannot measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import DEMO, free_port
from tests.daemon import Daemon, make_household, start_daemon


@dataclass
class Household:
    daemon: Daemon
    key: str


@pytest.fixture(scope="module")
def household(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Household]:
    data = tmp_path_factory.mktemp("bench-daemon")
    keys = make_household(data)
    daemon = start_daemon(DEMO, data)
    try:
        yield Household(daemon, keys["bob"])
    finally:
        daemon.terminate()


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    return subprocess.run([sys.executable, "-m", "appliance", "bench", *args],
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


def test_it_reports_each_level_as_a_table_and_as_json(household: Household,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = bench("--url", household.daemon.url, "--api-key", household.key, "--concurrency",
                 "1,2", "--requests", "2", "--max-tokens", "6", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| C | requests | errors | tok/s | TTFT p50 ms | TTFT p95 ms |" in done.stdout
    assert "| 1 | 2 | 0 |" in done.stdout and "| 2 | 4 | 0 |" in done.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "demo_model" and report["url"] == household.daemon.url
    assert report["max_tokens"] == 6 and report["max_batch_size"] >= 2
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["errors"] == 0 and level["first_error"] is None
        assert 0 < level["output_tokens"] <= 6 * level["requests"]
        assert level["tokens_per_s"] > 0
        assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"] < level["wall_s"]
        assert level["itl_p50_s"] <= level["itl_p95_s"]


def test_it_finds_the_daemon_and_key_where_serve_reads_its_settings(
        household: Household) -> None:
    port = household.daemon.url.rsplit(":", 1)[1]
    done = bench("--concurrency", "1", "--requests", "1", "--max-tokens", "4", "--no-warmup",
                 env={"APPLIANCE_PORT": port, "APPLIANCE_API_KEY": household.key})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"demo_model at http://127.0.0.1:{port}" in done.stdout


def test_a_refused_key_says_how_to_get_one(household: Household) -> None:
    done = bench("--url", household.daemon.url, "--api-key", "not-a-key")
    assert done.returncode == 2
    assert "refused the API key (HTTP 401)" in done.stderr
    assert "appliance key create" in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_model_fails_before_any_level_runs(household: Household) -> None:
    done = bench("--url", household.daemon.url, "--api-key", household.key, "--model", "nope")
    assert done.returncode == 2
    assert "warm-up request failed: HTTP 404" in done.stderr and "| C |" not in done.stdout


def test_no_daemon_is_one_line_not_a_traceback() -> None:
    done = bench("--url", f"http://127.0.0.1:{free_port()}", "--api-key", "k")
    assert done.returncode == 2
    assert "no daemon answers at" in done.stderr and "appliance serve" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flag,value", [("--concurrency", "0,4"), ("--concurrency", "1,x"),
                                        ("--requests", "2,3"), ("--max-tokens", "0")])
def test_levels_and_counts_must_be_positive_integers(flag: str, value: str) -> None:
    done = bench(flag, value)
    assert done.returncode == 2
    assert f"argument {flag}: expected" in done.stderr
