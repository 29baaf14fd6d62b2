"""The code that shapes the weights: every project file the train stage imports, hashed as parsed code.

    files = project_imports("stages.train")          # derived from the imports, transitively; no kept list
    code = code_fingerprint("stages.train")          # {"model/transformer.py": sha256, ...}
    changed_files(checkpoint["code"], code)          # the files whose code differs, for the log line

A file's digest is the sha256 of its syntax tree with docstrings removed
(`ast.dump`, which holds no comments, line numbers or formatting): an edit to
comments, docstrings, blank lines or layout leaves it unchanged, an edit to
what the code does changes it. Each checkpoint records the fingerprint of the
code that trained it; a resume across a different fingerprint is a code change
(pipeline/weights/checkpoint.py, resume_point). tests/project/test_dvc_deps.py uses the same
walk to check that dvc.yaml's deps follow the imports.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repo: stages/, pipeline/, model/
PACKAGES = ("stages", "pipeline", "model", "tools", "bench")  # the project's own top-level packages


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of a project module `a.b.c` (a module file or a package's __init__.py), or None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module name a file's syntax tree imports, with `from x import y` giving both x and x.y (y may be a
    submodule)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imported_trees(module: str, root: Path) -> dict[Path, ast.Module]:
    """The syntax tree of each project file that running `python -m module` imports, transitively, by path (each
    file read and parsed once); an empty __init__.py is left out: it holds no code."""
    trees: dict[Path, ast.Module] = {}
    empty: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            path = module_file(".".join(parts[:i]), root)
            if path is not None and path not in trees and path not in empty:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text, filename=str(path))
                if text.strip():
                    trees[path] = tree
                else:
                    empty.add(path)
                todo.extend(imported_modules(tree))
    return trees


def project_imports(module: str, root: Path = ROOT) -> set[Path]:
    """The project files that running `python -m module` imports, transitively (packages' __init__.py included),
    relative to `root`; function-level imports count. An empty __init__.py is left out: it holds no code."""
    return {p.relative_to(root) for p in _imported_trees(module, root)}


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def code_digest(tree: ast.AST) -> str:
    """sha256 of a file's code: its syntax tree less docstrings (comments and layout never reach the tree)."""
    return hashlib.sha256(ast.dump(_without_docstrings(tree)).encode()).hexdigest()


def code_fingerprint(module: str = "stages.train", root: Path = ROOT) -> dict[str, str]:
    """{file relative to root: code_digest} for every project file `python -m module` imports, sorted by name."""
    trees = _imported_trees(module, root)
    return {str(p.relative_to(root)): code_digest(trees[p]) for p in sorted(trees)}


def code_hash(code: dict[str, str]) -> str:
    """One sha256 for a whole fingerprint (what averaged checkpoints must share)."""
    return hashlib.sha256(json.dumps(code, sort_keys=True).encode()).hexdigest()


def changed_files(old: dict[str, str] | None, new: dict[str, str]) -> list[str]:
    """The files whose code differs between two fingerprints (added, removed or changed); None: every file."""
    if old is None:
        return sorted(new)
    return sorted(f for f in old.keys() | new.keys() if old.get(f) != new.get(f))
