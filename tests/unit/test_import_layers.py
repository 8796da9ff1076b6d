"""The checkout's folders form layers, and every import points down them.

Each folder of the package (``megatron_domino/`` and its subfolders) and of the measurement
lab beside it (``lab/`` and its subfolders) has a place in :data:`LAYERS`, from the top (what
nothing else imports: the lab's commands) to the bottom (what everything imports:
``megatron_domino.base``). A module may import modules of its own folder and of the folders
below its own; an import of a folder above, or of another folder on the same layer, is an
upward (or sideways) arrow and fails here, as does any circle between folders and any folder
not placed in the list (a new folder is placed on purpose, not by accident).

Imports are read from the source with :mod:`ast`, nothing is imported: at any depth
(functions, ``if TYPE_CHECKING:``), ``import a.b`` and ``from a import b`` alike, relative
ones resolved. A module's folder is its package (a package's ``__init__.py`` belongs to the
package itself). Modules named in strings (the rank server's preload list) are not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from source_tree import REPO, find_circle

#: The top-level folders read: the package and the lab.
ROOTS = ("megatron_domino", "lab")

#: The layers, top first; folders on one layer (a tuple) may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("lab",),  # the lab's commands: activation memory, loss parity
    ("lab.gpu_check",),  # python -m lab.gpu_check
    ("lab.bench",),  # python -m lab.bench
    ("lab.analysis",),  # Domino against stock, host time, capture safety
    ("lab.models",),  # a GPTModel from a few options; the GPU check's models
    ("lab.launch",),  # N gloo ranks, a script on ranks forked from a preloaded server
    ("megatron_domino.harness",),  # moved: aliases of the old paths, for one release
    ("megatron_domino.tools",),  # the user commands: demo, A/B report
    ("megatron_domino.training",),  # the entry point, its loop hooks, the patch's API
    ("megatron_domino.analysis",),  # --domino-report
    ("megatron_domino",),  # the API: apply, plan, refusals, autotune
    ("megatron_domino.specs.te_hybrid_spec",),  # TE's hybrid stack, built when asked for
    ("megatron_domino.specs",),  # the --spec layers
    ("megatron_domino.engine",),  # the chunked schedule
    ("megatron_domino.communication",),  # collectives in flight
    ("megatron_domino.data", "megatron_domino.runtime"),  # data preparation; CPU runtime, launch
    ("megatron_domino.base",),  # config, setting names, recorder, version
)


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module under :data:`ROOTS` of ``repo``, by dotted name."""
    found = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def folder_of(name: str, path: Path) -> str:
    """The folder (package) a module belongs to: a package's ``__init__`` to the package."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, at any depth of its source."""
    package = folder_of(name, path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"  # a submodule, or a name in ``base``
                found.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known:  # ``import a.b.c`` of a name in a.b
                    target = target.rpartition(".")[0]
                found.add(target)
    return {target for target in found if target in known and target != name}


def folder_graph(repo: Path = REPO) -> dict[str, dict[str, list[str]]]:
    """``folder -> imported folder -> the imports that make the arrow ("a -> b")``."""
    known = modules(repo)
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in known.items():
        source = folder_of(name, path)
        graph.setdefault(source, {})
        for target in sorted(imported(name, path, known)):
            folder = folder_of(target, known[target])
            if folder != source:
                graph[source].setdefault(folder, []).append(f"{name} -> {target}")
    return graph


def layer_problems(graph: dict[str, dict[str, list[str]]], layers=LAYERS) -> list[str]:
    """Every folder not placed in ``layers``, and every arrow that does not point down."""
    rank = {folder: n for n, layer in enumerate(layers) for folder in layer}
    problems = [f"{folder}: not placed in LAYERS" for folder in sorted(graph) if folder not in rank]
    for source, targets in sorted(graph.items()):
        for target, arrows in sorted(targets.items()):
            if source in rank and target in rank and rank[target] <= rank[source]:
                way = "sideways" if rank[target] == rank[source] else "upward"
                problems += [f"{way}: {arrow} ({source} -> {target})" for arrow in arrows]
    return problems


# --- the checker itself ------------------------------------------------------------------------


def test_every_layer_folder_exists():
    """A layer named here that left the tree is stale: the list says what the tree is."""
    folders = {folder_of(name, path) for name, path in modules().items()}
    missing = [folder for layer in LAYERS for folder in layer if folder not in folders]
    assert not missing, f"LAYERS names folders that do not exist: {missing}"


def test_an_upward_sideways_or_unplaced_arrow_is_caught():
    layers = (("top",), ("mid", "side"), ("low",))
    graph = {
        "top": {"mid": ["top.a -> mid.b"]},
        "mid": {"top": ["mid.b -> top.a"], "side": ["mid.b -> side.c"], "low": ["mid.b -> low.d"]},
        "side": {},
        "low": {},
        "stray": {"low": ["stray.e -> low.d"]},
    }
    assert layer_problems(graph, layers) == [
        "stray: not placed in LAYERS",
        "sideways: mid.b -> side.c (mid -> side)",
        "upward: mid.b -> top.a (mid -> top)",
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import lab.launch.ranks", {"lab.launch.ranks"}),
        ("from lab.launch import ranks", {"lab.launch.ranks"}),
        ("from lab.launch.ranks import run_ranks", {"lab.launch.ranks"}),
        ("from .ranks import run_ranks", {"lab.launch.ranks"}),
        ("from .. import launch", {"lab.launch"}),
        ("if TYPE_CHECKING:\n    from lab.launch.ranks import x", {"lab.launch.ranks"}),
        ("def f():\n    import lab.launch.ranks as r", {"lab.launch.ranks"}),
        ("import torch", set()),
    ],
)
def test_imports_are_read_in_every_form(tmp_path, source, expected):
    (tmp_path / "lab" / "launch").mkdir(parents=True)
    for name in ("lab/__init__.py", "lab/launch/__init__.py", "lab/launch/ranks.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "lab" / "launch" / "script.py").write_text(source)
    known = modules(tmp_path)
    name = ".".join(("lab", "launch", "script"))  # a module of tmp_path only
    assert imported(name, known[name], known) == expected


# --- the checkout ------------------------------------------------------------------------------


def test_every_import_points_down_the_layers():
    problems = layer_problems(folder_graph())
    assert not problems, "imports against the layers (tests/unit/test_import_layers.py):\n" + (
        "\n".join(f"  {problem}" for problem in problems)
    )


def test_no_circle_between_folders():
    circle = find_circle(folder_graph())
    assert circle is None, "folder circle: " + " -> ".join(circle)
