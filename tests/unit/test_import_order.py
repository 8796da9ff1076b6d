"""The package's and the lab's modules import each other in one direction: no circle, type-only
ones included (the folders' order: ``test_import_layers.py``).

A circle that is harmless today (an import under ``TYPE_CHECKING``) still ties two modules so
that neither can be read, moved or tested without the other; state the schedule keeps (the
row output in flight, the model ends' hand-offs) lives in modules below ``state.py`` so that
the modules using the runtime need not be imported by it. Read from the source with ``ast``:
no import runs.
"""

from __future__ import annotations

import ast

from source_tree import checkout_modules, find_circle


def import_graph() -> dict[str, set[str]]:
    """``module -> the checkout's modules it imports`` (at any depth: functions,
    ``TYPE_CHECKING``)."""
    modules = checkout_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    graph[name].add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in modules)
        graph[name].discard(name)
    return graph


def test_the_search_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_library():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)
