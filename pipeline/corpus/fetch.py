"""Fetch corpus files: HTTP with resume, retries and backoff, the CORPUS_MIRROR mirror, a cache, safe tar extraction.

A source is an http(s) URL, optionally with a member of the tar archive it names. The mirror path
of a URL is `<mirror>/<host>/<path>` (a directory or an http(s) base URL): a file there is the
download itself (an archive as it is); a directory holds the archive's members unpacked at their
member paths. An http mirror is asked for the members first, then for the archive. The cache
keeps downloads at `<cache>/files/<host>/<path>` and extracted members at
`<cache>/members/<host>/<path>/<member>`. Every source gives the same bytes, checked by sha256.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import tarfile
import time
import urllib.parse
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterable, NamedTuple

import requests
import urllib3
from pipeline.progress import progress_bar

from pipeline.core.config import FileSource, safe_relpath, url_parts
from pipeline.core.errors import PipelineError
from pipeline.core.files import OutputError, atomic_file

log = logging.getLogger(__name__)

MIRROR_ENV = "CORPUS_MIRROR"
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar")
TRIES = 5  # HTTP attempts per file
BACKOFF_S = 1.0  # delay before the first retry, doubled before each next one (tests shrink it)
TIMEOUT_S = (10.0, 60.0)  # connect, read
HEAD_TIMEOUT_S = (5.0, 10.0)  # the availability check before any download
CHUNK = 1 << 20



class DownloadError(PipelineError):
    """A corpus could not be fetched, verified or read; the message names the file."""


class ChecksumError(DownloadError):
    """A file's sha256 differs from the pinned one."""


class NotFound(DownloadError):
    """The server has no such file (HTTP 404/410)."""


class _Transient(Exception):
    """A failure worth retrying (5xx, 429, a resume the server got wrong)."""


_RETRYABLE = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    _Transient,
)


class Local(NamedTuple):
    """Where a FileSource's verified bytes are on disk, their sha256, and the mirror file or URL they came from."""

    path: Path
    sha256: str
    origin: str | None = None  # set when CORPUS_MIRROR supplied the bytes: what was actually read


# --- URLs and paths ---------------------------------------------------------------


def is_archive(url: str) -> bool:
    """True if the URL names a tar archive (by its suffix)."""
    return urllib.parse.urlsplit(url).path.lower().endswith(ARCHIVE_SUFFIXES)


def label_of(source: FileSource, origin: str | None = None) -> str:
    """How messages name a source: its URL, the member if it has one, and the mirror copy read instead, if any."""
    label = source.url if source.member is None else f"{source.url} member {source.member}"
    return label if origin is None else f"{label} (read from {MIRROR_ENV} copy {origin})"


# --- fetching: cache, mirror, HTTP ---------------------------------------------------


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(path: Path, source: FileSource, delete: bool, origin: str | None = None) -> Local:
    """Check `path` (from the mirror's `origin`, if given) against the source's pinned sha256; on a mismatch
    delete it (if `delete`) and raise."""
    seen = sha256_of(path)
    label = label_of(source, origin)
    if source.sha256 is None:
        log.warning("sha256 NOT PINNED for %s: saw %s; nothing verifies it; pin it in params.", label, seen)
    elif seen != source.sha256:
        if delete:
            path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{label}: sha256 mismatch: expected {source.sha256}, got {seen}"
            + (f" (deleted {path})" if delete else f" (in {path})")
        )
    return Local(path, seen, origin)


def _content_range(value: str) -> tuple[int, int | None]:
    """(first byte, total size or None) of a 206 response's Content-Range header."""
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", value.strip())
    if match is None:
        raise _Transient(f"unreadable Content-Range {value!r}; restarting")
    return int(match[1]), None if match[2] == "*" else int(match[2])


def _fetch_once(url: str, part: Path, session: requests.Session) -> bool:
    """One GET of `url` into `part`, resuming it with a Range request; True if the body came whole."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"Accept-Encoding": "identity"} | ({"Range": f"bytes={have}-"} if have else {})
    with session.get(url, headers=headers, stream=True, timeout=TIMEOUT_S) as r:
        if r.status_code in (404, 410):
            raise NotFound(f"{url}: HTTP {r.status_code} {r.reason}")
        if r.status_code == 416 and have:  # the partial file is no prefix the server can resume
            part.unlink()
            raise _Transient("HTTP 416 on resume; restarting")
        if r.status_code == 429 or r.status_code >= 500:
            raise _Transient(f"HTTP {r.status_code} {r.reason}")
        if r.status_code not in (200, 206):
            raise DownloadError(f"{url}: HTTP {r.status_code} {r.reason}")
        if r.status_code == 206:
            start, total = _content_range(r.headers.get("Content-Range", ""))
            if start != have:
                part.unlink(missing_ok=True)
                raise _Transient(f"server resumed at byte {start}, not {have}; restarting")
        else:
            if have:
                log.info("%s: server ignored the Range request; restarting from byte 0", url)
            have, total = 0, int(r.headers["Content-Length"]) if "Content-Length" in r.headers else None
        name = PurePosixPath(urllib.parse.urlsplit(url).path).name
        with open(part, "ab" if have else "wb") as f, progress_bar(
            desc=name, total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024
        ) as bar:
            for chunk in r.raw.stream(CHUNK, decode_content=False):  # the bytes as served, never decoded
                f.write(chunk)
                bar.update(len(chunk))
    return total is None or part.stat().st_size == total


def download(url: str, dest: Path, session: requests.Session) -> None:
    """Stream `url` to `dest` atomically via `dest.part`, resuming and retrying with exponential backoff."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    log.info("downloading %s", url)
    for attempt in range(1, TRIES + 1):
        try:
            if _fetch_once(url, part, session):
                os.replace(part, dest)
                return
            reason = "connection closed before the whole body came"
        except _RETRYABLE as e:
            reason = str(e)
        except OSError as e:  # the disk, not the network: no retry, and name the file
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise OutputError(e.errno, f"could not write {part}: {e.strerror}") from e
        if attempt == TRIES:
            kept = f" (partial file kept, a re-run resumes it: {part})" if part.exists() else ""
            raise DownloadError(f"{url}: failed after {TRIES} tries: {reason}{kept}")
        delay = BACKOFF_S * 2 ** (attempt - 1)
        log.warning("%s: %s; retry %d of %d in %.1f s", url, reason, attempt, TRIES - 1, delay)
        time.sleep(delay)


def mirror_from_env() -> str | None:
    """CORPUS_MIRROR: an http(s) base URL, an existing directory, or unset."""
    mirror = os.environ.get(MIRROR_ENV) or None
    if mirror and not _is_http_mirror(mirror) and not Path(mirror).is_dir():
        raise DownloadError(f"{MIRROR_ENV}={mirror}: not a directory or an http(s) base URL")
    return mirror


def _is_http_mirror(mirror: str) -> bool:
    """True for an http(s) mirror, False for a mirror directory."""
    return mirror.startswith(("http://", "https://"))


def _mirror_url(mirror: str, url: str) -> str:
    """Where an http mirror serves `url`."""
    parts = urllib.parse.urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def _mirror_path(mirror: str, url: str) -> Path:
    """Where a mirror directory holds `url` (the file, or the archive's members unpacked)."""
    host, path = url_parts(url)
    return Path(mirror) / host / path


def _try_mirror(url: str, mirror_url: str, dest: Path, session: requests.Session, otherwise: str = "the official URL"
                ) -> bool:
    """Download `url` from the http mirror; False (with a warning naming what comes next) if it has no such file."""
    try:
        download(mirror_url, dest, session)
        return True
    except NotFound:
        log.warning("%s: not in the %s; using %s", mirror_url, MIRROR_ENV, otherwise)
        return False
    except DownloadError as e:
        raise DownloadError(f"{url} (from {MIRROR_ENV}): {e}") from None


def fetch_file(source: FileSource, cache: Path, mirror: str | None, session: requests.Session) -> Local:
    """The verified local copy of a plain (non-archive) source: mirror dir, else cache, else download."""
    if mirror and not _is_http_mirror(mirror):
        local = _mirror_path(mirror, source.url)
        if local.is_file():
            log.info("%s: from %s", source.url, local)
            return verify(local, source, delete=False, origin=str(local))
        log.warning("%s: no file %s in %s=%s; downloading it", source.url, local, MIRROR_ENV, mirror)
    host, path = url_parts(source.url)
    dest = cache / "files" / host / path
    if dest.exists():
        try:
            return verify(dest, source, delete=True)
        except ChecksumError as e:
            log.warning("stale cache, downloading again: %s", e)
    origin = _mirror_url(mirror, source.url) if mirror and _is_http_mirror(mirror) else None
    if not (origin and _try_mirror(source.url, origin, dest, session)):
        origin = None
        download(source.url, dest, session)
    return verify(dest, source, delete=True, origin=origin)


def fetch_members(
    url: str, sources: list[FileSource], cache: Path, mirror: str | None, session: requests.Session
) -> dict[FileSource, Local]:
    """Verified local copies of members of one archive URL: mirror, cache, or one extraction pass."""
    label = f"{url} (archive)"
    host, path = url_parts(url)
    archive: Path | None = None  # set if the mirror holds the archive file itself
    if mirror and not _is_http_mirror(mirror):
        root = _mirror_path(mirror, url)
        if root.is_dir():  # the members, unpacked
            log.info("%s: members from %s", url, root)
            missing = [s.member for s in sources if not (root / s.member).is_file()]
            if missing:
                raise DownloadError(f"{label}: member(s) {missing} missing from the mirror directory {root}")
            return {s: verify(root / s.member, s, delete=False, origin=str(root / s.member)) for s in sources}
        if root.is_file():
            archive = root
        else:
            log.warning("%s: nothing at %s in %s=%s; downloading it", url, root, MIRROR_ENV, mirror)
    members = cache / "members" / host / path
    out: dict[FileSource, Local] = {}
    for s in sources:
        if (members / s.member).exists():
            try:
                out[s] = verify(members / s.member, s, delete=True)
            except ChecksumError as e:  # the cached archive it came from is suspect too
                log.warning("stale cache, fetching again: %s", e)
                (cache / "files" / host / path).unlink(missing_ok=True)
    todo = [s for s in sources if s not in out]
    origin = None  # the http mirror's copy of the archive, if extracted from it
    if todo and mirror and _is_http_mirror(mirror):
        for s in todo:
            member_url = f"{_mirror_url(mirror, url)}/{urllib.parse.quote(s.member)}"
            if _try_mirror(label_of(s), member_url, members / s.member, session, "its archive, from the mirror or the official URL"):
                out[s] = verify(members / s.member, s, delete=True, origin=member_url)
        todo = [s for s in sources if s not in out]
        if todo and not (cache / "files" / host / path).exists() and _mirror_has_file(_mirror_url(mirror, url), session):
            download(_mirror_url(mirror, url), cache / "files" / host / path, session)  # the archive as it is
            origin = _mirror_url(mirror, url)
    if todo:
        cached = archive is None
        if cached:
            archive = cache / "files" / host / path
            if not archive.exists():
                download(url, archive, session)
        extract_members(archive, [s.member for s in todo], members,
                        f"{label} from {origin}" if origin else label if cached else f"{label} from {archive}")
        for s in todo:
            try:
                out[s] = verify(members / s.member, s, delete=True, origin=origin or (None if cached else str(archive)))
            except ChecksumError:
                if cached:  # nothing kept: the archive it came from goes too
                    archive.unlink(missing_ok=True)
                raise
    return out


# --- before anything: can every file be had? ---------------------------------------


def _why_not(url: str, session: requests.Session) -> str | None:
    """Why a HEAD request says `url` cannot be downloaded now, or None (it can, or a retry may: 5xx, 429...)."""
    try:
        r = session.head(url, allow_redirects=True, timeout=HEAD_TIMEOUT_S, headers={"Accept-Encoding": "identity"})
    except requests.RequestException as e:  # no connection: DNS, refused, unreachable, timeout
        reason = re.findall(r"\[Errno -?\d+\] ([^'\")\]]+)", str(e))
        return f"{url}: {reason[-1].strip() if reason else type(e).__name__}"
    return f"{url}: HTTP {r.status_code} {r.reason}" if r.status_code in (401, 403, 404, 410) else None


def _mirror_has_file(url: str, session: requests.Session) -> bool:
    """Whether an http mirror serves a file at `url` (200 without a redirect: a directory redirects to `url/`)."""
    try:
        return session.head(url, allow_redirects=False, timeout=HEAD_TIMEOUT_S,
                            headers={"Accept-Encoding": "identity"}).status_code == 200
    except requests.RequestException:
        return False


def _unavailable(url: str, members: list[str], cache: Path, mirror: str | None, session: requests.Session) -> str | None:
    """Why `url` (or these members of it) can be had from neither the cache, the mirror nor the network, or None."""
    host, path = url_parts(url)
    if (cache / "files" / host / path).exists() or members and all((cache / "members" / host / path / m).exists()
                                                                   for m in members):
        return None
    if mirror and not _is_http_mirror(mirror) and _mirror_path(mirror, url).exists():
        return None  # a mirror directory missing some members is refused, naming them, when fetched
    if mirror and _is_http_mirror(mirror):
        mirrored = [f"{_mirror_url(mirror, url)}/{urllib.parse.quote(m)}" for m in members] or [_mirror_url(mirror, url)]
        problems = [why for m in mirrored if (why := _why_not(m, session))]
        if members and problems and _mirror_has_file(_mirror_url(mirror, url), session):
            problems = []  # the archive itself is there
        if not problems:
            return None
        if not all(re.search(r": HTTP (404|410) ", why) for why in problems):  # a mirror that fails is no fallback
            return f"{url}: {MIRROR_ENV} {problems[0]}"
    return _why_not(url, session)


def check_available(sources: list[FileSource], cache: Path, mirror: str | None, session: requests.Session) -> None:
    """Refuse, before downloading or writing anything, when any source can be had from nowhere (one HEAD per URL)."""
    by_url: dict[str, list[str]] = {}
    for s in sources:
        by_url.setdefault(s.url, []).extend([s.member] if s.member else [])
    problems = [why for url, members in by_url.items() if (why := _unavailable(url, members, cache, mirror, session))]
    if problems:
        raise DownloadError(
            f"cannot get {len(problems)} of {len(by_url)} file(s), so nothing was downloaded or changed: "
            f"{'; '.join(problems)}; without network access, set {MIRROR_ENV} to a mirror holding them "
            "(README, \"Offline mirror\")"
        )


# --- archives ---------------------------------------------------------------------


def _check_member(info: tarfile.TarInfo, dest: Path, label: str) -> None:
    """Refuse links, non-files and paths that would leave `dest`."""
    if info.issym() or info.islnk():
        kind = "symlink" if info.issym() else "hard link"
        raise DownloadError(f"{label}: member {info.name} is a {kind} (to {info.linkname}); refusing to extract links")
    if not info.isfile():
        raise DownloadError(f"{label}: member {info.name} is not a regular file; refusing it")
    if not safe_relpath(info.name):
        raise DownloadError(f"{label}: member {info.name} would land outside {dest} (path traversal); refusing it")
    try:
        tarfile.data_filter(info, str(dest))  # Python's own safety rules for extraction, on top of ours
    except tarfile.FilterError as e:
        raise DownloadError(f"{label}: member {info.name}: {e}; refusing it") from None


def extract_members(archive: Path, names: Iterable[str], dest: Path, label: str) -> None:
    """Extract the named regular-file members of a tar archive to dest/<name> in one streaming pass."""
    wanted = set(names)
    log.info("extracting %s from %s", sorted(wanted), archive)
    try:
        with tarfile.open(archive, "r|*") as tar:
            for info in tar:
                name = info.name.removeprefix("./")
                if name not in wanted:
                    continue
                _check_member(info, dest, label)
                wanted.discard(name)
                with tar.extractfile(info) as src, atomic_file(dest / name) as dst, progress_bar(
                    desc=PurePosixPath(name).name, total=info.size, unit="B", unit_scale=True, unit_divisor=1024
                ) as bar:
                    while chunk := src.read(CHUNK):
                        dst.write(chunk)
                        bar.update(len(chunk))
                if not wanted:
                    break
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DownloadError(f"{label}: corrupt or truncated archive {archive}: {e}") from None
    if wanted:
        raise DownloadError(f"{label}: no member(s) {sorted(wanted)} in the archive")
