"""No import cycles inside appliance/ and web/, and imports only go down the layers
(scripts/layers.py prints the table: ``python3 scripts/layers.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("layers", module)
    spec.loader.exec_module(module)
    return module


def test_there_is_no_import_cycle_in_appliance_or_web() -> None:
    layers = _layers()
    assert layers.cycles(layers.graph()) == []


def test_no_two_packages_import_each_other() -> None:
    layers = _layers()
    assert layers.package_cycles(layers.graph()) == []


def test_every_import_goes_down_the_layers() -> None:
    layers = _layers()
    assert layers.breaches(layers.graph()) == []


def sched_tree(root: Path) -> Path:
    """An empty appliance/sched and web/ under ``root``; returns the sched folder."""
    pkg = root / "appliance" / "sched"
    pkg.mkdir(parents=True)
    (root / "web").mkdir()
    for folder in (root / "appliance", pkg, root / "web"):
        (folder / "__init__.py").write_text("")
    return pkg


def test_a_cycle_through_a_function_or_type_checking_import_is_found(tmp_path: Path) -> None:
    pkg = sched_tree(tmp_path)
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from appliance.sched.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from appliance.sched import a\n")
    (pkg / "d.py").write_text("from appliance.sched import a\n")
    layers = _layers()
    assert layers.cycles(layers.graph(tmp_path)) == [
        ["appliance.sched.a", "appliance.sched.b", "appliance.sched.c"]]


def test_packages_that_import_each_other_are_a_cycle_though_no_module_closes_one(
        tmp_path: Path) -> None:
    """api/a -> jobs/b and jobs/c -> api/d: no module is in a loop, the packages are."""
    for folder in ("appliance", "appliance/api", "appliance/jobs", "web"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "appliance" / "api" / "a.py").write_text("from appliance.jobs import b\n")
    (tmp_path / "appliance" / "jobs" / "b.py").write_text("")
    (tmp_path / "appliance" / "jobs" / "c.py").write_text("def f():\n    import appliance.api.d\n")
    (tmp_path / "appliance" / "api" / "d.py").write_text("")
    layers = _layers()
    g = layers.graph(tmp_path)
    assert layers.cycles(g) == []
    assert layers.package_cycles(g) == [["appliance.api", "appliance.jobs"]]


def test_an_import_up_a_layer_is_a_breach(tmp_path: Path) -> None:
    for folder in ("appliance", "appliance/store", "appliance/api", "web"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "appliance" / "api" / "x.py").write_text("")
    (tmp_path / "appliance" / "store" / "y.py").write_text("import appliance.api.x\n")
    layers = _layers()
    assert layers.breaches(layers.graph(tmp_path)) == [
        "appliance.store.y (store) imports appliance.api.x (api)"]


def test_the_scheduler_and_cost_model_import_nothing_device_specific() -> None:
    """sched/ plans from a cost profile; MLX, numpy, ctypes and appliance.backend stay out."""
    assert _layers().device_imports() == []


def test_a_device_import_in_the_scheduler_is_found(tmp_path: Path) -> None:
    pkg = sched_tree(tmp_path)
    (pkg / "cost.py").write_text("def f():\n    import mlx.core as mx\n")
    (pkg / "fine.py").write_text("import math\n")
    assert _layers().device_imports(tmp_path) == [
        "appliance.sched.cost (appliance.sched is pure) imports mlx.core"]


def test_the_engine_reaches_the_device_only_through_the_plug() -> None:
    assert _layers().door_breaches() == []


def test_an_engine_import_of_a_module_behind_the_door_is_found(tmp_path: Path) -> None:
    """The plug and the package's shared facts pass; a CPU module or an extension does not,
    however it is imported (module level, a function, ``from ... import``)."""
    for folder in ("appliance", "appliance/engine", "appliance/backend", "web"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for name in ("plug", "quant", "cpu"):
        (tmp_path / "appliance" / "backend" / f"{name}.py").write_text("")
    engine = tmp_path / "appliance" / "engine"
    (engine / "fine.py").write_text("from appliance.backend import Backend, plug\n"
                                    "from appliance.backend.plug import Plug\n")
    (engine / "mixed.py").write_text("from appliance.backend import plug, quant\n")
    (engine / "model.py").write_text("def f():\n    import appliance.backend.cpu\n")
    (engine / "native.py").write_text("from appliance.backend import _mlx_fast\n")
    assert _layers().door_breaches(tmp_path) == [
        "appliance.engine.mixed (appliance.engine goes through the plug) imports "
        "appliance.backend.quant",
        "appliance.engine.model (appliance.engine goes through the plug) imports "
        "appliance.backend.cpu",
        "appliance.engine.native (appliance.engine goes through the plug) imports "
        "appliance.backend._mlx_fast"]


def test_no_transport_imports_the_engine_core() -> None:
    layers = _layers()
    assert layers.transport_imports(layers.graph()) == []


def test_a_transport_importing_the_engine_core_is_found(tmp_path: Path) -> None:
    """api/, web/ and jobs/ go through the service's engine client; the service may not."""
    for folder in ("appliance", "appliance/engine", "appliance/api", "appliance/jobs",
                   "appliance/service", "web"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "appliance" / "engine" / "core.py").write_text("")
    (tmp_path / "appliance" / "service" / "engine_client.py").write_text(
        "from appliance.engine.core import EngineDown\n")
    (tmp_path / "appliance" / "api" / "fine.py").write_text(
        "from appliance.service.engine_client import EngineDown\n")
    (tmp_path / "appliance" / "api" / "admin.py").write_text(
        "from appliance.engine.core import EngineDown\n")
    (tmp_path / "appliance" / "jobs" / "run.py").write_text(
        "def f():\n    from appliance.engine import core\n")
    (tmp_path / "web" / "live.py").write_text("import appliance.engine.core\n")
    layers = _layers()
    assert layers.transport_imports(layers.graph(tmp_path)) == [
        f"{m} (a transport) imports appliance.engine.core: go through "
        "appliance.service.engine_client"
        for m in ("appliance.api.admin", "appliance.jobs.run", "web.live")]
