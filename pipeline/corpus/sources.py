"""The download stage's library: the params' corpora checked, fetched, and written as aligned plain text.

    check_params(data)                                   # before any fetch: names, sides and formats that can work
    local = fetch_all(data, cache, mirror, session)      # every file of `data`, sha256 checked (pipeline/corpus/fetch.py)
    check_languages(data, local)                         # each side is the language its params say
    counts = write_split(corpora, local, src, tgt)      # a split's corpora, aligned, one segment a line

stages/download.py runs these in order under one tracked run; the raw formats (plain, gzip, SGML, TSV) are
pipeline/corpus/rawtext.py.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import urllib.parse
from pathlib import Path
from typing import Iterable, Iterator, TextIO

import requests
from pipeline.progress import progress_bar

from pipeline.core.config import DataConfig, FileSource, ParallelCorpus, ParamsError
from pipeline.corpus.fetch import (
    ARCHIVE_SUFFIXES,
    DownloadError,
    Local,
    fetch_file,
    fetch_members,
    is_archive,
    label_of,
)
from pipeline.corpus.formats import SPLITS
from pipeline.corpus.rawtext import Segment, check_segments, read_raw_lines, read_sgm

log = logging.getLogger(__name__)

BLOCK_LINES = 10_000  # lines written at a time
SIDES = ("src", "tgt")


# --- params checks ---------------------------------------------------------------


def iter_sources(data: DataConfig) -> Iterator[tuple[str, ParallelCorpus, str, FileSource]]:
    """(params key, corpus, side, source) for every file the data section names, in order."""
    for split in SPLITS:
        for i, corpus in enumerate(getattr(data, split)):
            for side in SIDES:
                yield f"data.{split}[{i}].{side}", corpus, side, getattr(corpus, side)


def check_params(data: DataConfig) -> None:
    """Refuse, before any download, sources no download could make right; errors name the key.

    Each value's own form (a URL, a member path, a sha256...) is checked when params load (pipeline/core/config.py);
    these are the rules between sources.
    """
    names: set[str] = set()
    pins: dict[tuple[str, str | None], str | None] = {}
    for key, corpus, side, src in iter_sources(data):
        if side == "src":
            if corpus.name in names:
                raise ParamsError(f"{key.rsplit('.', 1)[0]}.name: {corpus.name!r} is used twice; names must be unique")
            names.add(corpus.name)
        if src.member is None and is_archive(src.url):
            raise ParamsError(f"{key}.member: {src.url} is an archive; name the member to use")
        if src.member is not None and not is_archive(src.url):
            raise ParamsError(f"{key}.member: {src.url} is not a {'/'.join(ARCHIVE_SUFFIXES)} archive; expected null")
        if src.sha256 is None and urllib.parse.urlsplit(src.url).scheme == "http":
            raise ParamsError(f"{key}.sha256: {src.url} is plain http, so its sha256 must be pinned (null: https only)")
        if pins.setdefault((src.url, src.member), src.sha256) != src.sha256:
            raise ParamsError(f"{key}.sha256: {src.url} {src.member or ''} is pinned to two different sha256")


# --- fetching (pipeline/corpus/fetch.py does the work) ----------------------------------------


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


# --- reading text (pipeline/corpus/rawtext.py does the work) ----------------------------------


def _format_name(source: FileSource) -> str:
    """The name whose suffixes say the format: the member's, else the URL's."""
    return source.member or urllib.parse.urlsplit(source.url).path


_SET_TAG = re.compile(r"<(srcset|refset|tstset)\b([^>]*)>")
_LANG_ATTR = re.compile(r'\b(srclang|trglang)\s*=\s*"([^"]*)"')
HEADER_LINES = 10  # where an SGML file's <srcset>/<refset> tag is looked for


def check_languages(data: DataConfig, local: dict[FileSource, Local]) -> None:
    """An SGML file's declared language (trglang of a refset, else srclang; "any" passes) must be the side's."""
    for key, _, side, source in iter_sources(data):
        name = _format_name(source)
        if not name.removesuffix(".gz").endswith(".sgm"):
            continue
        lang_key, expected = ("data.src_lang", data.src_lang) if side == "src" else ("data.tgt_lang", data.tgt_lang)
        label = label_of(source, local[source].origin)
        lines = read_raw_lines(local[source].path, name.endswith(".gz"), label)
        with contextlib.closing(lines):
            for n, line in enumerate(itertools.islice(lines, HEADER_LINES), 1):
                if tag := _SET_TAG.search(line):
                    attr = "srclang" if tag[1] == "srcset" else "trglang"
                    declared = dict(_LANG_ATTR.findall(tag[2])).get(attr, "any")
                    if declared not in ("any", expected):
                        raise DownloadError(
                            f"{label}: line {n}: <{tag[1]}> declares {attr}=\"{declared}\" but {key} is "
                            f"the {lang_key} = {expected!r} side; wrong file for this language pair?"
                        )
                    break


def corpus_lines(corpus: ParallelCorpus, local: dict[FileSource, Local]) -> tuple[Iterable[str], Iterable[str]]:
    """The source and target lines of one corpus; two SGML files are matched segment by segment."""
    src, tgt = (_side_lines(source, local[source]) for source in (corpus.src, corpus.tgt))
    if isinstance(src, list) and isinstance(tgt, list):
        check_segments(src, tgt, *(label_of(s, local[s].origin) for s in (corpus.src, corpus.tgt)))
    return _texts(src), _texts(tgt)


def _side_lines(source: FileSource, local: Local) -> Iterable[str] | list[Segment]:
    """A file's lines, or its segments if it is SGML (.sgm, .sgm.gz)."""
    name, label = _format_name(source), label_of(source, local.origin)
    lines = read_raw_lines(local.path, name.endswith(".gz"), label)
    return read_sgm(lines, label) if name.removesuffix(".gz").endswith(".sgm") else lines


def _texts(side: Iterable[str] | list[Segment]) -> Iterable[str]:
    return [s.text for s in side] if isinstance(side, list) else side


def write_lines(f: TextIO, lines: Iterable[str], desc: str) -> int:
    """Write lines with "\\n" endings, a block at a time; return how many."""
    n = odd = 0
    it = iter(lines)
    with progress_bar(desc=desc, unit=" lines", unit_scale=True) as bar:
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
    corpora: Iterable[ParallelCorpus], local: dict[FileSource, Local], src_path: Path, tgt_path: Path
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
                    f"corpus {corpus.name}: {n_src} lines in {label_of(corpus.src, local[corpus.src].origin)} "
                    f"but {n_tgt} in {label_of(corpus.tgt, local[corpus.tgt].origin)}; source and target must "
                    "align line by line"
                )
            if n_src == 0:
                raise DownloadError(
                    f"corpus {corpus.name}: {label_of(corpus.src, local[corpus.src].origin)} and "
                    f"{label_of(corpus.tgt, local[corpus.tgt].origin)} "
                    "have no lines (empty corpus)"
                )
            counts[corpus.name] = n_src
    return counts
