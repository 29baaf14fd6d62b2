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
The checks and the writing are pipeline/corpus/sources.py, the fetching (HTTP, mirror, cache, archives)
pipeline/corpus/fetch.py.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path

import requests

from pipeline.core import cli, tracking
from pipeline.core.config import DataConfig, load
from pipeline.core.files import atomic_dir, write_json
from pipeline.corpus.fetch import check_available, mirror_from_env
from pipeline.corpus.formats import SPLITS
from pipeline.corpus.sources import check_languages, check_params, fetch_all, iter_sources, write_split

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (data/raw)")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--cache", type=Path, help="download cache (default: .cache/download beside --out)")
    args = parser.parse_args(argv)
    cli.setup_logging()

    data = load(args.params, "data", DataConfig)
    check_params(data)
    mirror = mirror_from_env()
    cache = args.cache or args.out.parent / ".cache" / "download"
    with tracking.stage_run("download", args) as run:
        run.log_params({"data": asdict(data)})
        with requests.Session() as session:
            check_available([source for _, _, _, source in iter_sources(data)], cache, mirror, session)
            local = fetch_all(data, cache, mirror, session)
        check_languages(data, local)

        metrics: dict[str, int | str] = {}
        with atomic_dir(args.out) as tmp:
            for split in SPLITS:
                langs = (data.src_lang, data.tgt_lang)
                counts = write_split(getattr(data, split), local, *(tmp / f"{split}.{lang}" for lang in langs))
                metrics[f"{split}_lines"] = sum(counts.values())
                metrics.update({f"lines/{name}": n for name, n in counts.items()})
                log.info("%s: %d lines (%s)", split, sum(counts.values()),
                         ", ".join(f"{k} {v}" for k, v in counts.items()))
            for _, corpus, side, source in iter_sources(data):
                if source.sha256 is None:
                    metrics[f"sha256_seen/{corpus.name}/{side}"] = local[source].sha256
            write_json(args.metrics, metrics)  # inside atomic_dir: a failure here keeps the old data/raw too
        run.log_results(metrics)


if __name__ == "__main__":
    cli.run(main)
