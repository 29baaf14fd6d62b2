"""dvc.yaml's deps follow the imports: editing any project file a stage runs re-runs that stage.

The imports are derived, not listed: from each stage's command (`-m stages.<name>`),
every `import` and `from ... import` in the module, function-level ones included,
followed transitively through the project's own packages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stages", "pipeline", "model", "tools", "bench")  # the project's own top-level packages


def module_file(name: str, root: Path) -> Path | None:
    """The file of a project module `a.b.c` (a module file or a package's __init__.py), or None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every module name `path` imports, with `from x import y` giving both x and x.y (y may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_imports(module: str, root: Path = ROOT) -> set[Path]:
    """The project files that running `python -m module` imports, transitively (packages' __init__.py included).

    An empty __init__.py is left out: a file without code cannot change what a stage computes.
    """
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            path = module_file(".".join(parts[:i]), root)
            if path is not None and path not in seen:
                seen.add(path)
                todo.extend(imported_modules(path))
    return {p.relative_to(root) for p in seen if p.read_text(encoding="utf-8").strip()}


def stage_module(cmd: str) -> str:
    match = re.search(r"(?:^|\s)-m\s+([\w.]+)", cmd)
    assert match, f"dvc.yaml: cannot find `-m <module>` in the command {cmd!r}"
    return match.group(1)


def code_deps(deps: list, root: Path = ROOT) -> list[Path]:
    """The deps that are project code: .py files, or folders holding .py files (data/ is not code)."""
    out = []
    for dep in map(Path, deps):
        full = root / dep
        if full.suffix == ".py" or (full.is_dir() and dep.parts[0] in PACKAGES):
            out.append(dep)
    return out


def missing_and_unused(stage: dict, root: Path = ROOT) -> tuple[list[Path], list[Path]]:
    """(imported files no dep covers, code deps that cover no imported file)."""
    imported = project_imports(stage_module(stage["cmd"]), root)
    deps = code_deps(stage.get("deps", []), root)
    covered = lambda f, d: f == d or d in f.parents  # noqa: E731
    missing = sorted(f for f in imported if not any(covered(f, d) for d in deps))
    unused = [d for d in deps if not any(covered(f, d) for f in imported)]
    return missing, unused


def pipeline_stages(root: Path = ROOT) -> dict[str, dict]:
    return yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("name", sorted(pipeline_stages()))
def test_every_stage_depends_on_every_project_file_it_imports_and_on_nothing_else(name):
    stage = pipeline_stages()[name]
    missing, unused = missing_and_unused(stage)
    assert not missing, f"dvc.yaml stage {name!r}: deps miss {', '.join(map(str, missing))}, which its command imports"
    assert not unused, f"dvc.yaml stage {name!r}: deps list {', '.join(map(str, unused))}, which its command never imports"


def test_stages_folder_and_dvc_yaml_match_one_to_one():
    scripts = {p.stem for p in (ROOT / "stages").glob("*.py") if p.stem != "__init__"}
    stages = pipeline_stages()
    assert scripts == set(stages)
    assert {name: stage_module(s["cmd"]) for name, s in stages.items()} == {n: f"stages.{n}" for n in stages}


def test_the_import_walk_finds_function_level_and_transitive_imports(tmp_path):
    """The derivation itself: a lazy import inside a function and an import two modules away are both found."""
    for rel, text in {
        "stages/__init__.py": "", "pipeline/__init__.py": "", "model/__init__.py": "import model.c\n",
        "stages/x.py": "from pipeline import a\n",
        "pipeline/a.py": "import os\ndef f():\n    from pipeline.b import thing\n",
        "pipeline/b.py": "import model.c\nthing = 1\n",
        "model/c.py": "x = 1\n", "model/unused.py": "y = 2\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = {str(p) for p in project_imports("stages.x", tmp_path)}
    assert found == {"stages/x.py", "pipeline/a.py", "pipeline/b.py", "model/__init__.py", "model/c.py"}
    stage = {"cmd": "python -m stages.x", "deps": ["stages/x.py", "pipeline", "model/unused.py", "data/raw"]}
    missing, unused = missing_and_unused(stage, tmp_path)
    assert [str(p) for p in missing] == ["model/__init__.py", "model/c.py"]
    assert [str(p) for p in unused] == ["model/unused.py"]


def test_checkpoints_are_kept_out_of_the_cache_and_the_averaged_model_is_cached():
    """GBs of checkpoints are not copied into .dvc/cache; dvc.lock still hashes them, so average follows them.

    tests/test_faults.py checks the same on a real `dvc repro` (slow).
    """
    stages = pipeline_stages()
    outs = {path: opts for out in stages["train"]["outs"] for path, opts in
            (out.items() if isinstance(out, dict) else [(out, {})])}
    assert outs["data/checkpoints"] == {"cache": False, "persist": True}  # persist: a rerun resumes from them
    assert "data/checkpoints" in stages["average"]["deps"]
    assert stages["average"]["outs"] == ["data/model"]  # a plain out: cached
