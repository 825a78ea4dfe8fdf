"""The house's measures (docs/architecture.md): no import circle, no import from a lower room to
a higher one, no module importing another module's private names, no room over 900 lines.

Imports are read from the source (module level and inside functions alike), so the test needs
no JAX and runs in well under a second.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 900

# The rooms from the bottom up: a module imports only from its own layer or the ones below.
# Every module of sowtel/ and exporters/ has a place here, so a new one must be given one.
LAYERS: list[set[str]] = [
    # the record type, JAX's privates, exit hooks, the dump file format, the exporters' face,
    # the dashboards (data)
    {"records", "_exit", "_jax_compat", "_jax_compat._frames", "_jax_compat._jaxprs",
     "_jax_compat._lowering", "dumps._format", "dispatcher._ledger", "exporters",
     "exporters._tensorboard_events", "exporters._tensorboard_order",
     "exporters._tensorboard_layout", "exporters.otel._providers", "dashboards", "errors"},
    # rules over names and reductions; the plugin's reading of runs
    {"naming", "_reductions", "alerts", "tensorboard_plugin._run", "exporters.otel._metrics"},
    {"summaries", "tensorboard_plugin"},
    {"multihost", "sites", "dashboard", "exporters._tracker", "exporters.console"},
    {"context"},
    {"steps"},
    {"primitive"},  # sow, sow_p and its rules
    {"intermediates", "_interpret_rules", "_module_sites", "optax", "flax",
     "exporters.mlflow", "exporters.wandb", "exporters.trackio"},
    {"to_records", "_interpret", "dumps._write"},  # records; THE evaluator
    {"capture", "_cond_rows", "dispatcher._worker", "exporters.jsonl", "exporters.memory",
     "exporters.tensorboard", "exporters.otel"},
    {"locate", "tap", "dispatcher", "dumps._read"},
    {"receiver", "dumps._parts", "_run_read"},
    {"dumps"},
    {"postmortem", "compare"},
    {"nonfinite"},
    {"session"},
    {"jit"},
    {"nnx", "equinox"},
    {"sowtel", "cli", "demo", "__main__"},  # the face and the tools
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for base, prefix in (("sowtel", ""), ("exporters", "exporters.")):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT / base)
            if rel.parts[0] in ("exporters", "dashboards") and base == "sowtel":
                continue  # installed copies (sowtel.exporters is exporters/)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = prefix + ".".join(parts) if parts else (prefix.rstrip(".") or "sowtel")
            found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, names: set[str]) -> list[tuple[str, str, int]]:
    """(module imported, name imported or "", line) for each import of a sowtel module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = (("sowtel." + package) if not package.startswith("sowtel") else package)
                parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "sowtel" and not target.startswith("sowtel."):
                continue
            short = _short(target)
            for alias in node.names:
                sub = f"{short}.{alias.name}" if short != "sowtel" else alias.name
                if sub in names:
                    out.append((sub, "", node.lineno))
                else:
                    out.append((short, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sowtel" or alias.name.startswith("sowtel."):
                    out.append((_short(alias.name), "", node.lineno))
    return out


def _short(module: str) -> str:
    return "sowtel" if module == "sowtel" else module.removeprefix("sowtel.")


def _graph() -> tuple[dict[str, pathlib.Path], dict[str, list[tuple[str, str, int]]]]:
    modules = {_short(k) if k.startswith("sowtel") else k: v for k, v in _modules().items()}
    return modules, {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    modules, edges = _graph()
    layer = {m: i for i, rooms in enumerate(LAYERS) for m in rooms}
    assert set(modules) - set(layer) == set(), "modules without a layer in LAYERS"
    upward = [(m, t, line) for m, targets in edges.items() for t, _, line in targets
              if t in layer and t != m and layer[t] > layer[m]]
    assert upward == [], "imports from a lower room to a higher one"


def test_no_import_circle() -> None:
    modules, edges = _graph()
    graph = {m: {t for t, _, _ in targets if t in modules and t != m}
             for m, targets in edges.items()}
    # A package's face re-exports its own modules: an edge into a package from inside it.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t] if t in path else [m, t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_module_imports_another_modules_private_names() -> None:
    _, edges = _graph()
    private = [(m, t, n, line) for m, targets in edges.items() for t, n, line in targets
               if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_no_room_over_900_lines() -> None:
    modules, _ = _graph()
    big = {m: n for m, p in modules.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_the_measures_see_what_they_measure() -> None:
    # The reader finds the imports it must: a private name, a function-level import, a package.
    _, edges = _graph()
    assert ("_interpret", "", ) in {(t, n) for t, n, _ in edges["capture"]}
    assert any(t == "intermediates" for t, _, _ in edges["dumps._read"])  # inside a function
    assert {t for t, _, _ in edges["_jax_compat"]} >= {"_jax_compat._frames",
                                                        "_jax_compat._lowering"}
    assert any(t == "records" for t, _, _ in edges["exporters.jsonl"])


def test_every_benchmark_imports_against_the_house_as_it_is_now() -> None:
    # A benchmark reaching for a name that moved (as bench_jit did for the moments' reduction)
    # fails at import; the suite runs no benchmark itself, so this is where that shows. In a
    # child process, so that nothing a benchmark sets at import reaches the suite.
    import subprocess
    import sys

    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert len(names) >= 15
    code = "import importlib\n" + "".join(
        f"importlib.import_module('benchmarks.{n}')\n" for n in names)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
