"""This checkout's files as the static checks read them (``unit/test_docs_references.py``,
``unit/test_import_order.py``): the repository root, the package's modules and the lab's
(``lab/``, beside the package) by name."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_domino"
LAB = REPO / "lab"


def module_name(path: Path) -> str:
    """The dotted name a library file imports as (a package's ``__init__.py``: the package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def checkout_modules() -> dict[str, Path]:
    """Every module of the package and of the lab, by dotted name."""
    lab = {module_name(path): path for path in sorted(LAB.rglob("*.py"))}
    return {**library_modules(), **lab}


def find_circle(graph: dict[str, set[str]] | dict[str, dict]) -> list[str] | None:
    """One circle of ``graph`` (module or folder imports: ``name -> names it imports``) as ``[a, b, ..., a]``, or ``None`` (depth-first search)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for child in sorted(graph.get(node, ())):
            if child in path:
                return [*path[path.index(child) :], child]
            if child not in done:
                circle = visit(child, [*path, child])
                if circle:
                    return circle
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (circle := visit(start, [start])):
            return circle
    return None
