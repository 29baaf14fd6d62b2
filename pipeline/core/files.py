"""Files: atomic outputs (a killed or failing stage leaves the old output or the new one, never half), input errors.

Every stage writes through these helpers. A file is written to a temporary
sibling, flushed and fsynced, then renamed over the target; a directory is
built as a temporary sibling and swapped in whole. Errors (ENOSPC included)
propagate with the target's name, and the temporary is removed.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

SEAL_SUFFIX = ".sha256"  # a file's seal beside it: `sha256  name`, sha256sum's format (checkpoints, model.pt)
CHUNK_LINES = 100_000  # text lines decoded at a time (read_chunks): memory bounded whatever the file's size


class OutputError(PipelineError, OSError):
    """Writing an output failed; the previous output, if any, is untouched."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message, without "[Errno 28]"


class InputError(PipelineError, ValueError):
    """An input file is missing or malformed; the message names the file (and line) and what was expected."""


def _as_output_error(e: BaseException, path: Path, tmp: Path) -> BaseException:
    """An OSError met while writing `path` (via `tmp`) as an OutputError naming `path`; any other error unchanged.

    An OSError naming a file outside the output (an input that could not be read) is not a write failure.
    """
    if not isinstance(e, OSError) or isinstance(e, OutputError):
        return e
    if e.filename is not None:
        name = Path(os.path.abspath(os.fsdecode(e.filename)))
        if not any(name == p or p in name.parents for p in (Path(os.path.abspath(q)) for q in (path, tmp))):
            return e
    return OutputError(e.errno, f"could not write {path}: {e.strerror or e}")


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read 4 MiB at a time."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def sidecar(path: Path) -> Path:
    """The seal of `path`: `<name>.sha256` beside it."""
    return path.with_name(path.name + SEAL_SUFFIX)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator:
    """Open a temporary sibling of `path` for writing; rename it over `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes owner-only files; outputs are ordinary files
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if (error := _as_output_error(e, path, Path(tmp))) is e:
            raise
        raise error from e


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json(path: str | Path, obj: object) -> None:
    """Write flat metrics (or any JSON) atomically, keys sorted, one per line."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _recover(path: Path) -> None:
    """Undo what a killed atomic_dir(path) left: `.<name>.old` put back where `path` is missing (killed between the
    two renames), else deleted; its `.<name>.*.tmp` folders (killed while writing) deleted. Each logged."""
    old = path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():
        log.warning("restoring %s from %s, left by an interrupted run", path, old)
        os.replace(old, path)
    elif old.exists():
        shutil.rmtree(old, ignore_errors=True)
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if tmp.is_dir() and not tmp.is_symlink():
            log.warning("removing %s, left by an interrupted run", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `path` whole.

    On any error the temporary directory is deleted and `path` is left as it was; what a kill left is undone first
    (_recover).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OutputError) and str(tmp) in str(e):  # a file written inside: named where it was going
            raise OutputError(e.errno, str(e).replace(str(tmp), str(path))) from e
        if (error := _as_output_error(e, path, tmp)) is e:
            raise
        raise error from e


def read_chunks(path: Path, chunk_lines: int = CHUNK_LINES, limit: int | None = None) -> Iterator[list[str]]:
    """The lines of a UTF-8 text file (split at "\\n" only), without newlines, `chunk_lines` at a time, the first
    `limit` only if given: a WMT-size corpus is never held whole. Invalid UTF-8 raises InputError naming the line."""
    start = 0
    with open(path, "rb") as f:
        lines = f if limit is None else itertools.islice(f, limit)
        while chunk := list(itertools.islice(lines, chunk_lines)):
            try:
                decoded = [line.rstrip(b"\n").decode("utf-8") for line in chunk]
            except UnicodeDecodeError:
                bad, e = next((i, e) for i, e in enumerate(map(_utf8_error, chunk)) if e is not None)
                raise InputError(f"{path}:{start + bad + 1}: not valid UTF-8 ({e.reason})") from None
            yield decoded
            start += len(chunk)


def _utf8_error(line: bytes) -> UnicodeDecodeError | None:
    try:
        line.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return e


def count_lines(path: Path) -> int:
    """Lines in a UTF-8 text file (a last line without a newline counts); raises InputError naming the first bad line."""
    decoder, n, last = codecs.getincrementaldecoder("utf-8")(), 0, b"\n"
    with open(path, "rb") as f:
        for block in itertools.chain(iter(lambda: f.read(1 << 20), b""), [b""]):
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                line = n + block.count(b"\n", 0, e.start) + 1
                raise InputError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
            n += block.count(b"\n")
            last = block[-1:] or last
    return n + (last != b"\n")
