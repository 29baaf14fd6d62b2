"""The house as drawn: imports go down the floors (tools and bench -> stages -> pipeline -> model), no module imports
itself back through others (annotation-only imports count), no module outside stages/ imports a stage, no code file
outside tests/ passes 400 lines, and no test module imports another.

    python -m pytest -q tests/project/test_layout.py      # (or make check-layout) the floors, the cycles, the sizes
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"model": 0, "pipeline": 1, "stages": 2, "bench": 3, "tools": 3}  # a module imports its floor and below
MAX_LINES = 400


def code_files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The project modules `path` imports, at any depth of its code, `if TYPE_CHECKING:` (annotations) included: a
    cycle that only type hints close is still a cycle."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.split(".")[0] in FLOORS or n.split(".")[0] == "tests"}


def graph() -> dict[str, set[str]]:
    """Each project module outside tests/ and the project modules it imports (a name that is not a module, such as
    `from pipeline.core.config import parse`, counts as its module)."""
    files = code_files(*FLOORS)
    modules = {module_name(p) for p in files}
    resolve = lambda n: n if n in modules else n.rsplit(".", 1)[0] if n.rsplit(".", 1)[0] in modules else None
    return {module_name(p): {m for n in imported(p) if (m := resolve(n)) and m != module_name(p)} for p in files}


def test_imports_go_down_the_floors_never_up():
    upward = [f"{module} imports {other}" for module, others in graph().items() for other in sorted(others)
              if FLOORS[other.split(".")[0]] > FLOORS[module.split(".")[0]]
              or (other.split(".")[0] != module.split(".")[0] and FLOORS[other.split(".")[0]] == FLOORS[module.split(".")[0]])]
    assert upward == []


def test_no_module_imports_itself_back_through_others():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(edges.get(module, ())):
            if state.get(other) == 1:
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_module_outside_stages_imports_a_stage():
    """Stages are the pipeline's scripts: what a bench, a tool or the library needs of one lives in pipeline/."""
    crossing = [f"{module} imports {other}" for module, others in graph().items() if not module.startswith("stages.")
                for other in sorted(others) if other.split(".")[0] == "stages"]
    assert crossing == []


def test_benches_share_only_the_harness():
    """A bench imports bench/harness/ and nothing of another bench; the harness imports no bench."""
    crossing = [f"{module} imports {other}" for module, others in graph().items() if module.startswith("bench.")
                for other in sorted(others) if other.startswith("bench.") and not other.startswith("bench.harness")]
    assert crossing == []


def test_no_code_file_outside_tests_passes_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in code_files(*FLOORS) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_is_one_the_install_lists():
    """pyproject.toml's packages name every folder of code (a package a non-editable install would leave out)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {module_name(p) for p in code_files(*FLOORS) if p.name == "__init__.py"} == listed


def test_no_test_module_imports_another_test_module():
    """Shared helpers live in fixture modules (tests/fixtures/, conftest.py), never in a test module."""
    tests = {module_name(p) for p in (ROOT / "tests").rglob("test_*.py")}
    crossing = [f"{module_name(p)} imports {n}" for p in sorted((ROOT / "tests").rglob("*.py"))
                for n in sorted(imported(p)) if n in tests or n.rsplit(".", 1)[0] in tests]
    assert crossing == []


def test_shared_helpers_live_in_the_fixtures_folder():
    """tests/ holds the test folders, conftest.py and the two rehearsals `make` runs; every shared helper module
    is in tests/fixtures/."""
    top = {p.name for p in (ROOT / "tests").glob("*.py")}
    assert top <= {"__init__.py", "conftest.py", "rehearse.py", "multinode_smoke.py"}, sorted(top)
    fixtures = ROOT / "tests" / "fixtures"
    assert not list(fixtures.glob("test_*.py"))
    indexed = set(re.findall(r"^    (\w+\.py) ", (fixtures / "__init__.py").read_text(), re.M))  # its index
    assert indexed == {p.name for p in fixtures.glob("*.py")} - {"__init__.py"}


def test_the_checks_see_what_they_guard(tmp_path):
    """The import reader finds nested, aliased and annotation-only imports (else the checks pass vacuously)."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nimport model.loss as loss\nif TYPE_CHECKING:\n"
                      "    from stages import train\n\ndef f():\n    from pipeline.core import config\n")
    assert imported(source) == {"model.loss", "pipeline.core", "pipeline.core.config", "stages", "stages.train"}
    edges = graph()
    assert "model.transformer" in edges["stages.train"] or any(m.startswith("pipeline.training") for m in edges["stages.train"])
    assert len(edges) > 100
