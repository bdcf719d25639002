"""The package's layers, read from its source (every import statement, at module level or inside a function): no
import cycle, and no import that points up the layers (docs/architecture.md)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gds_gather"

# the rank of each top-level name: a module may import its own rank and those below it
RANK = {"config": 0, "errors": 0, "units": 0, "planner": 0, "platform": 0,
        "formats": 1, "io": 2, "cache": 3, "backends": 4, "gpu": 5, "table": 6, "model": 6, "prefill": 7,
        "integrations": 8, "cli": 9, "benches": 9, "hf": 9}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        if "kernels" in f.relative_to(PKG).parts:
            continue
        parts = ("gds_gather", *f.relative_to(PKG).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in names:
                if t in mods and t != m and not m.startswith(t + "."):   # (a package's own __init__ runs first)
                    graph[m].add(t)
    return graph


def _rank(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_every_top_level_name_has_a_layer():
    tops = {m.split(".")[1] for m in _modules() if "." in m}
    assert tops <= set(RANK), sorted(tops - set(RANK))


def test_no_import_points_up_the_layers():
    up = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
          if _rank(m) is not None and _rank(t) is not None and _rank(t) > _rank(m)]
    assert up == []


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
