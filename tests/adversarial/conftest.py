"""A live daemon for the adversarial suite, started through ``appliance serve``.

``APPLIANCE_ADVERSARIAL=ci`` (default) keeps every count small enough for CI on two cores;
``APPLIANCE_ADVERSARIAL=long`` is the run recorded in docs/RELIABILITY.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, cli, make_household, start_daemon


@dataclass(frozen=True)
class Scale:
    cases_per_operation: int
    flood_clients: int
    storm_clients: int
    idle_connections: int


SCALES = {
    "ci": Scale(cases_per_operation=4, flood_clients=16, storm_clients=12,
                idle_connections=600),
    "long": Scale(cases_per_operation=100, flood_clients=150, storm_clients=150,
                  idle_connections=2100),
}


def scale() -> Scale:
    chosen = SCALES[os.environ.get("APPLIANCE_ADVERSARIAL", "ci")]
    cases = os.environ.get("APPLIANCE_ADVERSARIAL_CASES")  # per operation, mode and caller
    if cases:
        chosen = dataclasses.replace(chosen, cases_per_operation=int(cases))
    return chosen


@dataclass
class Live:
    daemon: Daemon
    keys: dict[str, str]

    @property
    def url(self) -> str:
        return self.daemon.url

    def client(self, who: str, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120,  # type: ignore[arg-type]
                            headers={"Authorization": f"Bearer {self.keys[who]}"}, **kw)

    def fresh_key(self, name: str) -> str:
        """A new member and key through the CLI (unaffected by what the fuzzer changed)."""
        cli(self.daemon.data_dir, "user", "add", name, "--password-stdin",
            stdin="correct horse battery\n")
        return cli(self.daemon.data_dir, "key", "create", name).strip().splitlines()[-1]


def daemon_flags() -> tuple[str, ...]:
    """Short queue and contexts (generated requests stay cheap); in CI a small connection
    cap and header timeout (600 idle connections go past it), in the long run the defaults
    (cap 1,000, header timeout 10 s) against 2,100."""
    flags = ("--max-batch-size", "4", "--max-queue-depth", "8", "--ctx-size", "256",
             "--default-max-tokens", "8")
    if scale().idle_connections <= 1000:
        flags += ("--header-timeout", "2", "--max-connections", "200")
    return flags


@pytest.fixture(scope="session")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """One daemon for the whole suite (each test makes its own users where it matters)."""
    data_dir = tmp_path_factory.mktemp("adversarial")
    keys = make_household(data_dir)
    daemon = start_daemon(tiny_model, data_dir, *daemon_flags())
    try:
        yield Live(daemon, keys)
    finally:
        if daemon.proc.poll() is None:
            assert daemon.terminate(120) == 0


def normal_chat(live: Live, key: str) -> str:
    with httpx.Client(base_url=live.url, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])


def assert_error_shape(r: httpx.Response) -> None:
    """Every error is ``{"error": {"message", "type", ...}}``."""
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert isinstance(body["error"], dict) and {"message", "type"} <= set(body["error"]), body


def assert_acceptable(r: httpx.Response) -> None:
    """No 5xx but 503 with Retry-After; errors in the documented shape."""
    if r.status_code >= 500:
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, (
            r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert_error_shape(r)
