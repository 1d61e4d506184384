"""Megabyte prompts against the real daemon (``appliance serve`` as a process).

Issue 37, item 7: a 5 MB prompt was templated and tokenised on the event loop before the
context check; four at once came back (a correct 400) after 3 to 11 s, and ``/health``
took 2.7 s meanwhile. Now a prompt whose characters cannot fit the context whatever the
tokenizer does is refused before any templating (the refusal names characters, not
tokens), and templating and tokenising run on worker threads, so ``/health`` keeps
answering while a long prompt is tokenised.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, make_household, start_daemon
from tests.helpers import wait_until

CTX = 150_000


@dataclass
class Live:
    daemon: Daemon
    key: str
    longest: int
    """The most characters one token of the model's vocabulary stands for."""


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("big-prompts")
    keys = make_household(data_dir)
    vocab = json.loads((tiny_model / "tokenizer.json").read_text())["model"]["vocab"]
    longest = max(len(t) for t in vocab)
    d = start_daemon(tiny_model, data_dir, "--ctx-size", str(CTX))
    try:
        yield Live(d, keys["bob"], longest)
    finally:
        if d.proc.poll() is None:
            assert d.terminate(120) == 0


def words(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["kitchen", "lights", "the", "turn", "off", "please", "and", "bob", "éclair"]
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(vocab)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass
class HealthPoller:
    """``GET /health`` back to back on its own connection; when each was answered."""

    url: str
    answered: list[float] = field(default_factory=list)
    worst_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                sent = time.monotonic()
                assert c.get("/health").status_code == 200
                now = time.monotonic()
                self.worst_s = max(self.worst_s, now - sent)
                self.answered.append(now)

    def __enter__(self) -> HealthPoller:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def chat(live: Live, text: str) -> tuple[httpx.Response, float]:
    with httpx.Client(base_url=live.daemon.url, timeout=300,
                      headers={"Authorization": f"Bearer {live.key}"}) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 4})
        return r, time.monotonic()


def test_megabyte_prompts_are_refused_before_they_are_tokenised(live: Live) -> None:
    chars = 5_000_000
    assert chars // live.longest >= 2 * CTX  # surely too long, whatever the tokenizer does
    texts = [words(chars, seed) for seed in range(4)]
    with HealthPoller(live.daemon.url) as health, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda t: chat(live, t)[0], texts))
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        # the refusal counts characters: nothing was templated or tokenised
        assert "characters, at least" in err["message"], err["message"]
    assert health.answered
    # the other entry points refuse before tokenising too
    auth = {"Authorization": f"Bearer {live.key}"}
    with httpx.Client(base_url=live.daemon.url, timeout=300, headers=auth) as c:
        r = c.post("/v1/completions", json={"prompt": texts[0], "max_tokens": 4})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        model = c.get("/api/tags").json()["models"][0]["name"]
        r = c.post("/api/chat", json={"model": model, "stream": False,
                                      "messages": [{"role": "user", "content": texts[1]}]})
        assert r.status_code == 400 and "characters" in r.json()["error"]
        r = c.post("/api/generate", json={"model": model, "prompt": texts[2], "stream": False})
        assert r.status_code == 400 and "characters" in r.json()["error"]


def test_health_answers_while_a_long_prompt_is_tokenised(live: Live) -> None:
    """A prompt the cheap bound lets through (at least CTX / 2 tokens by its characters)
    but the tokenizer finds too long: it is tokenised on a worker thread, so /health is
    answered throughout (on the event loop it waited for the whole tokenisation)."""
    text = words(CTX * live.longest // 2, seed=7)
    with HealthPoller(live.daemon.url) as health:
        wait_until(lambda: bool(health.answered), 60, "a first /health")
        started = time.monotonic()
        r, done = chat(live, text)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "tokens, which leaves" in err["message"]
    # the longest stretch without a /health answer while the prompt was pending: on the
    # event loop that was the whole tokenisation (most of the request's time)
    marks = [started, *(t for t in health.answered if started < t < done), done]
    longest_gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    assert longest_gap < (done - started) / 3, (longest_gap, done - started, len(marks))
