"""Every module, class, function and file of this project that the documents name must exist.

Modules move and names change (``SavedInputRegather`` left ``sequence_parallel.py`` for
``saved_shards.py``); the code follows at once because Python fails the import, but the README,
``docs/``, the recipes' and the patch's READMEs and the library's own docstrings and comments
keep the old name until a reader follows it into nothing. This test follows every such name:

* dotted names starting with ``megatron_domino.``, anywhere in the text;
* Sphinx roles in the library's docstrings and comments (``:mod:``, ``:class:``, ``:func:``,
  ``:data:``, ``:meth:``, ``:attr:``, ``:exc:``), looked up as Sphinx does: in the module
  they are written in, its classes, its package, the top-level package, as written; ``.name``
  in any module;
* backticked short names whose first part is one of this project's modules or classes
  (``saved_shards.SavedInputRegather``, ``DominoConfig.chunks``), or whose last part is a
  name the project defines (``integration.fsdp_problems``, after ``integration`` was gone);
* file paths under this checkout's top-level folders (``megatron_domino/runtime/patch.py``,
  ``tests/te_models.py``, ``docs/cpu.md``, ``scripts/gpu_check.sh``) from the repository's
  root or the citing file's folder, and ``../shared/...`` where the checkout has that folder;
* the README flag table's ``field`` column against :class:`~megatron_domino.base.config.DominoConfig`.

Names resolve in this process: each module is imported with :mod:`importlib` and the rest
walked with ``getattr``. A name one of this package's modules merely imports does not count
there (``cpu_runtime.Patch`` is ``runtime.patch``'s); an attribute that exists only on
instances counts when its class declares it (a dataclass field, an annotation,
``self.<name> =`` in its source). Nothing is started: the imports, Megatron-Core's included,
are the whole cost, a few seconds.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import re
import tokenize
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from source_tree import REPO, checkout_modules, module_name

#: ``../shared/`` beside a checkout holds the project's reference notes (``docs/domino.md``,
#: ...); a checkout without that folder cannot check citations of them and skips them.
SHARED = REPO.parent / "shared"

DOCUMENTS = sorted(
    [REPO / "README.md", REPO / "tests" / "README.md", *(REPO / "docs").glob("**/*.md")]
    + [*(REPO / "examples").glob("*.md")]
    + [path for path in [REPO / "patches" / "README.md"] if path.is_file()]
)
#: The package's modules and the lab's (``lab/``, beside the package).
LIBRARY = list(checkout_modules().values())
#: The other Python files: the entry point, the patch's scripts, the tests but this file
#: (whose text holds stale names on purpose).
SCRIPTS = sorted(
    [
        REPO / "pretrain_gpt_domino.py",
        *(REPO / "patches").glob("*.py"),
        *(REPO / "tests").rglob("*.py"),
    ]
)
SCRIPTS.remove(Path(__file__).resolve())

#: A Sphinx cross-reference, its target possibly ``~``-shortened and wrapped over a line.
ROLE = re.compile(r":(?:py:)?(?:mod|class|func|data|meth|attr|exc|obj):`~?([\w.\s]+?)(?:\(\))?`")
#: A dotted name in this package or the lab; possessive, so ``megatron_domino.egg-info`` (a
#: folder) is not read as ``megatron_domino.egg``.
DOTTED = re.compile(r"(?<![\w./-])(?:megatron_domino|lab)(?:\.\w+)++(?![\w/-])")
#: A dotted name in single or double backticks: ``a.b.c`` or ``a.b.c()``.
BACKTICKED = re.compile(r"(?<!`)(``?)(\w+(?:\.\w+)+)(?:\(\))?\1(?!`)")
#: A path under one of this checkout's top-level folders or ``shared/``, possibly relative
#: (``../docs/cpu.md`` from ``examples/``).
PATH = re.compile(
    r"(?<![\w./-])((?:\.\./)*(?:megatron_domino|lab|tests|docs|scripts|examples|patches|shared)"
    r"/[\w./*-]*)"
)
#: Last parts that make a backticked ``a.b`` a file's name (``state.py``, ``tokenizer.model``).
FILE_SUFFIXES = set("py md sh json jsonl txt toml patch png cpp env log model bin idx yaml".split())
#: Backticked short names whose first part is also the usual name of a Domino object:
#: ``config.shape_problems`` is a DominoConfig's, ``runtime.recorder`` a DominoRuntime's.
SHORT_ALIASES = {
    "config": [
        "megatron_domino.base.config",
        "megatron_domino.base.config.DominoConfig",
    ],
    "runtime": ["megatron_domino.runtime", "megatron_domino.engine.state.DominoRuntime"],
}


# --- the text ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Citation:
    """A name or path as written, and where it is written."""

    file: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Passage:
    """Text to scan: a whole document, or one comment or string literal of a Python file.

    ``module``: a library module's dotted name, where the passage's Sphinx roles are looked
    up (None elsewhere: a test's roles are checked where they name ``megatron_domino.``);
    ``parameters``: the file's function parameters (``block.layers`` there is a variable).
    """

    file: Path
    first_line: int
    text: str
    module: str | None = None
    parameters: frozenset[str] = frozenset()

    def cite(self, match: re.Match, text: str) -> Citation:
        line = self.first_line + self.text.count("\n", 0, match.start())
        return Citation(self.file.relative_to(REPO).as_posix(), line, text)


def passages() -> Iterator[Passage]:
    """The documents whole, and every comment and string literal of the Python files (their
    code proper is Python's to check: a stale import fails when imported)."""
    for path in DOCUMENTS:
        yield Passage(path, 1, path.read_text())
    prose = {tokenize.COMMENT, tokenize.STRING, tokenize.FSTRING_MIDDLE}
    for path in LIBRARY + SCRIPTS:
        module = module_name(path) if path in LIBRARY else None
        parameters = _module_facts(path).parameters
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type in prose:
                yield Passage(path, token.start[0], token.string, module, parameters)


# --- the library, from its source --------------------------------------------------------------


@dataclass(frozen=True)
class ModuleFacts:
    """What one library module's source binds, read with :mod:`ast` (nothing imported)."""

    defined: frozenset[str]  # top-level names bound other than by an import
    exported: frozenset[str]  # its ``__all__``
    classes: frozenset[str]
    parameters: frozenset[str]  # its functions' parameters: ``block.layers`` there is a variable


@functools.cache
def _module_facts(path: Path) -> ModuleFacts:
    tree = ast.parse(path.read_text())
    defined, exported, classes = set(), set(), set()
    statements = list(tree.body)
    while statements:  # the top level, and inside its ``if`` and ``try`` blocks
        node = statements.pop()
        if isinstance(node, ast.If | ast.Try):
            statements += node.body + node.orelse + getattr(node, "finalbody", [])
            statements += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            defined |= names
            if "__all__" in names and isinstance(node.value, ast.List | ast.Tuple):
                exported |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    parameters = {
        a.arg
        for n in ast.walk(tree)
        if isinstance(n, ast.arguments)
        for a in n.posonlyargs + n.args + n.kwonlyargs
    }
    return ModuleFacts(*map(frozenset, (defined, exported, classes, parameters)))


@functools.cache
def library() -> dict[str, ModuleFacts]:
    """Every library module, by dotted name."""
    return {module_name(path): _module_facts(path) for path in LIBRARY}


@functools.cache
def _modules_by_basename() -> dict[str, list[str]]:
    modules: dict[str, list[str]] = {}
    for name in library():
        if not name.endswith("__main__"):
            modules.setdefault(name.rpartition(".")[2], []).append(name)
    return modules


# --- resolving ---------------------------------------------------------------------------------

#: An attribute the class declares but holds only on instances: it exists, and what lies
#: below it cannot be followed without an instance.
UNFOLLOWABLE = object()


@functools.cache
def _assigned_on_self(source_file: str) -> dict[str, frozenset[str]]:
    """Class name -> the ``self.<name>`` its methods assign, for one source file."""
    tree = ast.parse(Path(source_file).read_text())
    assigned = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        targets = [
            t
            for n in ast.walk(cls)
            if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        ]
        assigned[cls.name] = frozenset(
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        )
    return assigned


def _declared_on_instances(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a dataclass field, an annotation, a slot, or
    ``self.<name>`` assigned in a class of its MRO."""
    for klass in cls.__mro__[:-1]:  # not ``object``
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        try:
            source_file = inspect.getsourcefile(klass)
        except TypeError:  # a built-in class
            continue
        if source_file and name in _assigned_on_self(source_file).get(klass.__name__, ()):
            return True
    return False


@functools.cache
def unresolved(dotted: str, written_in: str | None = None) -> str | None:
    """Why ``dotted`` names nothing; None when it names a module or something inside one.

    In this package's modules only what a module defines or exports (``__all__``) counts: a
    reader looks for a name where it is cited. Except in ``written_in``, the module a Sphinx
    role is written in, whose reader sees its imports.
    """
    head, *rest = dotted.split(".")
    if importlib.util.find_spec(head) is None:
        return f"no module {head}"
    obj: object = importlib.import_module(head)
    path = head
    for part in rest:
        if obj is UNFOLLOWABLE:
            return None
        if isinstance(obj, types.ModuleType):
            submodule = f"{obj.__name__}.{part}"
            if hasattr(obj, "__path__") and importlib.util.find_spec(submodule) is not None:
                obj, path = importlib.import_module(submodule), submodule
                continue
            if not hasattr(obj, part):
                return f"{path} has no {part}"
            facts = library().get(obj.__name__)
            if facts and obj.__name__ != written_in and part not in facts.defined | facts.exported:
                home = getattr(getattr(obj, part), "__module__", None) or "elsewhere"
                return f"{path} only imports {part} (from {home})"
            obj = getattr(obj, part)
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and _declared_on_instances(obj, part):
            obj = UNFOLLOWABLE
        else:
            return f"{path} has no {part}"
        path = f"{path}.{part}"
    return None


def _is_project_name(name: str) -> bool:
    """Whether ``name`` is this package, one of its modules' basenames or a name one defines."""
    return (
        name in ("megatron_domino", "lab")
        or name in _modules_by_basename()
        or any(name in facts.defined for facts in library().values())
    )


def _candidates_for_role(target: str, module: str) -> list[str]:
    """Where Sphinx looks for a role's target written in ``module``: the module itself, its
    classes (``:meth:`applied``` in a class docstring), its package, the top-level package,
    the target as written; with a leading dot (``.name``), in any module. Nothing for another
    project's module that is not installed (``matplotlib.pyplot``, an optional dependency)."""
    if target.startswith("."):
        return [f"{m}{target}" for m in library() if not m.endswith("__main__")]
    head = target.partition(".")[0]
    if "." in target and not _is_project_name(head) and importlib.util.find_spec(head) is None:
        return []
    package = module if (REPO / Path(*module.split("."))).is_dir() else module.rpartition(".")[0]
    classes = [f"{module}.{cls}.{target}" for cls in sorted(library()[module].classes)]
    return [
        f"{module}.{target}",
        *classes,
        f"{package}.{target}",
        f"megatron_domino.{target}",
        target,
    ]


def _distinctive(name: str) -> bool:
    """``fsdp_problems`` or ``SavedInputRegather``, not a word such as ``pyplot``."""
    return "_" in name.strip("_") or sum(map(str.isupper, name)) >= 2


def _candidates_for_short(text: str, parameters: frozenset[str]) -> list[str]:
    """What a backticked ``head.rest`` may name: ``head`` one of this project's modules (any
    with that basename) or classes; or, ``head`` none of them nor installed (a module since
    moved away, as ``integration``), ``rest`` a distinctive name this project defines. Nothing
    for a file's name (``state.py``) or a parameter's attribute (``block.layers``)."""
    head, _, rest = text.partition(".")
    tail = rest.rpartition(".")[2]
    if head in ("megatron_domino", "lab") or tail in FILE_SUFFIXES or head in parameters:
        return []  # the first is DOTTED's
    if head in SHORT_ALIASES:
        return [f"{prefix}.{rest}" for prefix in SHORT_ALIASES[head]]
    prefixes = _modules_by_basename().get(head, [])
    prefixes += [f"{m}.{head}" for m, facts in library().items() if head in facts.classes]
    if prefixes:
        return [f"{prefix}.{rest}" for prefix in prefixes]
    if "." not in rest and _distinctive(rest) and importlib.util.find_spec(head) is None:
        if any(rest in facts.defined for facts in library().values()):
            return [f"megatron_domino.{text}"]
    return []


def _first_reason(candidates: list[str], written_in: str | None = None) -> str | None:
    """None when one of ``candidates`` resolves, else why the most telling one does not: a
    name only imported where cited, else the one that got furthest."""
    reasons = []
    for candidate in candidates:
        reason = unresolved(candidate, written_in)
        if reason is None:
            return None
        reasons.append(reason)
    return max(reasons, key=lambda why: ("only imports" in why, len(why.partition(" ")[0])))


def name_citations(source: Iterable[Passage]) -> Iterator[tuple[Citation, str | None]]:
    """Every name of this project cited, and why it names nothing (None when it resolves)."""
    for passage in source:
        in_roles = []
        if passage.module is not None:
            for match in ROLE.finditer(passage.text):
                in_roles.append(match.span())
                target = re.sub(r"\s+", "", match[1]).rstrip(".")
                candidates = _candidates_for_role(target, passage.module)
                if candidates:
                    yield passage.cite(match, target), _first_reason(candidates, passage.module)
        for match in DOTTED.finditer(passage.text):
            if not any(start <= match.start() < end for start, end in in_roles):
                yield passage.cite(match, match[0]), unresolved(match[0])
        for match in BACKTICKED.finditer(passage.text):
            candidates = _candidates_for_short(match[2], passage.parameters)
            if candidates and not any(start <= match.start() < end for start, end in in_roles):
                yield passage.cite(match, match[2]), _first_reason(candidates)


def path_citations(source: Iterable[Passage]) -> Iterator[tuple[Citation, str | None]]:
    """Every path into this checkout cited, and why it points at nothing (None when it does),
    from the repository's root or the citing file's folder.

    Megatron-LM has ``examples/``, ``tests/`` and ``docs/`` too: outside the package, a path
    with neither a suffix nor a trailing ``/`` (``examples/gpt3``), or in a folder this
    checkout lacks (``examples/gpt3/train_gpt3_175b_distributed.sh``), is taken for
    Megatron-LM's and not checked.
    """
    for passage in source:
        for match in PATH.finditer(passage.text):
            text = match[1].rstrip(".,")
            shared = text.lstrip("./").startswith("shared/")
            if shared and not SHARED.is_dir():
                continue
            places = [REPO / text, passage.file.parent / text]
            if not (shared or text.startswith(("megatron_domino/", "lab/"))):
                if not (text.endswith("/") or Path(text).suffix):
                    continue
                if not any(place.parent.is_dir() for place in places):
                    continue
            found = any(p.exists() or "*" in text and any(p.parent.glob(p.name)) for p in places)
            yield passage.cite(match, text), None if found else "no such file or folder"


def _failures(citations: Iterable[tuple[Citation, str | None]]) -> str:
    failed = sorted({(c.file, c.line, c.text, why) for c, why in citations if why is not None})
    return "\n".join(f"  {file}:{line}: {text}  ({why})" for file, line, text, why in failed)


def test_every_cited_name_resolves():
    failures = _failures(name_citations(passages()))
    assert not failures, f"names cited that do not resolve:\n{failures}"


def test_every_cited_path_exists():
    failures = _failures(path_citations(passages()))
    assert not failures, f"paths cited that do not exist:\n{failures}"


def test_the_flag_table_names_the_config_fields():
    """The README's flag table gives the :class:`DominoConfig` field each flag sets; the parser
    is generated from the fields (``add_domino_args``), so the table must name the same."""
    from megatron_domino.base.config import DominoConfig

    field_of = {f.metadata["flag"]: f.name for f in dataclasses.fields(DominoConfig)}
    wrong, header = [], None
    for number, line in enumerate((REPO / "README.md").read_text().splitlines(), 1):
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells
        elif {"flag", "field"} <= set(header) and not set(line) <= set("|-: "):
            flag, field = cells[header.index("flag")].split()[0], cells[header.index("field")]
            if (field or flag in field_of) and field_of.get(flag) != field:
                wrong.append(
                    f"  README.md:{number}: {flag}: `{field}`, the field is `{field_of.get(flag)}`"
                )
    assert not wrong, "README's flag table names the wrong fields:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "text, module",
    [
        ("`sequence_parallel.SavedInputRegather`", None),
        ("``integration.fsdp_problems``", "megatron_domino.training.megatron_lm"),
        (":class:`~megatron_domino.runtime.cpu_runtime.Patch` es", "megatron_domino.apply"),
        (":func:`fsdp_problems`", "megatron_domino.apply"),
        ("``config.split``", None),
        ("megatron_domino.communication.saved_shards.NoSuchThing", None),
        ("(see docs/no_such_page.md sec. 6)", "megatron_domino.base.version"),
        ("`megatron_domino/no_such_module.py`", None),
    ],
)
def test_a_stale_name_is_caught(text, module):
    """The scanner itself: names once stale here are found, and named as not resolving."""
    passage = [Passage(REPO / "docs" / "stale.md", 1, text, module)]
    found = [*name_citations(passage), *path_citations(passage)]
    assert found and all(why is not None for _, why in found), found


def test_a_good_name_is_not_caught():
    """The scanner itself: a name that moved is found where it is now."""
    text = (
        "`saved_shards.SavedInputRegather`, `megatron_domino.DominoConfig`, "
        "`DominoConfig.split_along`, :meth:`DominoHandle.revert` in docs/cpu.md"
    )
    passage = [Passage(REPO / "docs" / "good.md", 1, text, "megatron_domino.apply")]
    found = [*name_citations(passage), *path_citations(passage)]
    assert len(found) == 5 and all(why is None for _, why in found), found


def test_other_projects_names_are_not_taken_for_ours():
    """The scanner itself: Megatron-LM's paths, a parameter's attribute, a file of another
    name or an optional dependency are not this project's names."""
    text = (
        "`examples/gpt3/train_gpt3_175b_distributed.sh`, `examples/gpt3`, ``block.layers``, "
        "`megatron_domino.egg-info`, ``matplotlib.pyplot``, `state.py`, `tokenizer.model`"
    )
    passage = [Passage(REPO / "docs" / "other.md", 1, text, None, frozenset({"block"}))]
    assert [*name_citations(passage), *path_citations(passage)] == []


def test_the_tests_readme_lists_every_test_file_in_its_tier():
    """tests/README.md's tables name each test file by its tier folder, and only files that
    exist: a moved, added or removed test shows up here."""
    listed = set(
        re.findall(r"^\| `(\w+/test_\w+\.py)` \|", (REPO / "tests" / "README.md").read_text(), re.M)
    )
    present = {
        str(path.relative_to(REPO / "tests")) for path in (REPO / "tests").glob("*/test_*.py")
    }
    assert listed == present, (
        f"missing from tests/README.md: {sorted(present - listed)}; "
        f"listed but absent: {sorted(listed - present)}"
    )
