"""Prompt lookup through a started `appliance serve` on the real SmolLM2 (4-bit: its plain
step is the fused decode layer, its verify the chunk forward): asked to repeat a text, the
answer is the same with drafts as without, and /metrics counts the drafts kept. A verify
costs SmolLM2 some 2.5 plain steps on a CPU, past the default tick objective (2 steps):
both daemons get `--itl-factor 4`, which lets drafts through."""

from __future__ import annotations

import re
from pathlib import Path

from tests.daemon import make_household, start_daemon

TEXT = ("The lamp in the hall turns on at seven. The heating goes down at ten. "
        "The blinds in the kitchen open at eight, and the garden lights stay off.")


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
