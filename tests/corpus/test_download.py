"""The download stage against a real HTTP server on 127.0.0.1 serving corpora the tests make."""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import logging
import re
import shutil
import socket
import tarfile
import urllib.parse
from pathlib import Path

import pytest
import yaml
from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

from pipeline.corpus import fetch, rawtext, sources
from stages import download
from pipeline.core.config import ParamsError, load_all
from tests.fixtures.files_server import FileServer
from tests.fixtures.translation import shared_store, store  # noqa: F401 (fixtures: one MLflow store per module)

ROOT = Path(__file__).resolve().parents[2]

TRAIN_EN = "".join(f"A dog number {i} runs across the green field.\n" for i in range(200))
TRAIN_DE = "".join(f"Ein Hund Nummer {i} läuft über die grüne Wiese.\n" for i in range(200))
VALID_EN = "Two men talk.\nA child plays.\n"
VALID_DE = "Zwei Männer reden.\nEin Kind spielt.\n"


def sgm(kind: str, segs: dict[str, list[tuple[str, str]]]) -> bytes:
    """A WMT-style SGML file: documents of <seg id=N> lines, with the <p>/<h1> noise real ones have."""
    tag = "srcset" if kind == "src" else "refset"
    lines = [f'<{tag} setid="toy" srclang="any">']
    for docid, pairs in segs.items():
        lines += [f'<doc docid="{docid}" genre="news" origlang="en">', "<p>"]
        lines += [f'<seg id="{i}">{text}</seg>' for i, text in pairs]
        lines += ["</p>", "</doc>"]
    return ("\n".join(lines + [f"</{tag}>"]) + "\n").encode()


TEST_SRC = sgm(
    "src",
    {"d1": [("1", "A  first   line &amp; more"), ("2", " Standard & Poor's\u00a0rating ")], "d2": [("1", "Second doc")]},
)
TEST_REF = sgm(
    "ref", {"d1": [("1", "Eine erste Zeile"), ("2", "Standard & Poor's Bewertung")], "d2": [("1", "Zweites Dokument")]}
)
TEST_REF_TEXT = "Eine erste Zeile\nStandard & Poor's Bewertung\nZweites Dokument\n"
TEST_SRC_LINES = ["A first line &amp; more", "Standard & Poor's rating", "Second doc"]  # as sacrebleu reads them

# What the tests publish: plain files, and archives as {member: bytes or a TarInfo for links}.
PLAIN = {
    "corpus/train.en.gz": gzip.compress(TRAIN_EN.encode(), mtime=0),
    "corpus/train.de.gz": gzip.compress(TRAIN_DE.encode(), mtime=0),
}
ARCHIVES = {
    "wmt/dev.tgz": {"dev/valid.en": VALID_EN.encode(), "dev/valid.de": VALID_DE.encode(), "dev/other.txt": b"unused\n"},
    "wmt/test-full.tgz": {"test-full/src.en.sgm": TEST_SRC, "test-full/ref.de.sgm": TEST_REF},
}
# split: (corpus name, (src path, member), (tgt path, member))
LAYOUT = {
    "train": ("toy-train", ("corpus/train.en.gz", None), ("corpus/train.de.gz", None)),
    "valid": ("toy-dev", ("wmt/dev.tgz", "dev/valid.en"), ("wmt/dev.tgz", "dev/valid.de")),
    "test": ("toy-test", ("wmt/test-full.tgz", "test-full/src.en.sgm"), ("wmt/test-full.tgz", "test-full/ref.de.sgm")),
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_tar(members: dict[str, bytes | tarfile.TarInfo], mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, content in members.items():
            if isinstance(content, tarfile.TarInfo):
                tar.addfile(content)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def write_params(path: Path, data: dict) -> Path:
    """A full valid params.yaml: the repo's, with the data section replaced."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    params["data"] = data
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    load_all(path)
    return path


class Site:
    """The 'official' corpus server of a test, and a runner of the download stage against it."""

    def __init__(self, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp, self.server, self.monkeypatch = tmp_path, server, monkeypatch
        self.plain, self.archives = dict(PLAIN), copy.deepcopy(ARCHIVES)
        self.runs = 0

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.server.base_url).netloc

    def publish(self) -> None:
        """Write the plain files and archives under the server's root."""
        shutil.rmtree(self.server.root, ignore_errors=True)
        for rel, content in self.plain.items():
            (self.server.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.server.root / rel).write_bytes(content)
        for rel, members in self.archives.items():
            (self.server.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.server.root / rel).write_bytes(make_tar(members))

    def source(self, rel: str, member: str | None) -> dict:
        content = self.plain[rel] if member is None else self.archives[rel][member]
        digest = sha256(content) if isinstance(content, bytes) else sha256(b"")
        return {"url": self.server.url(rel), "member": member, "sha256": digest}

    def data(self) -> dict:
        data = {"name": "toy", "src_lang": "en", "tgt_lang": "de"}
        for split, (name, src, tgt) in LAYOUT.items():
            data[split] = [{"name": name, "src": self.source(*src), "tgt": self.source(*tgt)}]
        return data

    def run(
        self,
        data: dict | None = None,
        out: str = "raw",
        cache: str = "cache",
        mirror: str | None = None,
        publish: bool = True,
    ) -> Path:
        """Publish, write params and run the stage; return the output dir."""
        if publish:
            self.publish()
        self.runs += 1
        params = write_params(self.tmp / f"params{self.runs}.yaml", self.data() if data is None else data)
        if mirror is None:
            self.monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)
        else:
            self.monkeypatch.setenv(fetch.MIRROR_ENV, mirror)
        paths = {"--out": out, "--metrics": f"{out}.json", "--params": params.name, "--cache": cache}
        download.main([str(a) for k, v in paths.items() for a in (k, self.tmp / v)])
        return self.tmp / out

    def metrics(self, out: str = "raw") -> dict:
        return json.loads((self.tmp / f"{out}.json").read_text())


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.001)
    monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)


@pytest.fixture
def site(tmp_path, monkeypatch):
    (tmp_path / "www").mkdir()
    with FileServer(tmp_path / "www") as server:
        yield Site(tmp_path, server, monkeypatch)


def gets(server: FileServer) -> list:
    """The GET requests a server answered (the download stage asks HEAD first, to check every file can be had)."""
    return [r for r in server.requests if r.method == "GET"]


def read_tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --- the happy path, checksums, cache ------------------------------------------------


def test_download_writes_aligned_splits_and_line_counts(site):
    out = site.run()
    assert sorted(read_tree(out)) == [f"{s}.{l}" for s in ("test", "train", "valid") for l in ("de", "en")]
    assert (out / "train.en").read_text(encoding="utf-8") == TRAIN_EN
    assert (out / "train.de").read_text(encoding="utf-8") == TRAIN_DE
    assert (out / "valid.de").read_text(encoding="utf-8") == VALID_DE
    assert (out / "test.en").read_text(encoding="utf-8").split("\n") == TEST_SRC_LINES + [""]
    assert (out / "test.de").read_text(encoding="utf-8") == TEST_REF_TEXT
    metrics = site.metrics()
    assert (metrics["train_lines"], metrics["valid_lines"], metrics["test_lines"]) == (200, 2, 3)
    assert metrics["lines/toy-train"] == 200 and not any(k.startswith("sha256_seen") for k in metrics)


def test_rerun_is_served_from_the_cache(site):
    first = read_tree(site.run())
    asked = len(site.server.requests)
    assert len(gets(site.server)) == 4  # two .gz files and two archives, each archive fetched once for both members
    assert read_tree(site.run()) == first
    assert len(site.server.requests) == asked


def test_checksum_mismatch_is_refused_and_the_file_deleted(site):
    data = site.data()
    expected = "0" * 64
    data["train"][0]["tgt"]["sha256"] = expected
    with pytest.raises(fetch.ChecksumError) as err:
        site.run(data)
    actual = sha256(PLAIN["corpus/train.de.gz"])
    assert data["train"][0]["tgt"]["url"] in str(err.value) and expected in str(err.value) and actual in str(err.value)
    assert not list((site.tmp / "cache").rglob("train.de.gz*"))
    assert not (site.tmp / "raw").exists() and not (site.tmp / "raw.json").exists()


def test_member_checksum_mismatch_names_the_member_and_deletes_it(site):
    data = site.data()
    data["valid"][0]["src"]["sha256"] = "1" * 64
    with pytest.raises(fetch.ChecksumError, match="dev.tgz member dev/valid.en: sha256 mismatch"):
        site.run(data)
    assert not list((site.tmp / "cache").rglob("valid.en"))
    assert not [p for p in (site.tmp / "cache").rglob("dev.tgz") if p.is_file()]  # the archive it came from, too


def test_previous_outputs_are_intact_after_a_failure(site):
    out = site.run()
    before, metrics_before = read_tree(out), (site.tmp / "raw.json").read_bytes()
    site.plain["corpus/train.en.gz"] = gzip.compress(b"one line too few\n", mtime=0)
    with pytest.raises(fetch.DownloadError):
        site.run(cache="cache2")
    assert read_tree(out) == before and (site.tmp / "raw.json").read_bytes() == metrics_before
    assert [p.name for p in site.tmp.iterdir() if p.name.startswith(".raw")] == []


# --- HTTP: resume, retry ---------------------------------------------------------------


@pytest.mark.parametrize("honour_range", [True, False])
def test_cut_connection_is_resumed_with_a_range_request(site, honour_range):
    site.server.cut_after, site.server.cut_times, site.server.honour_range = 100, 1, honour_range
    out = site.run()
    assert (out / "train.en").read_text(encoding="utf-8") == TRAIN_EN
    first, second = [r for r in gets(site.server) if r.path.endswith("train.en.gz")]
    assert "Range" not in first.headers
    assert second.headers["Range"] == "bytes=100-"
    assert second.status == (206 if honour_range else 200)


def test_503_is_retried(site):
    site.server.fail_first, site.server.fail_method = 2, "GET"
    out = site.run()
    assert (out / "train.en").read_text(encoding="utf-8") == TRAIN_EN
    assert [r.status for r in gets(site.server)[:3]] == [503, 503, 200]


def test_persistent_503_gives_up_naming_the_url(site):
    site.server.fail_first, site.server.fail_method = 100, "GET"
    with pytest.raises(fetch.DownloadError, match=f"train.en.gz: failed after {fetch.TRIES} tries: HTTP 503"):
        site.run()
    assert len(gets(site.server)) == fetch.TRIES


def test_plain_http_without_sha256_is_refused_before_any_request(site):
    data = site.data()
    data["train"][0]["src"]["sha256"] = None
    with pytest.raises(ParamsError, match=r"data\.train\[0\]\.src\.sha256: http://.* is plain http"):
        site.run(data)
    assert site.server.requests == []


def test_unpinned_https_source_warns_and_records_the_hash_seen(site, caplog):
    mirror = site.tmp / "mirror"
    url = "https://corpora.example.org/toy/train.en.gz"
    (mirror / "corpora.example.org/toy").mkdir(parents=True)
    (mirror / "corpora.example.org/toy/train.en.gz").write_bytes(PLAIN["corpus/train.en.gz"])
    data = site.data()
    data["train"][0]["src"] = {"url": url, "member": None, "sha256": None}
    with caplog.at_level(logging.WARNING):
        out = site.run(data, mirror=str(mirror))
    assert (out / "train.en").read_text(encoding="utf-8") == TRAIN_EN
    assert site.metrics()["sha256_seen/toy-train/src"] == sha256(PLAIN["corpus/train.en.gz"])
    assert "NOT PINNED" in caplog.text and url in caplog.text


# --- the mirror -----------------------------------------------------------------------


def make_mirror(site: Site, root: Path, unpack: bool) -> Path:
    """The site's files at <mirror>/<host>/<path>; archives unpacked into a directory, or as they are."""
    base = root / site.host
    for rel, content in site.plain.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(content)
    for rel, members in site.archives.items():
        if not unpack:
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_bytes(make_tar(members))
            continue
        for name, content in members.items():
            (base / rel / name).parent.mkdir(parents=True, exist_ok=True)
            (base / rel / name).write_bytes(content)
    return root


def test_mirror_directory_and_http_mirror_give_byte_identical_outputs(site):
    direct = read_tree(site.run(out="direct", cache="c0"))
    direct_metrics = site.metrics("direct")
    asked = len(site.server.requests)
    unpacked = make_mirror(site, site.tmp / "mirror_unpacked", unpack=True)
    archives = make_mirror(site, site.tmp / "mirror_archives", unpack=False)
    with FileServer(site.tmp / "mirror_http") as mirror_server:
        make_mirror(site, site.tmp / "mirror_http" / "base", unpack=True)
        make_mirror(site, site.tmp / "mirror_http" / "packed", unpack=False)
        outs = {
            "dir": site.run(out="dir", cache="c1", mirror=str(unpacked)),
            "dir-archives": site.run(out="dir-archives", cache="c2", mirror=str(archives)),
            "http": site.run(out="http", cache="c3", mirror=mirror_server.url("base/")),
            "http-archives": site.run(out="http-archives", cache="c4", mirror=mirror_server.url("packed/")),
        }
        member_requests = [r.path for r in gets(mirror_server) if "dev.tgz/dev/" in r.path and r.status == 200]
        archive_requests = [r.path for r in gets(mirror_server) if r.path.endswith("dev.tgz") and r.status == 200]
    assert len(site.server.requests) == asked  # the official server was not asked again
    assert sorted(member_requests) == [f"/base/{site.host}/wmt/dev.tgz/dev/valid.{lang}" for lang in ("de", "en")]
    assert archive_requests == [f"/packed/{site.host}/wmt/dev.tgz"]  # members asked first (404), then the archive
    for name, out in outs.items():
        assert read_tree(out) == direct, name
        assert site.metrics(name) == direct_metrics, name


def test_file_missing_from_the_http_mirror_comes_from_the_official_url(site):
    with FileServer(site.tmp / "empty_mirror") as mirror_server:
        out = site.run(mirror=mirror_server.base_url)
        assert len(gets(mirror_server)) == 6 and {r.status for r in mirror_server.requests} == {404}
    assert (out / "train.en").read_text(encoding="utf-8") == TRAIN_EN


# --- archives ----------------------------------------------------------------------------


def test_path_traversal_member_is_refused(site):
    site.archives["wmt/dev.tgz"]["../evil.en"] = b"owned\n"
    data = site.data()
    data["valid"][0]["src"] = site.source("wmt/dev.tgz", "../evil.en")
    with pytest.raises(ParamsError, match=r"data\.valid\[0\]\.src\.member = '\.\./evil\.en': expected a relative path inside the archive, without '\.\.'"):
        site.run(data)
    assert site.server.requests == []


@pytest.mark.parametrize("name", ["../evil.en", "/tmp/evil.en", "dev/../../evil.en"])
def test_extraction_refuses_members_outside_the_target_dir(tmp_path, name):
    archive = tmp_path / "evil.tgz"
    archive.write_bytes(make_tar({name: b"owned\n"}))
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(fetch.DownloadError, match=f"evil archive: member {name} would land outside"):
        fetch.extract_members(archive, [name], dest, "evil archive")
    assert not (tmp_path / "deep" / "evil.en").exists() and not (tmp_path / "evil.en").exists() and not dest.exists()


@pytest.mark.parametrize("kind, word", [(tarfile.SYMTYPE, "symlink"), (tarfile.LNKTYPE, "hard link")])
def test_link_member_is_refused(site, kind, word):
    target = "/etc/passwd" if kind == tarfile.SYMTYPE else "dev/other.txt"
    site.archives["wmt/dev.tgz"]["dev/valid.en"] = link("dev/valid.en", target, kind)
    with pytest.raises(fetch.DownloadError, match=f"dev.tgz \\(archive\\): member dev/valid.en is a {word}"):
        site.run()
    assert not list((site.tmp / "cache").rglob("valid.en"))


def test_truncated_archive_is_refused_naming_it(site):
    site.publish()
    data = site.data()
    path = site.server.root / "wmt/test-full.tgz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(fetch.DownloadError, match="test-full.tgz \\(archive\\): corrupt or truncated archive"):
        site.run(data, publish=False)


def test_truncated_gzip_is_refused_naming_it(site):
    site.plain["corpus/train.en.gz"] = PLAIN["corpus/train.en.gz"][:-12]
    with pytest.raises(fetch.DownloadError, match="train.en.gz: corrupt or truncated gzip"):
        site.run()


# --- text hygiene ------------------------------------------------------------------------


def test_different_line_counts_are_refused_naming_both_files(site):
    site.archives["wmt/dev.tgz"]["dev/valid.de"] = b"Nur eine Zeile.\n"
    with pytest.raises(fetch.DownloadError, match=r"toy-dev: 2 lines in .*dev/valid.en but 1 in .*dev/valid.de"):
        site.run()


def test_invalid_utf8_is_refused_with_its_line_number(site):
    site.archives["wmt/dev.tgz"]["dev/valid.de"] = b"Zwei M\xc3\xa4nner.\nEin Kind \xff spielt.\n"
    with pytest.raises(fetch.DownloadError, match="dev/valid.de: line 2: invalid UTF-8"):
        site.run()


def test_bom_and_crlf_are_stripped(site):
    site.archives["wmt/dev.tgz"]["dev/valid.en"] = b"\xef\xbb\xbfTwo men talk.\r\nA child plays.\r\n"
    site.archives["wmt/dev.tgz"]["dev/valid.de"] = b"Zwei M\xc3\xa4nner reden.\r\nEin Kind spielt."  # no final newline
    out = site.run()
    assert (out / "valid.en").read_bytes() == VALID_EN.encode()
    assert (out / "valid.de").read_bytes() == VALID_DE.encode()


def test_empty_corpus_is_refused(site):
    site.archives["wmt/dev.tgz"]["dev/valid.en"] = b""
    site.archives["wmt/dev.tgz"]["dev/valid.de"] = b""
    with pytest.raises(fetch.DownloadError, match="toy-dev: .* have no lines"):
        site.run()


# --- SGML ----------------------------------------------------------------------------------


def test_sgml_mismatched_segment_ids_are_refused(site):
    site.archives["wmt/test-full.tgz"]["test-full/ref.de.sgm"] = sgm(
        "ref", {"d1": [("1", "Eine erste Zeile"), ("3", "Falsche Nummer")], "d2": [("1", "Zweites Dokument")]}
    )
    with pytest.raises(fetch.DownloadError, match=r"ref.de.sgm: no segment docid='d1' segid=2 .*which .*src.en"):
        site.run()


def test_sgml_segments_out_of_order_are_refused(tmp_path):
    src = [rawtext.Segment("d1", "1", "a"), rawtext.Segment("d1", "2", "b")]
    ref = [rawtext.Segment("d1", "2", "B"), rawtext.Segment("d1", "1", "A")]
    with pytest.raises(fetch.DownloadError, match="src.sgm and ref.sgm: segment 1 is docid='d1' segid=1 in the"):
        rawtext.check_segments(src, ref, "src.sgm", "ref.sgm")


def test_sgml_text_matches_sacrebleu(tmp_path):
    path, expected = tmp_path / "src.en.sgm", tmp_path / "sacrebleu.txt"
    path.write_bytes(TEST_SRC)
    FakeSGMLDataset("toy")._convert_format(str(path), str(expected))
    ours = [s.text for s in rawtext.read_sgm(rawtext.read_raw_lines(path, False, "src"), "src")]
    assert ours == expected.read_text(encoding="utf-8").splitlines() == TEST_SRC_LINES


def test_sgml_text_matches_sacrebleu_on_odd_segments(tmp_path):
    """Tabs and runs of spaces, '>' and '</seg>' inside the text, text after the closing tag, no attributes' quotes."""
    segs = ['<seg id="1">\t two  spaces\tand tabs </seg>', '<seg id=2>a > b and c</seg> d</seg>',
            '<seg id="3" >x</seg> trailing', '<seg id="4"> </seg>', '<seg   id="5">  lead and trail  </seg>  ']
    path, expected = tmp_path / "odd.sgm", tmp_path / "sacrebleu.txt"
    path.write_text('<srcset setid="t" srclang="any">\n<doc docid="d" genre="news">\n' + "\n".join(segs)
                    + "\n</doc>\n</srcset>\n", encoding="utf-8")
    FakeSGMLDataset("toy")._convert_format(str(path), str(expected))
    ours = [s.text for s in rawtext.read_sgm(rawtext.read_raw_lines(path, False, "odd"), "odd")]
    assert ours == expected.read_text(encoding="utf-8").split("\n")[:len(segs)]
    assert ours[1] == "a > b and c</seg> d" and ours[2] == "x trailing"


def test_line_breaks_inside_lines_are_kept_and_warned(tmp_path, caplog):
    path = tmp_path / "out.txt"
    with open(path, "w", encoding="utf-8", newline="\n") as f, caplog.at_level(logging.WARNING):
        assert sources.write_lines(f, ["a\rb", "c\u2028d", "e", ""], "toy src") == 4
    assert path.read_bytes() == "a\rb\nc\u2028d\ne\n\n".encode()
    assert "toy src: 2 line breaks other than" in caplog.text


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["train"][0]["src"].update(member="x.en"), r"data\.train\[0\]\.src\.member: .* is not a"),
        (lambda d: d["valid"][0]["tgt"].update(member=None), r"data\.valid\[0\]\.tgt\.member: .* is an archive"),
        (lambda d: d["test"][0]["src"].update(sha256="ABC"), r"data\.test\[0\]\.src\.sha256 = 'ABC': expected 64 lowercase hex"),
        (lambda d: d["test"][0].update(name="toy-train"), r"data\.test\[0\]\.name: 'toy-train' is used twice"),
        (lambda d: d.update(valid=[]), r"data\.valid: 0 item\(s\); expected a number of items in \[1, inf\)"),
        (lambda d: d["train"][0]["src"].update(url="ftp://example.org/a.gz"), r"data\.train\[0\]\.src\.url = 'ftp://example\.org/a\.gz': expected an http\(s\) URL"),
    ],
)
def test_bad_sources_are_refused_naming_the_params_key(site, edit, message):
    data = site.data()
    edit(data)
    with pytest.raises(ParamsError, match=message):
        site.run(data)
    assert site.server.requests == []


# --- nothing touched when a file cannot be had; errors name the mirror copy that was read ------------------------


def closed_port_url(path: str) -> str:
    """An http URL on 127.0.0.1 where nothing listens: what an unreachable host looks like, without a network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/{path}"


def test_files_that_cannot_be_had_are_all_named_before_anything_is_downloaded(site):
    before = read_tree(site.run(cache="cache1"))
    data = site.data()
    data["train"][0]["tgt"] = {"url": site.server.url("corpus/gone.de.gz"), "member": None, "sha256": "0" * 64}
    unreachable = closed_port_url("wmt/test-full.tgz")
    for side in ("src", "tgt"):
        data["test"][0][side]["url"] = unreachable
    site.server.requests.clear()
    with pytest.raises(fetch.DownloadError) as refused:
        site.run(data, cache="cache2")
    assert re.fullmatch(
        r"cannot get 2 of 4 file\(s\), so nothing was downloaded or changed: http://127\.0\.0\.1:\d+/corpus/gone\.de\.gz: "
        rf"HTTP 404 [^;]*; {re.escape(unreachable)}: Connection refused; without network access, set CORPUS_MIRROR .*",
        str(refused.value)), str(refused.value)
    assert gets(site.server) == [] and not (site.tmp / "cache2").exists()  # not one byte fetched
    assert read_tree(site.tmp / "raw") == before


def test_an_unreachable_http_mirror_is_named_before_anything_is_downloaded(site):
    mirror = closed_port_url("base/")
    with pytest.raises(fetch.DownloadError, match=rf"cannot get 4 of 4 .*/corpus/train\.en\.gz: CORPUS_MIRROR "
                                                  rf"{re.escape(mirror)}{re.escape(site.host)}/corpus/train\.en\.gz: "
                                                  "Connection refused"):
        site.run(mirror=mirror)
    assert site.server.requests == [] and not (site.tmp / "cache").exists() and not (site.tmp / "raw").exists()


def test_an_error_in_a_mirror_copy_names_the_official_url_and_the_mirror_file(site):
    mirror = make_mirror(site, site.tmp / "mirror", unpack=True)
    copy_read = mirror / site.host / "corpus" / "train.de.gz"
    broken = gzip.compress(b"Ein Hund.\nEin \xff Kind.\n", mtime=0)
    copy_read.write_bytes(broken)
    data = site.data()
    data["train"][0]["tgt"]["sha256"] = sha256(broken)  # pinned to the broken bytes: only reading can tell
    with pytest.raises(fetch.DownloadError) as refused:
        site.run(data, mirror=str(mirror))
    assert str(refused.value).startswith(
        f"{data['train'][0]['tgt']['url']} (read from CORPUS_MIRROR copy {copy_read}): line 2: invalid UTF-8")
    with pytest.raises(fetch.ChecksumError) as refused:  # the same copy against the official file's sha256
        site.run(mirror=str(mirror))
    assert str(refused.value).startswith(
        f"{data['train'][0]['tgt']['url']} (read from CORPUS_MIRROR copy {copy_read}): sha256 mismatch: expected ")
    assert copy_read.read_bytes() == broken  # a mirror's file is never deleted
