"""Each package's imports, the layers they form, and any import cycle (appliance/ and web/).

    python3 scripts/layers.py        # prints the table; exits 1 on a cycle or a layer breach

Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions (a
function-level import that closes a loop still ties the two modules together). Two rules,
with no exceptions list:

- no cycle, between modules or between packages (``appliance.api`` -> ``appliance.jobs``
  -> ``appliance.api`` is a cycle even when no single module closes it);
- imports only go down the layers (a package imports from its own layer or below);
- the scheduler imports nothing device-specific (PURE);
- the engine reaches the device only through its door (DOOR): ``appliance.backend.plug``
  and the package's shared facts, never a module behind it (cpu, quant, fast_ops, ...);
- the transports (TRANSPORTS) reach the engine only through the service's engine client
  (``appliance.service.engine_client``), never ``appliance.engine.core`` (ENGINE_INSIDE).

The layers, top to bottom (docs/architecture.md says why):

    entry      cli, cli_admin, cli_jobs, __main__, bench
    assembly   daemon
    app        app
    web        web (pages; may use the API's HTTP plumbing: auth, error shapes, SSE)
    api        api (OpenAI, Ollama, hooks, admin JSON)
    jobs       jobs (background summaries through the same service)
    service    service (transport-free: submission, checks, the generation handle,
               domain errors)
    distributed  distributed (one model across machines: the group, the plan, a
               follower's loop; the engine sees it only through protocols)
    engine     engine, models (model files: pull, import, list), gguf (GGUF import),
               demo (the demo-model builder)
    backend    backend (what is device-specific: BLAS preload, native kernels, malloc,
               fast ops, the cost profile)
    sched      sched (pure: imports no device-specific module at all, see PURE)
    store      store
    base       appliance (the version), settings, vocab (shared words), percentiles,
               httpserver, logfilter
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("appliance", "web")
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("appliance.cli", "appliance.cli_admin", "appliance.cli_jobs", "appliance.__main__",
               "appliance.bench")),
    ("assembly", ("appliance.daemon",)),
    ("app", ("appliance.app",)),
    ("web", ("web",)),
    ("api", ("appliance.api",)),
    ("jobs", ("appliance.jobs",)),
    ("service", ("appliance.service",)),
    ("distributed", ("appliance.distributed",)),
    ("engine", ("appliance.engine", "appliance.models", "appliance.gguf", "appliance.demo")),
    ("backend", ("appliance.backend",)),
    ("sched", ("appliance.sched",)),
    ("store", ("appliance.store",)),
    ("base", ("appliance", "appliance.settings", "appliance.vocab", "appliance.percentiles",
              "appliance.httpserver", "appliance.logfilter")),
)

PURE = ("appliance.sched",)
"""Packages that plan from numbers alone: they may import the standard library and the
layers below them, never a device's libraries (DEVICE) or anything else outside."""
DEVICE = ("mlx", "mlx_lm", "numpy", "ctypes", "appliance.backend")


DOOR = ("appliance.engine",)
"""Packages that reach the device only through the plug (docs/backends.md)."""
BEHIND_DOOR = "appliance.backend"
"""Every module under it but the plug is behind the door (the CPU accelerator, Metal, CUDA,
the native extensions); the package itself (the kind of backend, the facts every plug
shares) is not."""
THE_DOOR = "plug"


TRANSPORTS = ("appliance.api", "web", "appliance.jobs")
"""Packages that reach the engine only through the service (docs/architecture.md)."""
ENGINE_INSIDE = ("appliance.engine.core",)
"""What no transport imports: the engine itself (its ``Engine``, its refusals); the types a
transport handles are re-exported by ``appliance.service.engine_client``."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of appliance/ and web/ by dotted name."""
    out = {}
    for top in TOP:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(tree: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    """Every dotted name an import statement mentions (``from a import b`` gives a, a.b)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            for alias in node.names:
                yield f"{module}.{alias.name}"


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of appliance/ and web/ it imports."""
    mods = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        deps = {m for m in _imported(tree, name, path.name == "__init__.py") if m in mods}
        out[name] = deps - {name}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (Tarjan's
    strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """``appliance.engine.core`` -> ``appliance.engine``; ``web.live`` -> ``web``."""
    parts = module.split(".")
    if parts[0] == "web":
        return "web"
    return ".".join(parts[:2])


def layer_of(package: str) -> int:
    for rank, (_, members) in enumerate(LAYERS):
        if package in members:
            return rank
    raise KeyError(f"{package} is in no layer; add it to LAYERS in scripts/layers.py")


def packages(g: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in g.items():
        pkg = package_of(module)
        out.setdefault(pkg, set()).update(package_of(d) for d in deps)
        out[pkg].discard(pkg)
    return out


def package_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Groups of packages that import each other (:func:`cycles` over :func:`packages`):
    modules may avoid a loop one by one while their packages still form one."""
    return cycles(packages(g))


def breaches(g: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer (module -> module)."""
    return [f"{m} ({LAYERS[layer_of(package_of(m))][0]}) imports {d} "
            f"({LAYERS[layer_of(package_of(d))][0]})"
            for m, deps in sorted(g.items()) for d in sorted(deps)
            if layer_of(package_of(d)) < layer_of(package_of(m))]


def device_imports(root: Path = ROOT) -> list[str]:
    """Imports of a device's libraries (:data:`DEVICE`) by a module of a :data:`PURE`
    package: the scheduler knows a cost profile, never a kernel or MLX."""
    out = []
    for name, path in modules(root).items():
        if package_of(name) not in PURE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for dep in sorted(set(_imported(tree, name, path.name == "__init__.py"))):
            if any(dep == d or dep.startswith(d + ".") for d in DEVICE):
                out.append(f"{name} ({package_of(name)} is pure) imports {dep}")
    return out


def door_breaches(root: Path = ROOT) -> list[str]:
    """Imports of a module behind the door (:data:`BEHIND_DOOR`, not :data:`THE_DOOR`) by a
    module of a :data:`DOOR` package: the engine names no device module."""
    mods = modules(root)
    behind = {m.split(".")[2] for m in mods if m.startswith(BEHIND_DOOR + ".")} - {THE_DOOR}
    out = []
    for name, path in mods.items():
        if package_of(name) not in DOOR:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for dep in sorted(set(_imported(tree, name, path.name == "__init__.py"))):
            if not dep.startswith(BEHIND_DOOR + "."):
                continue
            first = dep.split(".")[2]  # a module, a name of the package, or an extension
            if first in behind or first.startswith("_"):
                out.append(f"{name} ({package_of(name)} goes through the plug) imports {dep}")
    return out


def transport_imports(g: dict[str, set[str]]) -> list[str]:
    """Imports of the engine's inside (:data:`ENGINE_INSIDE`) by a module of a
    :data:`TRANSPORTS` package (module -> module, as :func:`graph` found them)."""
    return [f"{m} (a transport) imports {d}: go through appliance.service.engine_client"
            for m, deps in sorted(g.items()) if package_of(m) in TRANSPORTS
            for d in sorted(deps) if d in ENGINE_INSIDE]


def main() -> int:
    g = graph()
    pkgs = packages(g)
    for name, members in LAYERS:
        print(f"{name}:")
        for pkg in members:
            if pkg in pkgs:
                print(f"  {pkg:22} -> {', '.join(sorted(pkgs[pkg])) or '-'}")
    problems = ([f"cycle: {' <-> '.join(c)}" for c in cycles(g)]
                + [f"package cycle: {' <-> '.join(c)}" for c in package_cycles(g)]
                + breaches(g) + device_imports() + door_breaches()
                + transport_imports(g))
    for line in problems:
        print(line)
    print(f"{len(g)} modules, {sum(len(d) for d in g.values())} imports, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
