"""The package's layout keeps its promises, read with ast (nothing imported but where said):
no import circle among the modules, counting every import (a lazy one inside a function still
ties two modules together and only fails later, in a replica or a job); the stage packages
import one way, down the data flow; the pure modules load without Ray; every module docstring's
command names a module or subcommand that exists."""
import ast
import importlib.util
import os
import re
import subprocess
import sys

import eagle3_ray

PKG = "eagle3_ray"
PKG_DIR = os.path.dirname(os.path.abspath(eagle3_ray.__file__))
# Down the data flow: a module may import its own package and the ones before it. launch (Ray
# start-up) serves the Ray stages; demo, cli and gpu_check (which runs the cli) sit on top.
ORDER = ["__init__", "data", "engine", "launch", "extract", "train", "plan", "serve", "bench",
         "demo", "cli", "gpu_check"]
PURE = ["data.conversations", "data.schema", "engine.hf", "train.draft", "train.ttt",
        "train.vocab", "train.checkpoint", "train.config", "train.kinds", "plan.planner",
        "serve.kernels", "serve.speculate"]


def modules() -> set[str]:
    """Dotted names under the package: "train.ttt", "cli", "serve" (its __init__), "__init__"."""
    out = set()
    for root, _, files in os.walk(PKG_DIR):
        rel = os.path.relpath(root, PKG_DIR).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                name = f[:-3] if rel == "." else (rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
                out.add(name)
    return out


def imported(source: str, mods: set[str], here: str = "") -> set[str]:
    """The package's modules a source imports, anywhere in it ("__init__" for the package)."""
    out = set()

    def add(dotted: str, names) -> None:
        parts = dotted.split(".")
        if parts[0] != PKG:
            return
        inner = ".".join(parts[1:])
        for n in names or [None]:
            full = f"{inner}.{n}" if inner and n else (n if n else inner)
            out.add(full if full in mods else (inner or "__init__"))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, ())
        elif isinstance(node, ast.ImportFrom):
            if node.level:                              # relative: from . import x / from .x ...
                base = here.split(".")[:-node.level] if "." in here else []
                add(".".join([PKG, *base, *filter(None, [node.module])]),
                    [a.name for a in node.names])
            elif node.module:
                add(node.module, [a.name for a in node.names])
    return out


def source_path(mod: str) -> str:
    base = os.path.join(PKG_DIR, *mod.split("."))
    return base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for m in mods:
        with open(source_path(m)) as f:
            graph[m] = imported(f.read(), mods, m) - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as a path [a, b, ..., a], or None (depth-first search, colours)."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = "done"
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_reader_sees_every_kind_of_import():
    mods = {"a", "b", "c", "d", "e", "p", "p.x", "p.y"}
    src = ("import os\nfrom eagle3_ray import a, __version__\nimport eagle3_ray.b\n"
           "def f():\n    from eagle3_ray.c import thing\n"
           "class K:\n    def g(self):\n        from . import d\n        from .e import y\n"
           "from eagle3_ray.p import x\nfrom eagle3_ray.p.y import z\n")
    assert imported(src, mods) == {"a", "__init__", "b", "c", "d", "e", "p.x", "p.y"}
    assert imported("from . import y\n", mods, "p.x") == {"p.y"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    assert {"plan.planner", "serve.app", "serve.vllm", "train.checkpoint"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_stages_import_down_the_data_flow():
    """A module imports its own package or the packages before it in ORDER, never one after:
    the layout reads as the flow (conversations -> hidden states -> drafter -> served tokens
    -> a plan, benchmarks over all of them)."""
    rank = {name: i for i, name in enumerate(ORDER)}
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == set(ORDER), "a package or module outside ORDER"
    upward = [(m, d) for m, deps in graph.items() for d in deps
              if rank[d.split(".")[0]] > rank[m.split(".")[0]]]
    assert not upward, f"imports against the flow: {upward}"


def test_pure_modules_load_without_ray():
    code = ("import sys; import " + ", ".join(f"{PKG}.{m}" for m in PURE) +
            "; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_docstring_command_names_what_exists():
    """`python -m eagle3_ray.X` runs a module with a __main__ block; `eagle3-ray SUB` is a
    subcommand of the CLI."""
    from eagle3_ray import cli
    subs = set(cli.parser()._subparsers._group_actions[0].choices)
    seen = 0
    for m in sorted(modules()):
        with open(source_path(m)) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        for target in re.findall(r"python -m (eagle3_ray[\w.]*)", doc):
            spec = importlib.util.find_spec(target)
            assert spec is not None, f"{m}: python -m {target}: no such module"
            with open(spec.origin) as f:
                assert '__name__ == "__main__"' in f.read(), f"{m}: {target} has no __main__"
            seen += 1
        for sub in re.findall(r"^\s*eagle3-ray (\w[\w-]*)", doc, re.M):
            assert sub in subs, f"{m}: eagle3-ray {sub}: no such subcommand"
            seen += 1
    assert seen > 20
