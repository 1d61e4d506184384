"""Provisioning for the benchmarks that run ``appliance serve`` as a child process: a
throwaway data directory with the benchmark's users and their API keys, made by the
``appliance`` admin commands themselves (``migrate``, ``user add``, ``key create``), so a
benchmark never writes into the household's real database.

``python -m bench.serve`` makes one ``bench`` user; ``python -m bench.fairness`` its
personas (heavy, light, background, voice); the voice benchmark a Home Assistant user.
Benchmarks that serve the daemon in their own process (``build_daemon``) add their users
with :func:`add_users` instead.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.vocab import Klass

if TYPE_CHECKING:
    from appliance.store.db import Store

DATA_DIR_ENV = "APPLIANCE_DATA_DIR"


@dataclass(frozen=True, slots=True)
class BenchUser:
    """One user the benchmark makes, with one API key."""

    name: str
    role: str = "member"
    max_class: Klass = Klass.INTERACTIVE
    key_name: str = "bench"
    default_class: Klass | None = None
    """The key's class for requests that ask for none (None: the key's maximum)."""
    weight: float | None = None
    """Fair-share weight (None: the default, 1)."""


def admin_steps(users: Sequence[BenchUser]) -> list[tuple[list[str], str | None]]:
    """The ``appliance`` commands (and their stdin) that make the users and their keys."""
    steps: list[tuple[list[str], str | None]] = [(["migrate"], None)]
    for u in users:
        add = ["user", "add", u.name, "--role", u.role, "--max-class", u.max_class.label]
        if u.weight is not None:
            add += ["--weight", f"{u.weight:g}"]
        steps.append(([*add, "--password-stdin"], secrets.token_urlsafe(18) + "\n"))
        key = ["key", "create", u.name, "--name", u.key_name]
        if u.default_class is not None:
            key += ["--default-class", u.default_class.label]
        steps.append((key, None))
    return steps


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def provision(data_dir: Path, users: Sequence[BenchUser], env: Mapping[str, str]
              ) -> dict[str, str]:
    """A fresh ``data_dir`` (anything there is removed) with ``users``; returns each user's
    API key by name. ``env`` is the environment of the server that will use it (BLAS,
    ``--our-env``); ``APPLIANCE_DATA_DIR`` is set to ``data_dir``. Raises RuntimeError when
    a command fails."""
    shutil.rmtree(data_dir, ignore_errors=True)
    run_env = {**env, DATA_DIR_ENV: str(data_dir)}
    keys: dict[str, str] = {}
    for argv, stdin in admin_steps(users):
        proc = subprocess.run([sys.executable, "-m", "appliance", *argv], env=run_env,
                              input=stdin, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"`appliance {' '.join(argv)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        if argv[0] == "key":
            key = last_line(proc.stdout)
            if not key or " " in key:
                raise RuntimeError(f"no API key in the output of `appliance key create`: "
                                   f"{proc.stdout!r}")
            keys[argv[2]] = key
    return keys


def add_users(store: Store, users: Sequence[BenchUser]) -> dict[str, str]:
    """The same users straight into the store of a daemon this process serves
    (``build_daemon`` + ``serve_in_thread``); returns each user's API key by name. Passwords
    are random and hashed cheaply: nobody signs in with them."""
    from argon2 import PasswordHasher

    from appliance.store import keys
    from appliance.store import users as store_users

    hasher = PasswordHasher(time_cost=1, memory_cost=1024)
    plain: dict[str, str] = {}
    with store.sessions.begin() as s:
        for u in users:
            user = store_users.create_user(s, u.name, secrets.token_urlsafe(18), role=u.role,
                                           max_class=u.max_class.label, hasher=hasher)
            plain[u.name] = keys.create_api_key(
                s, user, u.key_name, default_class=None if u.default_class is None
                else u.default_class.label)[1]
    return plain
