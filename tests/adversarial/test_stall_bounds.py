"""No member can stall the house (issue 52, items 6-9 and 14) against a live daemon.

- D13: a 52 KB PDF whose 300 pages share one content stream of 200,000 operators is read
  in a process of its own under a time limit, cut off with a plain reason, killed when
  its uploader leaves, and never holds the threads that prepare everyone's prompts;
- D15/D16: every text field (system messages, tools, the voice hook's ``system`` and
  ``language``) counts in the cheap size bound, before any templating;
- D17: a chat template from a model file runs under a bound of steps, time and output
  (a loop that does not end is a 400 while ``/health`` answers), and a model whose
  template loops on every conversation is refused by ``appliance serve`` with the reason;
- D18: the voice hook folds its instructions into the first user turn for a template that
  refuses a system turn, and answers a template's refusal with a 400 in words.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.adversarial.test_big_prompts import HealthPoller
from tests.browser.support import browser
from tests.daemon import start_daemon
from tests.helpers import LiveServer, live_server, make_settings, wait_until
from tests.pdfs import stalling_pdf, text_pdf

STRICT = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if 'REFUSE' in m['content'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{%- if 'SPIN' in m['content'] %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Gemma 2's refusal of a system turn, a refusal on demand (REFUSE) and a loop of 10¹⁰
steps on demand (SPIN)."""
LOOPING = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{{ messages[0]['content'] }}")
BIG = 1_000_000


def _with_template(model: Path, target: Path, template: str) -> Path:
    shutil.copytree(model, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = _with_template(tiny_model, tmp_path_factory.mktemp("strict") / "m", STRICT)
    with live_server(make_settings(model, ctx_size=4096, pdf_read_seconds=3.0)) as s:
        yield s


def _post(server: LiveServer, path: str, body: dict[str, Any], timeout: float = 120
          ) -> httpx.Response:
    with server.client("bob") as c:
        return c.post(path, json=body, timeout=timeout)


def _chat(server: LiveServer, timeout: float = 60) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}, timeout)


# ---- D15 / D16: every text field counts before templating ----

def test_huge_system_messages_tools_and_voice_fields_are_refused_before_templating(
        server: LiveServer) -> None:
    words = "lights off please " * (BIG // 18)
    with server.client("bob") as c:
        model = c.get("/api/tags").json()["models"][0]["name"]
    asks = [("/v1/chat/completions", {"messages": [{"role": "system", "content": words},
                                                   {"role": "user", "content": "hi"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "tools": [{"type": "function", "function": {
                                          "name": "f", "description": words}}]}),
            ("/api/chat", {"model": model, "stream": False, "messages": [
                {"role": "system", "content": words}, {"role": "user", "content": "hi"}]}),
            ("/api/generate", {"model": model, "stream": False, "prompt": "hi",
                               "system": words})]
    with HealthPoller(server.url) as health, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda a: _post(server, *a), asks))
    for (path, _), r in zip(asks, answers, strict=True):
        assert r.status_code == 400, (path, r.text[:300])
        said = r.json()["error"]
        said = said["message"] if isinstance(said, dict) else said
        # counted in characters: nothing was templated or tokenised
        assert "characters, at least" in said, (path, said)
    assert health.answered
    voice = {"text": "hello", "max_tokens": 2}
    r = _post(server, "/hooks/voice", {**voice, "system": words})
    assert r.status_code == 400 and r.json()["error"]["param"] == "system", r.text[:300]
    assert "limited to 8000 characters" in r.json()["error"]["message"]
    r = _post(server, "/hooks/voice", {**voice, "language": "x" * 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "language", r.text[:300]


# ---- D17: templates bounded at request time and at load ----

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/hooks/voice"])
def test_a_template_that_loops_is_stopped_with_a_400_while_health_answers(
        server: LiveServer, path: str) -> None:
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "SPIN now"}]}
                            if path.startswith("/v1") else {"text": "SPIN now"})
    with HealthPoller(server.url) as health:
        wait_until(lambda: bool(health.answered), 60, "a first /health")
        started = time.monotonic()
        r = _post(server, path, {**body, "max_tokens": 2})
        done = time.monotonic()
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "template_overrun", err
    # stopped by its step count, or by its time on a loaded machine
    assert "so it was stopped" in err["message"], err
    # rendered off the event loop: /health was answered throughout
    marks = [started, *(t for t in health.answered if started < t < done), done]
    longest_gap = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    assert longest_gap < (done - started) / 3, (longest_gap, done - started, len(marks))
    assert _chat(server).status_code == 200  # and the daemon serves on


def test_a_model_whose_template_loops_is_refused_at_start_with_the_reason(
        tiny_model: Path, tmp_path: Path) -> None:
    model = _with_template(tiny_model, tmp_path / "looping", LOOPING)
    d = start_daemon(model, tmp_path, wait=False)
    try:
        code = d.proc.wait(timeout=180)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    log = d.log.read_text()
    assert code == 65, log[-2000:]
    assert "cannot be served: the model's chat template ran more than 200,000 steps" in log
    assert "Traceback" not in log, log[-2000:]


# ---- D18: the voice hook and a template that refuses ----

def test_the_voice_hook_folds_its_instructions_for_a_template_without_a_system_turn(
        server: LiveServer) -> None:
    r = _post(server, "/hooks/voice", {"text": "turn on the light", "max_tokens": 3,
                                       "language": "de"})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["usage"]["prompt_tokens"] > 20  # the instructions went in


def test_the_voice_hook_answers_a_template_refusal_with_a_400_in_words(
        server: LiveServer) -> None:
    r = _post(server, "/hooks/voice", {"text": "REFUSE this", "max_tokens": 3})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert "chat template rejected these messages" in err["message"], err
    assert "roles must alternate" in err["message"], err
    assert "Traceback" not in r.text


# ---- D13: PDFs read in a process of their own ----

def _readers() -> list[psutil.Process]:
    """The PDF reading processes still alive (a killed one not yet reaped is not)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.status() != psutil.STATUS_ZOMBIE
                    and "web.pdftext" in " ".join(p.cmdline())):
                found.append(p)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _upload(url: str, data: bytes, timeout: float = 120) -> httpx.Response:
    with browser(url, "bob") as c:
        return c.post("/chat/attachments", timeout=timeout,
                      files={"file": ("slow.pdf", data, "application/pdf")})


def test_stalling_pdfs_are_cut_off_with_a_reason_and_chats_go_on(server: LiveServer) -> None:
    slow = stalling_pdf()
    assert len(slow) < 60_000
    with ThreadPoolExecutor(4) as pool:
        uploads = [pool.submit(_upload, server.url, slow) for _ in range(4)]
        wait_until(lambda: bool(_readers()), 60, "a PDF being read")
        # four slow PDFs in flight: a chat's prompt is still prepared and answered
        assert _chat(server, timeout=60).status_code == 200
        answers = [u.result() for u in uploads]
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        assert "took longer than 3 s, so it was stopped" in r.text, r.text[:300]
    wait_until(lambda: not _readers(), 30, "the reading processes gone")
    server.services.pdf_read_seconds = 120.0  # a loaded test machine starts Python slowly
    try:
        with browser(server.url, "bob") as c:  # an ordinary PDF is still read
            r = c.post("/chat/attachments",
                       files={"file": ("ok.pdf", text_pdf([["Hello"]]), "application/pdf")})
            assert r.status_code == 200 and r.json()["text"] == "Hello", r.text[:300]
    finally:
        server.services.pdf_read_seconds = 3.0


def test_a_pdf_whose_uploader_leaves_stops_being_read(server: LiveServer) -> None:
    services = server.services
    services.pdf_read_seconds = 600.0  # only the leaving can stop it now
    try:
        with browser(server.url, "bob") as c:
            request = c.build_request("POST", "/chat/attachments", files={
                "file": ("slow.pdf", stalling_pdf(), "application/pdf")})
            head = [f"POST {request.url.raw_path.decode()} HTTP/1.1",
                    *(f"{k}: {v}" for k, v in request.headers.items())]
            raw = ("\r\n".join(head) + "\r\n\r\n").encode() + request.read()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(raw)
            wait_until(lambda: bool(_readers()), 60, "the PDF being read")
        # the uploader left: its reading process goes with it
        wait_until(lambda: not _readers(), 20, "the reading process killed")
    finally:
        services.pdf_read_seconds = 3.0
