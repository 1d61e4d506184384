"""`appliance bench`'s command line (no imports beyond argparse: every CLI call builds it)."""

from __future__ import annotations

import argparse
from pathlib import Path

API_KEY_ENV = "APPLIANCE_API_KEY"


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,8, got {text!r}")
    return values


def positive_int(text: str) -> int:
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="the daemon's address (default: http://127.0.0.1:PORT from the "
                   "settings, as `appliance serve` reads them)")
    p.add_argument("--api-key", default=None,
                   help=f"an API key (`appliance key create NAME`); default ${API_KEY_ENV}")
    p.add_argument("--model", default=None,
                   help="the model name to ask for (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 8],
                   help="concurrent clients per level (default: 1,4,8)")
    p.add_argument("--requests", type=positive_int, default=2,
                   help="requests each client sends per level (default: 2)")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="max_tokens of each request (default: 64)")
    p.add_argument("--prompt-words", type=int, default=0,
                   help="filler words after each question, for longer prompts (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take (default: 600)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the one unmeasured request before the first level")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the figures and what was measured as JSON")
