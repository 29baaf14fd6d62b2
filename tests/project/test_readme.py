"""The README's commands run as written: make targets, modules, and the DVC commands, in a real temporary repo."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.core import tracking
from tests.fixtures.pipeline_repo import VENV_BIN, dvc, dvc_run, git_commit, use_preset
from tests.fixtures.tiny_run import copy_run, tiny_run  # noqa: F401 (tiny_run is a fixture)

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAKEFILE = (ROOT / "Makefile").read_text(encoding="utf-8")


def readme_command(starts: str) -> str:
    """The one command line of the README that starts with `starts` (in a code block or inline)."""
    (line,) = {m.strip() for m in re.findall(rf"(?:^\s*|`)({re.escape(starts)}[^`\n#]*)", README, re.M)}
    return line


def brace_expand(pattern: str) -> set[str]:
    """`a/{x,y}.{1,2}` -> {a/x.1, a/x.2, a/y.1, a/y.2}."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return {"".join(c) for c in itertools.product(*choices)}


# --- fast: what the README names exists -------------------------------------------------------------------------


def test_every_make_target_the_readme_names_is_a_phony_target():
    targets = set(re.findall(r"\bmake ([\w-]+)", README))
    phony = set(re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M)[1].split())
    defined = set(re.findall(r"^([\w-]+):", MAKEFILE, re.M))
    assert targets and targets <= defined and targets <= phony, (targets - defined, targets - phony)


def test_every_module_the_readme_runs_exists():
    modules = set(re.findall(r"python -m ((?:stages|pipeline|tools|bench)(?:\.\w+)+)", README))
    runnable = lambda m: (ROOT / f"{m.replace('.', '/')}.py").is_file() or (ROOT / m.replace(".", "/") / "__main__.py").is_file()  # noqa: E731
    assert modules and [m for m in modules if not runnable(m)] == []


def test_make_bench_runs_what_the_readme_says():
    recipe = MAKEFILE.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    ran = re.findall(r"-m (bench(?:\.\w+)+)", recipe)
    said = re.search(r"`make bench` runs ([^;]*);", README, re.S)[1]
    assert ran and all(f"`{m}`" in said.split("(all but")[0] for m in ran), said
    left_out = re.findall(r"`(bench(?:\.\w+)+)`", said.split("(all but")[1])
    assert left_out and not set(left_out) & set(ran)


def test_every_bench_is_run_by_make_or_named_where_it_is_not():
    """Every bench that stays is run by `make bench` or a make target, or named among those `make bench` leaves out."""
    benches = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "bench").rglob("*.py")
               if "harness" not in p.parts and "def main(" in p.read_text()}
    said = re.search(r"`make bench` runs ([^;]*);", README, re.S)[1]
    named = set(re.findall(r"-m (bench(?:\.\w+)+)", MAKEFILE)) | set(re.findall(r"`(bench(?:\.\w+)+)`", said))
    assert len(benches) >= 9 and sorted(benches - named) == []


def test_the_mirror_example_runs_from_any_directory():
    """A user's clone sits beside no `shared/` folder: the example gives an absolute path."""
    examples = re.findall(r"CORPUS_MIRROR=(\S+) make run", README)
    assert examples and all(e.startswith("/") for e in examples), examples


def test_every_command_line_the_readme_shows_needs_only_the_venv_it_says_to_activate():
    assert "source .venv/bin/activate" in README.split("## The pipeline")[0]


CODE_FOLDERS = ("model", "pipeline", "stages", "tools", "bench")


def layout_mentions() -> tuple[set[str], set[str]]:
    """The paths the README's "How the code is laid out" tree names, and its top-level entries.

    A line at column 0 is a top-level entry (`stages/`, `dvc.yaml`), one indented by two spaces an entry
    of the folder above it (a file, or a subfolder such as `core/`), a deeper one continues the description
    before it. A `name.py` in a description is a file of the folder or subfolder it describes;
    `folder/name.py` is a path from the repository root.
    """
    block = README.split("## How the code is laid out", 1)[1].split("```", 2)[1]
    paths, top, folder, here = set(), set(), "", ""
    for line in block.splitlines()[1:]:
        indent, (name, _, text) = len(line) - len(line.lstrip(" ")), line.strip().partition(" ")
        if not name:
            continue
        if indent == 0:
            top.add(name.rstrip("/"))
            folder = here = name if name.endswith("/") else ""
            paths.add(name.rstrip("/"))
        elif indent == 2:
            here = folder + name if name.endswith("/") else folder
            paths.add(folder + name.rstrip("/"))
        else:
            text = line
        for word in re.findall(r"[\w/.-]+\.py\b", text):
            paths.add(word if "/" in word else here + word)
    return paths, top


def test_the_layout_tree_names_every_code_file_and_folder_and_only_what_exists():
    paths, top = layout_mentions()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    folders = {p.split("/", 1)[0] for p in tracked if "/" in p and not p.startswith(".")}
    code = {p for p in tracked if p.endswith(".py") and (p.split("/", 1)[0] in CODE_FOLDERS or "/" not in p)
            and Path(p).name != "__init__.py" and (ROOT / p).is_file()}
    problems = {"top-level folders the tree lacks": sorted(folders - top),
                "code files the tree lacks": sorted(code - paths),
                "names in the tree that do not exist": sorted(p for p in paths if not (ROOT / p).exists())}
    assert not any(problems.values()), problems


def headings(page: Path) -> set[str]:
    """The text of every markdown heading of `page`."""
    return {m.strip() for m in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


SECTION_REFERENCE = re.compile(r"\b(README|docs/[\w-]+\.md), \\?\"([^\"\\]+)\\?\"")


def section_references() -> list[tuple[str, str, str]]:
    """Every (file:line, page, heading) that code, conf, dvc.yaml or the Makefile cite as `(README, "Heading")`."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if not re.search(r"\.(py|ya?ml|toml|cfg|sh)$|(^|/)Makefile$", name) or path.name == "test_readme.py" \
                or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        for m in SECTION_REFERENCE.finditer(text):
            found.append((f"{name}:{text.count(chr(10), 0, m.start()) + 1}", m[1], m[2]))
        # a citation of a page without a quoted heading on the same line cannot be checked: not allowed
        for m in re.finditer(r"\bREADME\b(?!\.md\b)(?!, \\?\")", text):
            found.append((f"{name}:{text.count(chr(10), 0, m.start()) + 1}", "README", "<no quoted heading>"))
    return found


def test_every_section_the_code_cites_is_a_heading_of_the_readme_or_a_docs_page():
    references = section_references()
    if not references:
        pytest.skip("not a git checkout")
    wrong = [f"{where}: {page}, {heading!r}" for where, page, heading in references
             if heading not in headings(ROOT / ("README.md" if page == "README" else page))]
    assert len(references) >= 10 and wrong == [], wrong


def test_every_link_of_the_readme_and_docs_lands_on_a_file_and_heading_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong, checked = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"\w+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            checked += 1
            if not dest.exists():
                wrong.append(f"{page.name}: {target}: no such file")
            elif anchor and anchor not in {slug(h) for h in headings(dest)}:
                wrong.append(f"{page.name}: {target}: no heading with that anchor in {dest.name}")
    assert checked >= 20 and wrong == [], wrong


# --- slow: the DVC commands in a real repo ----------------------------------------------------------------------


def fresh_shell(repo: Path, command: str) -> subprocess.CompletedProcess:
    """`command` in a new bash, as a user runs it after `source .venv/bin/activate` (the venv first on PATH)."""
    env = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": f"{VENV_BIN}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
           "DVC_NO_ANALYTICS": "1", "COLUMNS": "80", "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"],
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=900)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_readme_commands_compare_experiments_and_undo_failed_runs(tiny_run, tmp_path):
    """On a copy of the session's finished tiny run (tests/fixtures/tiny_run.py) made its preset and committed: each
    experiment re-runs translate and evaluate, untracked (PIPELINE_TRACKING=0: nothing here reads an MLflow run;
    tests/training/test_faults.py checks the runs of queued experiments)."""
    repo = copy_run(tiny_run, tmp_path / "repo")
    (repo / ".gitignore").write_text("/data/.cache/\n/mlflow.db\n")
    params = tiny_run.params
    use_preset(repo, params)
    unreachable = yaml.safe_load(yaml.safe_dump(params))  # a preset whose data cannot be had
    for split in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            unreachable["data"][split][0][side]["url"] = f"http://127.0.0.1:{closed_port()}/{split}.{side}"
    (repo / "conf" / "experiment" / "unreachable.yaml").write_text(
        "# @package _global_\n" + yaml.safe_dump(unreachable, sort_keys=False))
    git_commit(repo, "tiny preset")
    env = {**os.environ, "OMP_NUM_THREADS": "1", tracking.ENV: "0"}
    dvc(repo, "exp", "run", "-n", "beam2", "-S", "translate.beam_size=2", env=env)
    dvc(repo, "exp", "run", "-n", "beam1", "-S", "translate.beam_size=1", env=env)

    raw = {str(p.relative_to(repo)) for p in (repo / "data" / "raw").iterdir()}
    assert raw == brace_expand(re.search(r"`(data/raw/\{[^`]*)`", README)[1])
    translations = {str(p.relative_to(repo)) for p in (repo / "data" / "translations").iterdir()}
    assert translations == brace_expand(re.search(r"`(data/translations/\{[^`]*)`", README)[1])

    shown = fresh_shell(repo, readme_command("dvc exp show"))
    assert shown.returncode == 0, shown.stderr
    header, _, *rows = shown.stdout.strip().splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "Experiment", "flops_analytic", "valid_ppl", "bleu", "bleu_tokenized", "translate.beam_size"]
    beams = {re.search(r"\[(\w+)\]", r)[1]: r.strip("|").split("|")[-1].strip() for r in rows if "[" in r}
    assert beams == {"beam1": "1", "beam2": "2"}
    assert "…" not in shown.stdout and "..." not in shown.stdout

    git_commit(repo, "beam 1: the result kept")  # params.yaml, dvc.lock and the metrics, as a user commits them
    undo = readme_command("git checkout params.yaml")
    for override, stage in (("translate.beam_size=0", "translate"), ("experiment=unreachable", "download")):
        failed = dvc_run(repo, "exp", "run", "-S", override, env=env)
        assert failed.returncode != 0
        said = [line for line in (failed.stdout + failed.stderr).splitlines() if line.startswith(f"{stage}: ")]
        assert len(said) == 1 and said[0].startswith(f"{stage}: error: "), failed.stdout + failed.stderr
        assert "Traceback" not in failed.stdout + failed.stderr
        assert subprocess.run(["git", "diff", "--quiet", "params.yaml"], cwd=repo).returncode == 1  # DVC kept it
        back = fresh_shell(repo, undo)
        assert back.returncode == 0, back.stderr
        assert "up to date" in dvc(repo, "status", env=env), override
    assert "cannot get 6 of 6 file(s), so nothing was downloaded" in said[0]
    assert {str(p.relative_to(repo)) for p in (repo / "data" / "raw").iterdir()} == raw
    shutil.rmtree(repo / "data" / ".cache", ignore_errors=True)
