"""The package's layering: inference never imports training code, no module imports
itself through a cycle, and every import goes down the layers (or stays within one)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folders installed into the mlx_stream namespace (pyproject.toml: package-dir)
MAPPED = {
    "heads": "mlx_stream.heads",
    "convert": "mlx_stream.convert",
    "train": "mlx_stream.train",
    "mlx_stream": "mlx_stream",
}
# lowest first; a module may import its own layer and the layers below
LAYERS = [
    (
        "base",
        {
            "mlx_stream.defaults",
            "mlx_stream.checks",
            "mlx_stream.files",
            "mlx_stream.prompts",
            "mlx_stream.distributed",
            "mlx_stream.env",
            "mlx_stream.tree",
            "mlx_stream.verify",
            "mlx_stream.sampling",
            "mlx_stream.cache",
            "mlx_stream.datastore",
            "mlx_stream.adaptive",
            "mlx_stream.models",
        },
    ),
    ("heads", {"mlx_stream.heads"}),
    ("convert", {"mlx_stream.convert"}),
    (
        "runtime",
        {
            "mlx_stream.model",
            "mlx_stream.drafters",
            "mlx_stream.budget",
            "mlx_stream.speculation",
            "mlx_stream.calibrate",
            "mlx_stream.steps",
            "mlx_stream.generate",
            "mlx_stream.chat",
            "mlx_stream.repl",
            "mlx_stream.loader",
            "mlx_stream.cost",
            "mlx_stream.bench",
            "mlx_stream.server",
            "mlx_stream.prompt_cache",
        },
    ),
    ("train", {"mlx_stream.train"}),
    ("cli", {"mlx_stream.cli"}),
]
FACADES = {"mlx_stream"}  # the package's __init__ only hands names on (lazily)


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in MAPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its file (function bodies included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                    )
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in mods and t != name}
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layering.py: place it")


def _reach(graph, starts) -> set[str]:
    seen, todo = set(), list(starts)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def test_inference_never_reaches_training_code():
    graph = _graph()
    reached = _reach(
        graph, ["mlx_stream.generate", "mlx_stream.loader", "mlx_stream.chat", "mlx_stream.repl"]
    )
    assert "mlx_stream.generate" in reached and "mlx_stream.heads.io" in reached  # the walk itself works
    assert not [m for m in reached if m.startswith("mlx_stream.train")]


def test_inference_at_run_time_loads_no_training_module(tiny_dir):
    code = (
        "import sys; from mlx_stream import load, generate, ChatSession\n"
        f"m, t = load({str(tiny_dir)!r}, dtype='float32')\n"
        "generate(m, t, 'The quick', max_tokens=4)\n"
        "list(ChatSession(m, t, max_tokens=3).send('hi'))\n"
        "print(sorted(n for n in sys.modules if n.startswith('mlx_stream.train')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_no_import_cycles():
    graph = {m: deps - FACADES for m, deps in _graph().items() if m not in FACADES}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles


def test_imports_go_down_the_layers():
    upward = [
        f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})"
        for a, deps in _graph().items()
        if a not in FACADES
        for b in deps - FACADES
        if _layer(b) > _layer(a)
    ]
    assert not upward


def test_the_command_line_loads_no_mlx_for_help():
    code = "import sys, mlx_stream.cli; print('mlx' in sys.modules, 'mlx_lm' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
