"""No import circle among eagle3_ray's modules, counting every import in a module's source:
top-level ones and those inside functions (a lazy import still ties the two modules together,
and only runs to fail later, in a replica or a job). Read with ast, nothing is imported."""
import ast
import os

import eagle3_ray

PKG = "eagle3_ray"
PKG_DIR = os.path.dirname(os.path.abspath(eagle3_ray.__file__))


def modules() -> set[str]:
    return {f[:-3] for f in os.listdir(PKG_DIR) if f.endswith(".py")}


def imported(source: str, mods: set[str]) -> set[str]:
    """The package's modules a source imports, anywhere in it ("__init__" for the package)."""
    out = set()

    def add(dotted: str, names) -> None:
        parts = dotted.split(".")
        if parts[0] != PKG:
            return
        if len(parts) > 1:
            out.add(parts[1])
            return
        for n in names:                                 # from eagle3_ray import x, __version__
            out.add(n if n in mods else "__init__")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, ())
        elif isinstance(node, ast.ImportFrom):
            if node.level:                              # relative: from . import x / from .x ...
                add(".".join(filter(None, [PKG, node.module])), [a.name for a in node.names])
            elif node.module:
                add(node.module, [a.name for a in node.names])
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for m in mods:
        with open(os.path.join(PKG_DIR, f"{m}.py")) as f:
            graph[m] = imported(f.read(), mods) - {m}
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
    mods = {"a", "b", "c", "d", "e"}
    src = ("import os\nfrom eagle3_ray import a, __version__\nimport eagle3_ray.b\n"
           "def f():\n    from eagle3_ray.c import thing\n"
           "class K:\n    def g(self):\n        from . import d\n        from .e import y\n")
    assert imported(src, mods) == {"a", "__init__", "b", "c", "d", "e"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_the_package_modules():
    graph = import_graph()
    assert {"planner", "serve", "serve_vllm", "checkpoint"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    # the pure modules below the Ray stages stay below them
    for low in ("planner", "checkpoint", "data", "regen"):
        assert not graph[low] & {"serve", "serve_vllm", "bench"}, (low, graph[low])


def test_held_out_prompts_are_past_the_training_conversations(tiny_tokenizer):
    """Every bench decodes data.heldout_prompts: 8..max_prompt tokens, at most n, and a later
    `skip` gives other prompts (training reads the first conversations)."""
    from eagle3_ray import data
    a = data.heldout_prompts(tiny_tokenizer, 3, skip=10, max_prompt=64)
    assert len(a) == 3 and all(8 <= len(p) <= 64 for p in a)
    assert data.heldout_prompts(tiny_tokenizer, 3, skip=5000, max_prompt=64) != a


def test_openmp_defaults_set_on_import_and_user_values_win():
    """Importing the package sets libgomp's wait policy and spin (read when torch loads, so
    the package must set them first); a value the user exported is kept."""
    import subprocess
    import sys
    code = ("import os, eagle3_ray, torch; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["PASSIVE", "10000"]
    env["GOMP_SPINCOUNT"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["PASSIVE", "0"]
