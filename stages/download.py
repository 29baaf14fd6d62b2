"""Download stage: fetch the corpora in params `data`, verify their sha256, write aligned plain text.

    python -m stages.download --out data/raw --metrics metrics/download.json [--params params.yaml] [--cache DIR]

Writes data/raw/{train,valid,test}.{src_lang,tgt_lang}: UTF-8, one segment a line, "\\n"
endings; a split is its corpora concatenated in order. Metrics (flat JSON): lines per split
(`train_lines`, ...) and per corpus (`lines/<corpus>`), and `sha256_seen/<corpus>/<side>` for
every file whose sha256 is not pinned yet, so it can be pinned in conf/data/ from there.

Sources: the official URLs, or the mirror named by the CORPUS_MIRROR environment variable (a
directory or an http(s) base URL). The mirror path of a URL is `<mirror>/<host>/<path>`: a file
there is the download itself; a directory holds the archive's members unpacked at their member
paths. Every source gives the same bytes out. Downloads and extracted members stay in the cache
dir (default `.cache/download` beside --out, outside DVC's output) so a re-run fetches nothing.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import hashlib
import io
import itertools
import logging
import os
import re
import tarfile
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, NamedTuple, TextIO

import requests
import urllib3
from tqdm import tqdm

from stages.config import Corpus, DataConfig, FileSource, ParamsError, load
from stages.corpus import SPLITS
from stages.files import atomic_dir, atomic_file, write_json

log = logging.getLogger(__name__)

MIRROR_ENV = "CORPUS_MIRROR"
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar")
TRIES = 5  # HTTP attempts per file
BACKOFF_S = 1.0  # delay before the first retry, doubled before each next one (tests shrink it)
TIMEOUT_S = (10.0, 60.0)  # connect, read
CHUNK = 1 << 20
BLOCK_LINES = 10_000  # lines written at a time
SIDES = ("src", "tgt")


class DownloadError(RuntimeError):
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
    """Where a FileSource's verified bytes are on disk, and their sha256."""

    path: Path
    sha256: str


@dataclass(frozen=True)
class Segment:
    """One <seg> of a WMT SGML file."""

    docid: str
    segid: str
    text: str


# --- params checks ---------------------------------------------------------------


def iter_sources(data: DataConfig) -> Iterator[tuple[str, Corpus, str, FileSource]]:
    """(params key, corpus, side, source) for every file the data section names, in order."""
    for split in SPLITS:
        for i, corpus in enumerate(getattr(data, split)):
            for side in SIDES:
                yield f"data.{split}[{i}].{side}", corpus, side, getattr(corpus, side)


def _safe_relpath(path: str) -> bool:
    """True for a relative path that stays inside the directory it is joined to."""
    parts = PurePosixPath(path).parts
    return bool(parts) and not path.startswith("/") and ".." not in parts and "\\" not in path


def _url_parts(url: str) -> tuple[str, str]:
    """(host, unquoted path) of an http(s) URL naming a file: the mirror and cache layout."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path).lstrip("/")
    if parts.scheme not in ("http", "https") or not parts.netloc or path.endswith("/") or not _safe_relpath(path):
        raise ValueError(f"not an http(s) URL of a file: {url!r}")
    return parts.netloc, path


def _is_archive(url: str) -> bool:
    return urllib.parse.urlsplit(url).path.lower().endswith(ARCHIVE_SUFFIXES)


def check_params(data: DataConfig) -> None:
    """Refuse, before any download, sources no download could make right; errors name the key."""
    names: set[str] = set()
    pins: dict[tuple[str, str | None], str | None] = {}
    for split in SPLITS:
        if not getattr(data, split):
            raise ParamsError(f"data.{split}: no corpora; expected at least one")
    for key, corpus, side, src in iter_sources(data):
        if side == "src":
            if corpus.name in names:
                raise ParamsError(f"{key.rsplit('.', 1)[0]}.name: {corpus.name!r} is used twice; names must be unique")
            names.add(corpus.name)
        try:
            _url_parts(src.url)
        except ValueError as e:
            raise ParamsError(f"{key}.url: {e}") from None
        if src.member is None and _is_archive(src.url):
            raise ParamsError(f"{key}.member: {src.url} is an archive; name the member to use")
        if src.member is not None and not _is_archive(src.url):
            raise ParamsError(f"{key}.member: {src.url} is not a {'/'.join(ARCHIVE_SUFFIXES)} archive; expected null")
        if src.member is not None and not _safe_relpath(src.member):
            raise ParamsError(
                f"{key}.member: {src.member!r} of archive {src.url} would land outside the extraction "
                "directory (absolute path or '..'); refusing it"
            )
        if src.sha256 is None and urllib.parse.urlsplit(src.url).scheme == "http":
            raise ParamsError(f"{key}.sha256: {src.url} is plain http, so its sha256 must be pinned (null: https only)")
        if src.sha256 is not None and not re.fullmatch("[0-9a-f]{64}", src.sha256):
            raise ParamsError(f"{key}.sha256: expected 64 lowercase hex digits or null, got {src.sha256!r}")
        if pins.setdefault((src.url, src.member), src.sha256) != src.sha256:
            raise ParamsError(f"{key}.sha256: {src.url} {src.member or ''} is pinned to two different sha256")


# --- fetching: cache, mirror, HTTP ---------------------------------------------------


def _label(source: FileSource) -> str:
    return source.url if source.member is None else f"{source.url} member {source.member}"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(path: Path, source: FileSource, delete: bool) -> Local:
    """Check `path` against the source's pinned sha256; on a mismatch delete it (if `delete`) and raise."""
    seen = sha256_of(path)
    if source.sha256 is None:
        log.warning("sha256 NOT PINNED for %s: saw %s; nothing verifies it; pin it in params.", _label(source), seen)
    elif seen != source.sha256:
        if delete:
            path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{_label(source)}: sha256 mismatch: expected {source.sha256}, got {seen}"
            + (f" (deleted {path})" if delete else f" (in {path})")
        )
    return Local(path, seen)


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
        with open(part, "ab" if have else "wb") as f, tqdm(
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
        if attempt == TRIES:
            kept = f" (partial file kept, a re-run resumes it: {part})" if part.exists() else ""
            raise DownloadError(f"{url}: failed after {TRIES} tries: {reason}{kept}")
        delay = BACKOFF_S * 2 ** (attempt - 1)
        log.warning("%s: %s; retry %d of %d in %.1f s", url, reason, attempt, TRIES - 1, delay)
        time.sleep(delay)


def mirror_from_env() -> str | None:
    """CORPUS_MIRROR: an http(s) base URL, an existing directory, or unset."""
    mirror = os.environ.get(MIRROR_ENV) or None
    if mirror and not _is_url(mirror) and not Path(mirror).is_dir():
        raise DownloadError(f"{MIRROR_ENV}={mirror}: not a directory or an http(s) base URL")
    return mirror


def _is_url(mirror: str) -> bool:
    return mirror.startswith(("http://", "https://"))


def _mirror_url(mirror: str, url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def _mirror_path(mirror: str, url: str) -> Path:
    host, path = _url_parts(url)
    return Path(mirror) / host / path


def _try_mirror(mirror_url: str, dest: Path, session: requests.Session) -> bool:
    """Download from the http mirror; False (with a warning) if the mirror has no such file."""
    try:
        download(mirror_url, dest, session)
        return True
    except NotFound:
        log.warning("%s: not in the %s; using the official URL", mirror_url, MIRROR_ENV)
        return False


def fetch_file(source: FileSource, cache: Path, mirror: str | None, session: requests.Session) -> Local:
    """The verified local copy of a plain (non-archive) source: mirror dir, else cache, else download."""
    if mirror and not _is_url(mirror):
        local = _mirror_path(mirror, source.url)
        if local.is_file():
            log.info("%s: from %s", source.url, local)
            return verify(local, source, delete=False)
        log.warning("%s: no file %s in %s=%s; downloading it", source.url, local, MIRROR_ENV, mirror)
    host, path = _url_parts(source.url)
    dest = cache / "files" / host / path
    if dest.exists():
        try:
            return verify(dest, source, delete=True)
        except ChecksumError as e:
            log.warning("stale cache, downloading again: %s", e)
    if not (mirror and _is_url(mirror) and _try_mirror(_mirror_url(mirror, source.url), dest, session)):
        download(source.url, dest, session)
    return verify(dest, source, delete=True)


def fetch_members(
    url: str, sources: list[FileSource], cache: Path, mirror: str | None, session: requests.Session
) -> dict[FileSource, Local]:
    """Verified local copies of members of one archive URL: mirror, cache, or one extraction pass."""
    label = f"{url} (archive)"
    host, path = _url_parts(url)
    archive: Path | None = None  # set if the mirror holds the archive file itself
    if mirror and not _is_url(mirror):
        root = _mirror_path(mirror, url)
        if root.is_dir():  # the members, unpacked
            log.info("%s: members from %s", url, root)
            missing = [s.member for s in sources if not (root / s.member).is_file()]
            if missing:
                raise DownloadError(f"{label}: member(s) {missing} missing from the mirror directory {root}")
            return {s: verify(root / s.member, s, delete=False) for s in sources}
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
    if todo and mirror and _is_url(mirror):
        for s in todo:
            member_url = f"{_mirror_url(mirror, url)}/{urllib.parse.quote(s.member)}"
            if _try_mirror(member_url, members / s.member, session):
                out[s] = verify(members / s.member, s, delete=True)
        todo = [s for s in sources if s not in out]
    if todo:
        cached = archive is None
        if cached:
            archive = cache / "files" / host / path
            if not archive.exists():
                download(url, archive, session)
        extract_members(archive, [s.member for s in todo], members, label)
        for s in todo:
            try:
                out[s] = verify(members / s.member, s, delete=True)
            except ChecksumError:
                if cached:  # nothing kept: the archive it came from goes too
                    archive.unlink(missing_ok=True)
                raise
    return out


def fetch_all(data: DataConfig, cache: Path, mirror: str | None, session: requests.Session) -> dict[FileSource, Local]:
    """Fetch and verify every source, one URL at a time (an archive is read once for all its members)."""
    by_url: dict[str, list[FileSource]] = {}
    for _, _, _, source in iter_sources(data):
        if source not in by_url.setdefault(source.url, []):
            by_url[source.url].append(source)
    local: dict[FileSource, Local] = {}
    for url, sources in by_url.items():
        if sources[0].member is None:
            local[sources[0]] = fetch_file(sources[0], cache, mirror, session)
        else:
            local.update(fetch_members(url, sources, cache, mirror, session))
    return local


# --- archives ---------------------------------------------------------------------


def _check_member(info: tarfile.TarInfo, dest: Path, label: str) -> None:
    """Refuse links, non-files and paths that would leave `dest`."""
    if info.issym() or info.islnk():
        kind = "symlink" if info.issym() else "hard link"
        raise DownloadError(f"{label}: member {info.name} is a {kind} (to {info.linkname}); refusing to extract links")
    if not info.isfile():
        raise DownloadError(f"{label}: member {info.name} is not a regular file; refusing it")
    if not _safe_relpath(info.name):
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
                with tar.extractfile(info) as src, atomic_file(dest / name) as dst, tqdm(
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


# --- reading text -----------------------------------------------------------------


def _format_name(source: FileSource) -> str:
    """The name whose suffixes say the format: the member's, else the URL's."""
    return source.member or urllib.parse.urlsplit(source.url).path


def read_lines(path: Path, gz: bool, label: str) -> Iterator[str]:
    """Lines of a strict UTF-8 file (gunzipped if `gz`), without BOM or "\\n"/"\\r\\n" endings."""
    try:
        with io.BufferedReader(gzip.open(path, "rb"), CHUNK) if gz else open(path, "rb", CHUNK) as f:
            for n, raw in enumerate(f, 1):
                raw = raw.removesuffix(b"\n").removesuffix(b"\r")
                if n == 1:
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad = raw[max(0, e.start - 20) : e.end + 20]
                    message = f"{label}: line {n}: invalid UTF-8 at byte {e.start} ({e.reason}): {bad!r}"
                    raise DownloadError(message) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DownloadError(f"{label}: corrupt or truncated gzip: {e}") from None


_SEG_ID = re.compile(r'<seg\s[^>]*?\bid\s*=\s*"?([^"\s>]+)')
_SEG_TEXT = re.compile(r"<seg.*?>(.*)</seg>.*?")  # sacrebleu's FakeSGMLDataset, verbatim
_DOCID = re.compile(r'\bdocid\s*=\s*"([^"]*)"')


def read_sgm(lines: Iterable[str], label: str) -> list[Segment]:
    """The <seg> lines of a WMT SGML file in document order, as sacrebleu reads them (no entity unescaping)."""
    docid, segments = "", []
    for n, line in enumerate(lines, 1):
        if line.startswith("<doc "):
            match = _DOCID.search(line)
            docid = match[1] if match else ""
        elif line.startswith("<seg "):
            match = _SEG_ID.match(line)
            if match is None or "</seg>" not in line:
                raise DownloadError(f"{label}: line {n}: expected <seg id=N>text</seg> on one line, got {line[:80]!r}")
            text = re.sub(r"\s+", " ", _SEG_TEXT.sub(r"\1", line).strip())  # sacrebleu's Dataset._clean
            segments.append(Segment(docid, match[1], text))
    return segments


def check_segments(src: list[Segment], ref: list[Segment], src_label: str, ref_label: str) -> None:
    """Source and reference must hold the same (docid, segid) pairs, each once, in the same order."""
    keys: dict[str, list[tuple[str, str]]] = {}
    for segs, label in ((src, src_label), (ref, ref_label)):
        keys[label] = [(s.docid, s.segid) for s in segs]
        if len(set(keys[label])) != len(segs):
            d, i = next(k for n, k in enumerate(keys[label]) if k in keys[label][:n])
            raise DownloadError(f"{label}: segment docid={d!r} segid={i} appears twice")
    for has, lacks in ((src_label, ref_label), (ref_label, src_label)):
        there = set(keys[lacks])
        missing = [k for k in keys[has] if k not in there]
        if missing:
            d, i = missing[0]
            raise DownloadError(f"{lacks}: no segment docid={d!r} segid={i} ({len(missing)} missing), which {has} has")
    for n, (a, b) in enumerate(zip(keys[src_label], keys[ref_label]), 1):
        if a != b:
            raise DownloadError(
                f"{src_label} and {ref_label}: segment {n} is docid={a[0]!r} segid={a[1]} in the first, "
                f"docid={b[0]!r} segid={b[1]} in the second"
            )


def corpus_lines(corpus: Corpus, local: dict[FileSource, Local]) -> tuple[Iterable[str], Iterable[str]]:
    """The source and target lines of one corpus; two SGML files are matched segment by segment."""
    src, tgt = (_side_lines(source, local[source].path) for source in (corpus.src, corpus.tgt))
    if isinstance(src, list) and isinstance(tgt, list):
        check_segments(src, tgt, _label(corpus.src), _label(corpus.tgt))
    return _texts(src), _texts(tgt)


def _side_lines(source: FileSource, path: Path) -> Iterable[str] | list[Segment]:
    """A file's lines, or its segments if it is SGML (.sgm, .sgm.gz)."""
    name = _format_name(source)
    lines = read_lines(path, name.endswith(".gz"), _label(source))
    return read_sgm(lines, _label(source)) if name.removesuffix(".gz").endswith(".sgm") else lines


def _texts(side: Iterable[str] | list[Segment]) -> Iterable[str]:
    return [s.text for s in side] if isinstance(side, list) else side


def write_lines(f: TextIO, lines: Iterable[str], desc: str) -> int:
    """Write lines with "\\n" endings, a block at a time; return how many."""
    n = odd = 0
    it = iter(lines)
    with tqdm(desc=desc, unit=" lines", unit_scale=True) as bar:
        while block := list(itertools.islice(it, BLOCK_LINES)):
            text = "\n".join(block) + "\n"
            f.write(text)
            odd += len(text.splitlines()) - len(block)  # breaks str.splitlines() sees besides "\n"
            n += len(block)
            bar.update(len(block))
    if odd:
        log.warning("%s: %d line breaks other than \\n inside lines (\\r, \\u2028, ...); kept as-is", desc, odd)
    return n


def write_split(
    corpora: Iterable[Corpus], local: dict[FileSource, Local], src_path: Path, tgt_path: Path
) -> dict[str, int]:
    """Write one split, its corpora concatenated; return lines per corpus."""
    counts: dict[str, int] = {}
    with open(src_path, "w", encoding="utf-8", newline="\n") as fs, open(
        tgt_path, "w", encoding="utf-8", newline="\n"
    ) as ft:
        for corpus in corpora:
            src_lines, tgt_lines = corpus_lines(corpus, local)
            n_src = write_lines(fs, src_lines, f"{corpus.name} src")
            n_tgt = write_lines(ft, tgt_lines, f"{corpus.name} tgt")
            if n_src != n_tgt:
                raise DownloadError(
                    f"corpus {corpus.name}: {n_src} lines in {_label(corpus.src)} but {n_tgt} in {_label(corpus.tgt)}; "
                    "source and target must align line by line"
                )
            if n_src == 0:
                raise DownloadError(
                    f"corpus {corpus.name}: {_label(corpus.src)} and {_label(corpus.tgt)} have no lines (empty corpus)"
                )
            counts[corpus.name] = n_src
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (data/raw)")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--cache", type=Path, help="download cache (default: .cache/download beside --out)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    data = load(args.params, "data", DataConfig)
    check_params(data)
    mirror = mirror_from_env()
    cache = args.cache or args.out.parent / ".cache" / "download"
    with requests.Session() as session:
        local = fetch_all(data, cache, mirror, session)

    metrics: dict[str, int | str] = {}
    with atomic_dir(args.out) as tmp:
        for split in SPLITS:
            langs = (data.src_lang, data.tgt_lang)
            counts = write_split(getattr(data, split), local, *(tmp / f"{split}.{lang}" for lang in langs))
            metrics[f"{split}_lines"] = sum(counts.values())
            metrics.update({f"lines/{name}": n for name, n in counts.items()})
            log.info("%s: %d lines (%s)", split, sum(counts.values()), ", ".join(f"{k} {v}" for k, v in counts.items()))
        for _, corpus, side, source in iter_sources(data):
            if source.sha256 is None:
                metrics[f"sha256_seen/{corpus.name}/{side}"] = local[source].sha256
        write_json(args.metrics, metrics)  # inside atomic_dir: a failure here keeps the old data/raw too


if __name__ == "__main__":
    main()
