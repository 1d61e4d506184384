"""Prompt lookup through a started `appliance serve` on the real SmolLM2 (4-bit: its plain
step and its verify are each the fused decode layer): asked to repeat a text, alone and two
members at once (their rows verify together), the answers are the same with drafts as
without, and /metrics counts the drafts kept. Both daemons get `--itl-factor 4`, so that
drafts go through however the machine's first verifies were timed."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.daemon import make_household, start_daemon

TEXT = ("The lamp in the hall turns on at seven. The heating goes down at ten. "
        "The blinds in the kitchen open at eight, and the garden lights stay off.")
OTHER = ("Water the tomatoes on Monday and Thursday. Feed the cat at six. "
         "The bins go out on Tuesday night, the recycling every other week.")


def _answers(model: Path, data_dir: Path, *flags: str) -> tuple[list[str], dict[str, float]]:
    keys = make_household(data_dir)
    d = start_daemon(model, data_dir, *flags)
    try:
        with d.client(keys["bob"]) as c:
            answers = []
            for body in ({"temperature": 0}, {"temperature": 0.9, "seed": 4}):
                r = c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content":
                                  f"Repeat this text exactly:\n\n{TEXT}"}],
                    "max_tokens": 64, **body})
                assert r.status_code == 200, r.text
                answers.append(r.json()["choices"][0]["message"]["content"])

        def ask(key: str, text: str) -> str:
            with d.client(key) as c:
                r = c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                    "max_tokens": 64, "temperature": 0})
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["message"]["content"])

        with ThreadPoolExecutor(2) as pool:  # two members at once: rows decoding together
            answers += list(pool.map(ask, [keys["bob"], keys["alice"]], [TEXT, OTHER]))
        with d.client(keys["alice"]) as admin:
            metrics = admin.get("/metrics").text
    finally:
        assert d.terminate() == 0
    found = dict(re.findall(r"^(appliance_engine_draft_tokens\w*) (\S+)$", metrics, re.M))
    return answers, {k: float(v) for k, v in found.items()}


def test_a_repeated_text_is_the_same_answer_with_drafts_and_the_drafts_are_counted(
        smollm2: Path, tmp_path: Path) -> None:
    plain, none = _answers(smollm2, tmp_path / "plain", "--draft-tokens", "0",
                           "--itl-factor", "4")
    drafted, counted = _answers(smollm2, tmp_path / "drafted", "--itl-factor", "4")
    assert none["appliance_engine_draft_tokens_total"] == 0
    assert counted["appliance_engine_draft_tokens_kept_total"] > 0
    assert counted["appliance_engine_draft_tokens_total"] >= \
        counted["appliance_engine_draft_tokens_kept_total"]
    assert "lamp in the hall" in plain[0], "SmolLM2 should repeat the text"
    assert drafted == plain
