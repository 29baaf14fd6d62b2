"""What the views of tools.inspect share: their options, tables, number summaries, pictures, sibling paths."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np
from matplotlib.figure import Figure

from pipeline.core import config
from pipeline.core.config import DataConfig, ParamsError
from pipeline.corpus.formats import read_meta
from pipeline.translation.scoring import read_lines
from pipeline.core.files import CHUNK_LINES, InputError, read_chunks, write_bytes

T = TypeVar("T")

NUMBER = re.compile(r"-?[\d,]+(\.\d+)?%?")  # a table cell right-aligned as a number
TEXT_FILE = re.compile(r"^(train|valid|test)\.([A-Za-z][A-Za-z_-]*)$")  # raw and translated text: {split}.{lang}


class InspectError(ValueError):
    """An output cannot be inspected; the message names the file and what was expected."""


@dataclass(frozen=True)
class Options:
    """The command line of tools.inspect, as every view sees it."""

    out: Path  # where pictures and tables go
    n: int  # sample sentences to show
    params: Path
    split: str  # the split the translations view shows
    raw: Path | None  # None: the sibling of PATH (data/raw)
    tokenized: Path | None
    translations: Path | None


def sibling(path: Path, name: str, given: Path | None) -> Path:
    """`given`, else the stage output `name` beside `path` (data/raw beside data/tokenized)."""
    return given if given is not None else path.absolute().parent / name


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is inside it, as a person would type it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def read_json(path: Path, expected: str) -> dict:
    """A JSON object from `path`; missing or malformed is an InspectError saying what was expected."""
    if not path.is_file():
        raise FileNotFoundError(f"{shown(path)}: missing; expected {expected}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InspectError(f"{shown(path)}: not valid JSON ({e}); expected {expected}") from None
    if not isinstance(obj, dict):
        raise InspectError(f"{shown(path)}: a JSON {type(obj).__name__}; expected {expected}")
    return obj


def text_chunks(path: Path, expected: str, limit: int | None = None) -> Iterator[list[str]]:
    """The lines of a UTF-8 text file (split at "\\n" only, as the stages read them), CHUNK_LINES at a time, the
    first `limit` only if given: a WMT-size corpus (tens of millions of lines) is never held whole. Missing or
    invalid UTF-8 is an error naming the file (and line) and what was expected."""
    if not path.is_file():
        raise FileNotFoundError(f"{shown(path)}: missing; expected {expected}")
    try:
        yield from read_chunks(path, CHUNK_LINES, limit)
    except InputError as e:
        raise InspectError(f"{e}; expected {expected}") from None


def scan_text(path: Path, expected: str, keep: set[int] = frozenset()) -> tuple[np.ndarray, dict[int, str]]:
    """Words per line of a text file (text_chunks), and its lines at the indices `keep`."""
    words, kept, start = [], {}, 0
    for chunk in text_chunks(path, expected):
        words.append(np.fromiter((len(line.split()) for line in chunk), dtype=np.int64, count=len(chunk)))
        kept |= {i: chunk[i - start] for i in keep if start <= i < start + len(chunk)}
        start += len(chunk)
    return (np.concatenate(words) if words else np.zeros(0, np.int64)), kept


def scan_lines(path: Path, expected: str, limit: int) -> list[str]:
    """The first `limit` lines of a text file (text_chunks)."""
    return [line for chunk in text_chunks(path, expected, limit) for line in chunk]


def text_lines(path: Path, expected: str) -> list[str]:
    """The lines of a UTF-8 text file (as the stages read them); missing is an error saying what was expected."""
    if not path.is_file():
        raise FileNotFoundError(f"{shown(path)}: missing; expected {expected}")
    return read_lines(path)


def text_languages(directory: Path, split: str) -> list[str]:
    """The languages of the `{split}.{lang}` text files in `directory`, sorted."""
    names = (p.name for p in directory.iterdir()) if directory.is_dir() else ()
    return sorted(m.group(2) for name in names if (m := TEXT_FILE.match(name)) and m.group(1) == split)


def language_pair(raw: Path, tokenized: Path, params: Path) -> tuple[str, str]:
    """(source, target) of the raw files: in the order of tokenized/meta.json, else of params `data`, else sorted."""
    found = text_languages(raw, "train") or text_languages(raw, "test")
    if len(found) != 2:
        raise InspectError(f"{shown(raw)}: expected train.<src> and train.<tgt> text files, found languages {found}")
    for pair in (meta_languages(tokenized), params_languages(params)):
        if pair is not None and sorted(pair) == found:
            return pair
    return found[0], found[1]


def meta_languages(tokenized: Path) -> tuple[str, str] | None:
    """(src_lang, tgt_lang) of tokenized/meta.json, or None when it cannot be read."""
    try:
        meta = read_meta(tokenized)
        return meta["src_lang"], meta["tgt_lang"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def params_languages(params: Path) -> tuple[str, str] | None:
    """(data.src_lang, data.tgt_lang) of the params file, or None when it cannot be read."""
    data, _ = params_or_reason(lambda: config.load(params, "data", DataConfig))
    return None if data is None else (data.src_lang, data.tgt_lang)


def spread(n_lines: int, n: int) -> list[int]:
    """Up to n line indices spread evenly from the first line to the last (misalignment shows at the end)."""
    return sorted(set(np.linspace(0, n_lines - 1, min(n, n_lines)).round().astype(int).tolist())) if n_lines else []


def summary(values: np.ndarray) -> str:
    """min / median / mean / max of `values`, or 'none' when empty."""
    if len(values) == 0:
        return "none"
    return (f"min {values.min():g}, median {np.median(values):g}, mean {values.mean():.1f}, "
            f"max {values.max():g}")


def table(header: list[str], rows: list[list]) -> str:
    """A plain text table: columns as wide as their widest cell; ints with thousands separators, floats to 4
    decimals, and columns of numbers right-aligned."""
    cells = [[f"{c:,}" if isinstance(c, int) else f"{c:.4f}" if isinstance(c, float) else str(c) for c in row]
             for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(NUMBER.fullmatch(row[i]) for row in cells[1:]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
                     for row in cells)


def figure(n_plots: int) -> tuple[Figure, list]:
    """A figure of `n_plots` side by side (no pyplot: nothing global, no display needed)."""
    fig = Figure(figsize=(4.2 * n_plots, 3.4), dpi=100, layout="constrained")
    return fig, list(fig.subplots(1, n_plots, squeeze=False).flat)


def length_histogram(ax, lengths: list[np.ndarray], labels: list[str], title: str, unit: str) -> None:
    """Overlaid step histograms of integer lengths, one bin per length."""
    top = max((int(x.max()) for x in lengths if len(x)), default=0)
    ax.hist(lengths, bins=np.arange(top + 2) - 0.5, histtype="step", label=labels)
    ax.set(title=title, xlabel=unit, ylabel="sentences")
    ax.legend()


def save_png(fig: Figure, out: Path, name: str) -> Path:
    """Write `fig` as out/name (atomically) and say where."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    write_bytes(path, buf.getvalue())
    print(f"picture: {shown(path)}")
    return path


def params_or_reason(read: Callable[[], T]) -> tuple[T | None, str | None]:
    """(read(), None), or (None, why) when params cannot be read: a view says so and goes on."""
    try:
        return read(), None
    except (ParamsError, OSError) as e:
        return None, str(e)
