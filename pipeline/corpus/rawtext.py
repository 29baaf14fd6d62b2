"""Reading the downloaded corpus files: strict UTF-8 lines, and the segments of WMT SGML files.

    lines = read_raw_lines(path, gz, label)     # lazily, without BOM or line endings; errors name `label` and the line
    text = decode_line(raw, first)              # one line by the same rule (stages.translate --stdin)
    segments = read_sgm(lines, label)           # [Segment(docid, segid, text)], as sacrebleu reads them
    check_segments(src, ref, src_label, ref_label)   # the two sides hold the same segments in the same order

Every error is a DownloadError naming the file (`label`: the official URL, or
the mirror file read) and the line.
"""

from __future__ import annotations

import codecs
import gzip
import io
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.corpus.fetch import CHUNK, DownloadError


@dataclass(frozen=True)
class Segment:
    """One <seg> of a WMT SGML file."""

    docid: str
    segid: str
    text: str


def decode_line(raw: bytes, first: bool = False) -> str:
    """One line of strict UTF-8 text, without its "\\n" or "\\r\\n" ending (and, if `first`, a BOM). Invalid UTF-8
    raises ValueError `invalid UTF-8 at byte <i> (<reason>): <the bytes around it>`, which callers prefix with
    the file (or stream) and line: the one rule for every text the pipeline reads line by line."""
    raw = raw.removesuffix(b"\n").removesuffix(b"\r")
    if first:
        raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[max(0, e.start - 20) : e.end + 20]
        raise ValueError(f"invalid UTF-8 at byte {e.start} ({e.reason}): {bad!r}") from None


def read_raw_lines(path: Path, gz: bool, label: str) -> Iterator[str]:
    """Lines of a strict UTF-8 file (gunzipped if `gz`), without BOM or "\\n"/"\\r\\n" endings."""
    try:
        with io.BufferedReader(gzip.open(path, "rb"), CHUNK) if gz else open(path, "rb", CHUNK) as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = decode_line(raw, first=n == 1)
                except ValueError as e:
                    raise DownloadError(f"{label}: line {n}: {e}") from None
                yield line
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DownloadError(f"{label}: corrupt or truncated gzip: {e}") from None


# Why not sacrebleu's reader: its public API (DATASETS[...].source/references) reads only what its own
# downloader put in ~/.sacrebleu (the whole archive, by urllib), which the mirror (members, not archives),
# the cache and the sha256 pins cannot serve; the function underneath is private, writes a file and drops
# the doc and segment ids that check_segments needs. test_download.py::test_sgml_text_matches_sacrebleu
# keeps our text equal to sacrebleu's on a fixture.
_SEG_ID = re.compile(r'<seg\s[^>]*?\bid\s*=\s*"?([^"\s>]+)')
_DOCID = re.compile(r'\bdocid\s*=\s*"([^"]*)"')


def seg_text(line: str) -> str:
    """The text of a `<seg ...>text</seg>` line: from the end of the opening tag to the last `</seg>`, with
    anything after that closing tag kept (as sacrebleu reads these files)."""
    start, end = line.index(">") + 1, line.rindex("</seg>")
    return line[start:end] + line[end + len("</seg>"):]


def read_sgm(lines: Iterable[str], label: str) -> list[Segment]:
    """The <seg> lines of a WMT SGML file in document order, as sacrebleu reads them (no entity unescaping)."""
    docid, segments = "", []
    for n, line in enumerate(lines, 1):
        if line.startswith("<doc "):
            match = _DOCID.search(line)
            docid = match[1] if match else ""
        elif re.match(r"<seg[\s>]", line):  # `<seg>` without attributes too: a segment without an id is an error
            match = _SEG_ID.match(line)
            if match is None or "</seg>" not in line:
                raise DownloadError(f"{label}: line {n}: expected <seg id=N>text</seg> on one line, got {line[:80]!r}")
            text = " ".join(seg_text(line).split())  # whitespace runs to one space, ends stripped
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
