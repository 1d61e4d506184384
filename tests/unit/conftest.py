"""tests/unit stays pure: no MLX, no tokenizer, no subprocess (those tests belong in
tests/engine or tests/integration).

While a unit test module is collected and while a unit test runs, importing ``mlx``,
``mlx_lm``, ``tokenizers`` or ``transformers`` raises, and so does starting a process. An
import is only seen when the module is not loaded yet, which holds when tests/unit runs
alone; tests/integration/test_unit_purity.py collects tests/unit in a fresh interpreter so
that the whole suite checks it too.
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

FORBIDDEN = ("mlx", "mlx_lm", "tokenizers", "transformers")
HERE = Path(__file__).resolve().parent


class ImpureTest(RuntimeError):
    """A unit test reached for MLX, a tokenizer or a process."""


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> None:
        if name.split(".")[0] in FORBIDDEN:
            raise ImpureTest(f"tests/unit imports {name}: move the test to tests/engine "
                             "or tests/integration")
        return None


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise ImpureTest(f"tests/unit starts a process ({what}): move the test to "
                         "tests/integration")
    return refuse


@contextmanager
def _pure() -> Iterator[None]:
    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
        for name in ("system", "posix_spawn", "posix_spawnp", "fork", "forkpty"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse(f"os.{name}"))
        try:
            yield
        finally:
            sys.meta_path.remove(blocker)


def _ours(path: Path | None) -> bool:
    return path is not None and HERE in Path(path).resolve().parents


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A unit test module's imports run while it is collected."""
    if not (isinstance(collector, pytest.Module) and _ours(collector.path)):
        yield
        return
    with _pure():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _ours(item.path):
        yield
        return
    with _pure():
        yield
