"""The package layering (STYLE.md rule 11): models -> hack_jax -> pallas_kernels, no import cycles.

Reads the sources with ast (nothing is imported): every `import` / `from ... import` of a project
module, at module level or inside a function, is an edge. Run as a script to print the graph.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("models", "hack_jax", "pallas_kernels")  # each may import only the ones after it


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """{module: sorted project modules it imports}, e.g. "hack_jax.kv_cache.kivi": [...]."""
    modules = {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = sorted(deps)
    return graph


def _layer(module):
    return LAYERS.index(module.split(".")[0])


def test_imports_point_down_the_layers():
    upward = [(m, d) for m, deps in import_graph().items() for d in deps if _layer(d) < _layer(m)]
    assert not upward, f"upward imports: {upward}"


def test_no_import_cycles():
    graph = import_graph()
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph[m]:
            if state.get(d) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(path + [d])}")
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


if __name__ == "__main__":
    for module, deps in sorted(import_graph().items()):
        print(f"{module:40s} -> {', '.join(deps) or '-'}")
