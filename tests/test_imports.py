"""The project's imports run one way: no cycle between its files, counting imports inside functions too, and
dspark/kernels never imports dspark/models (models import kernels). Read from the source with `ast`; nothing is
imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark", "train", "serve", "eval")


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """file -> the project files it imports (paths relative to root, '/'-separated), from every import statement of
    the file, module level or inside a function. `from pkg import name` counts as importing pkg/name.py when that
    module exists, else pkg/__init__.py."""
    files = [p.relative_to(root) for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    module_file = {".".join(f.with_suffix("").parts).removesuffix(".__init__"): f.as_posix() for f in files}

    def resolve(name: str) -> str | None:  # the longest prefix of a dotted name that is a project module
        while name and name not in module_file:
            name = name.rpartition(".")[0]
        return module_file.get(name)

    graph: dict[str, set[str]] = {}
    for f in files:
        package = ".".join(f.parts[:-1])
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse((root / f).read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(module_file[sub] if sub in module_file else resolve(base))
        graph[f.as_posix()] = {t for t in targets if t is not None and t != f.as_posix()}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(kernel file, model file) pairs: dspark/kernels importing dspark/models."""
    return sorted((a, b) for a, bs in graph.items() for b in bs
                  if a.startswith("dspark/kernels/") and b.startswith("dspark/models/"))


def test_the_checker_finds_cycles_and_upward_imports(tmp_path):
    """On a made-up tree: a cycle hidden in a function-level import, and a kernel importing a model."""
    files = {
        "dspark/__init__.py": "",
        "dspark/kernels/__init__.py": "def use_triton():\n    return False\n",
        "dspark/kernels/op.py": "from dspark.kernels import use_triton\nfrom dspark.models.layer import Layer\n",
        "dspark/models/__init__.py": "",
        "dspark/models/layer.py": "from dspark.kernels.op import use_triton\nclass Layer:\n    pass\n",
        "train/__init__.py": "",
        "train/a.py": "import train.b\n",
        "train/b.py": "def f():\n    from . import a\n    return a\n",
        "train/c.py": "from train.b import f\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("dspark", "train"))
    assert graph["dspark/kernels/op.py"] == {"dspark/kernels/__init__.py", "dspark/models/layer.py"}
    assert graph["train/b.py"] == {"train/a.py"}
    assert cycles(graph) == [["dspark/kernels/op.py", "dspark/models/layer.py"], ["train/a.py", "train/b.py"]]
    assert upward_imports(graph) == [("dspark/kernels/op.py", "dspark/models/layer.py")]


def test_the_project_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "dspark/models/k3/kda.py" in graph["dspark/models/k3/model.py"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_kernels_never_import_models():
    graph = import_graph(ROOT)
    assert "dspark/kernels/kda_decode.py" in graph["dspark/models/k3/kda.py"]  # models do import kernels
    assert not upward_imports(graph), upward_imports(graph)
