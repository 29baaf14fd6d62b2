"""A stand-in for a WMT preset's corpora at the official file layout, to serve from 127.0.0.1.

    www = tmp_path / "www"
    pinned = stand_in(www, params["data"], {"train": 150, "valid": 20, "test": 20})
    with FileServer(www) as server:
        data = local_urls(pinned, server)     # the URLs moved to the server
    # or, with stand_in(..., unpacked=True), the official URLs kept and the server as their mirror:
    #   CORPUS_MIRROR=server.url() in the download's environment

Every archive the data section names (training tgz/tar, dev.tgz, test-full.tgz)
is written at www/<host>/<path> with the members the preset reads (or those
members unpacked below it: the mirror layout of pipeline/corpus/fetch.py),
filled with aligned synthetic lines: plain text, gzip inside a tar
(giga-fren), plain newstest2013 dev files and SGML newstest2014 files with the
srcset / refset headers and docids of the real ones. The lines come from tests/pipeline_fixtures.py's small grammar, or from
Lexicon: a large made-up lexicon, so that sentencepiece can learn a paper-size
vocabulary (37000 pieces) from a few thousand pairs.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import random
import tarfile
import urllib.parse
from pathlib import Path
from typing import Callable

from pipeline.corpus.formats import SPLITS
from tests.http_fixtures import FileServer
from tests.pipeline_fixtures import sentence_pair

PairMaker = Callable[[random.Random], tuple[str, str]]


class Lexicon:
    """Sentence pairs over `words` made-up words per language: word i of the source translates to word i of the
    target, in the same order. Pseudo-words of 2 to 4 syllables, all distinct, seeded."""

    def __init__(self, words: int, seed: int = 5) -> None:
        rng = random.Random(seed)
        self.src, self.tgt = (self._words(rng, words, end) for end in ("", "e"))

    @staticmethod
    def _words(rng: random.Random, n: int, end: str) -> list[str]:
        def word() -> str:
            return "".join(rng.choice("bcdfghjklmnprstvwz") + rng.choice("aeiou") + rng.choice(["", "", "n", "r", "s"])
                           for _ in range(rng.randint(2, 4))) + end
        found: dict[str, None] = {}
        while len(found) < n:
            found[word()] = None
        return list(found)

    def __call__(self, rng: random.Random) -> tuple[str, str]:
        picks = [rng.randrange(len(self.src)) for _ in range(rng.randint(4, 10))]
        return (" ".join(self.src[i] for i in picks).capitalize() + " .",
                " ".join(self.tgt[i] for i in picks).capitalize() + " .")


def sgml(lines: list[str], lang: str, ref: bool) -> str:
    """A newstest SGML file: a <srcset>/<refset> header naming the language, two documents of <seg>s."""
    head = (f'<refset setid="newstest2014" srclang="any" trglang="{lang}">' if ref
            else '<srcset setid="newstest2014" srclang="any">')
    out, half = [head], len(lines) // 2
    for d, doc in enumerate((lines[:half], lines[half:])):
        out += [f'<doc sysid="ref" docid="{d}-standin" genre="news" origlang="en">', "<p>"]
        out += [f'<seg id="{i}">{text}</seg>' for i, text in enumerate(doc, 1)]
        out += ["</p>", "</doc>"]
    return "\n".join(out + ["</refset>" if ref else "</srcset>"]) + "\n"


def member_bytes(member: str, lines: list[str], lang: str) -> bytes:
    """A member's contents in the format its name says: .sgm (SGML), .gz (gzip), else plain text."""
    if member.endswith(".sgm"):
        return sgml(lines, lang, ref="-ref." in member).encode()
    text = "".join(line + "\n" for line in lines).encode()
    return gzip.compress(text, mtime=0) if member.endswith(".gz") else text


def write_archive(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.name.endswith((".tgz", ".tar.gz")) else "w") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def stand_in(www: Path, data: dict, lines: dict[str, int], pair: PairMaker = sentence_pair,
             unpacked: bool = False) -> dict:
    """Write every archive `data` names under www/<host>/<path>, `lines[split]` pairs per corpus made by `pair`
    (`unpacked`: each member at www/<host>/<path>/<member> instead, as a mirror holds them); return `data` with
    each member's sha256 pinned."""
    rng = random.Random(3)
    archives: dict[str, dict[str, bytes]] = {}
    pinned = copy.deepcopy(data)
    for split in SPLITS:
        for corpus in pinned[split]:
            pairs = [pair(rng) for _ in range(lines[split])]
            for side, column in (("src", 0), ("tgt", 1)):
                source, lang = corpus[side], data["src_lang" if side == "src" else "tgt_lang"]
                content = member_bytes(source["member"], [p[column] for p in pairs], lang)
                archives.setdefault(source["url"], {})[source["member"]] = content
                source["sha256"] = hashlib.sha256(content).hexdigest()
    for url, members in archives.items():
        parts = urllib.parse.urlsplit(url)
        path = www / parts.netloc / parts.path.lstrip("/")
        if not unpacked:
            write_archive(path, members)
        for name, content in members.items() if unpacked else ():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(content)
    return pinned


def local_urls(data: dict, server: FileServer) -> dict:
    """`data` with every URL moved to `server` (same host/path below it), members kept."""
    moved = copy.deepcopy(data)
    for split in SPLITS:
        for corpus in moved[split]:
            for side in ("src", "tgt"):
                parts = urllib.parse.urlsplit(corpus[side]["url"])
                corpus[side]["url"] = server.url(parts.netloc + parts.path)
    return moved
