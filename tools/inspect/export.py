"""The export view of tools.inspect: data/export checked as translate checks it, then what it holds.

The seal of every file (pipeline/export/seal.py), and that the export was made from the model.pt of data/model and
the tokenizer of data/tokenized beside it (or --tokenized), before anything is shown: a damaged export or one of
another run is one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.export.seal import SEAL_NAME, verify
from tools.inspect.common import Options, shown, sibling


def show_export(path: Path, opts: Options) -> None:
    """The export's provenance, quantization and files, once its seal and provenance check out."""
    model_pt = sibling(path, "model", None) / "model.pt"
    spm_model = sibling(path, "tokenized", opts.tokenized) / "spm.model"
    config = verify(path, model_pt, spm_model)
    about = config["project"]
    print(f"export {shown(path)}: sealed ({SEAL_NAME}: every file's sha256 matches)")
    for name, checked in ((model_pt, "model_sha256"), (spm_model, "spm_sha256")):
        state = "matches" if name.is_file() else "not found, not compared"
        print(f"  from {shown(name)}: sha256 {str(about.get(checked))[:12]}... ({state})")
    print(f"params_hash {about.get('params_hash')}, steps {about.get('steps')}, max_positions {about['max_positions']}")
    print(f"quantization {about.get('quantization')}, computed as {about.get('compute_type', '?')}")
    for p in sorted(path.iterdir()):
        print(f"  {p.name:28} {p.stat().st_size / 2**20:8.2f} MiB")
