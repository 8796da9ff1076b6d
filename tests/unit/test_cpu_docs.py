"""docs/cpu.md against what the scripts use: one list of CPU flags (``runs.CPU_FLAGS``), the
commands the page gives, and the other documents pointing at the page instead of a list."""

from __future__ import annotations

import importlib
import re
import runpy
from pathlib import Path

from megatron_domino.training import runs

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "cpu.md"


def test_the_page_shows_the_generated_flag_list():
    page = PAGE.read_text()
    assert runs.cpu_flags_markdown() in page, (
        "docs/cpu.md's block between the cpu-flags markers is not runs.cpu_flags_markdown(): "
        "regenerate it (see that function's docstring)."
    )


def test_the_scripts_use_that_list():
    smoke = runpy.run_path(str(REPO / "patches" / "cpu_smoke.py"))
    assert smoke["CPU_FLAGS"] == runs.cpu_flags()
    launch = importlib.import_module("launch")  # tests/launch.py, the training tests' runs
    assert launch.TINY_GPT[: len(runs.cpu_flags())] == runs.cpu_flags()
    # The recipes: CPU_ARGS in bash, --transformer-impl coming from TRANSFORMER_IMPL.
    common = (REPO / "examples" / "lib" / "common.sh").read_text()
    (cpu_args,) = re.findall(r"\(\(CPU\)\) && CPU_ARGS=\(([^)]*)\)", common)
    flags = " ".join(runs.cpu_flags())
    assert cpu_args.split() == flags.replace(" --transformer-impl local", "").split()
    assert "TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-$( ((CPU)) && echo local" in common


def test_the_commands_on_the_page_name_what_exists():
    page = PAGE.read_text()
    module, function = "megatron_domino.specs.cpu_specs", "sequence_parallel_local_spec"
    assert f"--spec {module} {function}" in page
    assert callable(getattr(importlib.import_module(module), function))
    for path in ("patches/cpu_launch.py", "patches/cpu_smoke.py",
                 "patches/megatron-lm-core_r0.19-pretrain_gpt-domino.patch"):  # fmt: skip
        assert path in page and (REPO / path).is_file(), path


def test_the_other_documents_point_at_the_page_instead_of_a_list():
    for name in ("README.md", "examples/README.md", "patches/README.md"):
        text = (REPO / name).read_text()
        assert "docs/cpu.md" in text or "../docs/cpu.md" in text, name
        assert "--no-persist-layer-norm" not in text, f"{name} keeps its own CPU flag list"
