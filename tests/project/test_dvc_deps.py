"""dvc.yaml's deps follow the imports: editing any project file a stage runs re-runs that stage.

The imports are derived, not listed: from each stage's command (`-m stages.<name>`),
every `import` and `from ... import` in the module, function-level ones included,
followed transitively through the project's own packages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.weights.fingerprint import PACKAGES, project_imports

ROOT = Path(__file__).resolve().parents[2]


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


def covered_files(dep: Path, root: Path = ROOT) -> set[Path]:
    """The project files with code that a code dep covers (a file, or every .py under a folder)."""
    full = root / dep
    files = [full] if full.is_file() else [p for p in full.rglob("*.py") if "__pycache__" not in p.parts]
    return {p.relative_to(root) for p in files if p.read_text(encoding="utf-8").strip()}


def missing_and_unused(stage: dict, root: Path = ROOT) -> tuple[list[Path], list[Path], list[Path]]:
    """(imported files no dep covers, code deps that cover no imported file, files a dep covers but the stage
    never imports: an edit to one would re-run the stage for nothing)."""
    imported = project_imports(stage_module(stage["cmd"]), root)
    deps = code_deps(stage.get("deps", []), root)
    covered = lambda f, d: f == d or d in f.parents  # noqa: E731
    missing = sorted(f for f in imported if not any(covered(f, d) for d in deps))
    unused = [d for d in deps if not any(covered(f, d) for f in imported)]
    needless = sorted(set().union(*(covered_files(d, root) for d in deps)) - imported)
    return missing, unused, needless


def pipeline_stages(root: Path = ROOT) -> dict[str, dict]:
    return yaml.safe_load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


@pytest.mark.parametrize("name", sorted(pipeline_stages()))
def test_every_stage_depends_on_every_project_file_it_imports_and_on_nothing_else(name):
    stage = pipeline_stages()[name]
    missing, unused, needless = missing_and_unused(stage)
    assert not missing, f"dvc.yaml stage {name!r}: deps miss {', '.join(map(str, missing))}, which its command imports"
    assert not unused, f"dvc.yaml stage {name!r}: deps list {', '.join(map(str, unused))}, which its command never imports"
    assert not needless, (f"dvc.yaml stage {name!r}: its deps cover {', '.join(map(str, needless))}, which its command "
                          "never imports (an edit there would re-run it for nothing): list files, or move the module")


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
    missing, unused, needless = missing_and_unused(stage, tmp_path)
    assert [str(p) for p in missing] == ["model/__init__.py", "model/c.py"]
    assert [str(p) for p in unused] == ["model/unused.py"]
    assert [str(p) for p in needless] == ["model/unused.py"]
    (tmp_path / "pipeline/other.py").write_text("z = 3\n")  # in a folder the stage depends on, imported by no one
    assert [str(p) for p in missing_and_unused(stage, tmp_path)[2]] == ["model/unused.py", "pipeline/other.py"]


def test_checkpoints_are_kept_out_of_the_cache_and_the_averaged_model_is_cached():
    """GBs of checkpoints are not copied into .dvc/cache; dvc.lock still hashes them, so average follows them.

    tests/training/test_faults.py checks the same on a real `dvc repro` (slow).
    """
    stages = pipeline_stages()
    outs = {path: opts for out in stages["train"]["outs"] for path, opts in
            (out.items() if isinstance(out, dict) else [(out, {})])}
    assert outs["data/checkpoints"] == {"cache": False, "persist": True}  # persist: a rerun resumes from them
    assert "data/checkpoints" in stages["average"]["deps"]
    assert stages["average"]["outs"] == ["data/model"]  # a plain out: cached
