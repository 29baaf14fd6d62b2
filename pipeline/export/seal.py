"""The export's seal and provenance, checked wherever an export is read, before anything is decoded.

    seal(directory)                                     # the export stage, once every file is written
    config = verify(directory, model_pt, spm_model)     # every reader: the export's config.json, or ExportSealError

A checkpoint's mechanism (pipeline/weights/checkpoint.py): sha256 in `sha256sum` format, here one line per file of
the export in seal.sha256 (model.bin, config.json, the vocabularies, spm.model). config.json's `project` entry names
where the export came from: the source model.pt's sha256 and params hash, and the sentencepiece model's sha256.
verify() stops with one line naming the file and what differs when a file is missing, truncated or changed, or when
the export was made from another model.pt or tokenizer than the one it is used with. Only hashlib and json: the
CTranslate2 engine's --stdin stays free of torch; a 27 MB model.bin hashes in about 0.05 s.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.files import InputError, file_sha256, sidecar, write_text

SEAL_NAME = "seal.sha256"
MEND = "run `dvc repro export` (or python -m stages.export)"


class ExportSealError(InputError):
    """An export that is incomplete, damaged, or not the export of the model or tokenizer it is used with."""


def seal(directory: Path) -> None:
    """Write seal.sha256: the sha256 of every file of `directory` (written last: a kill before it leaves no seal)."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name != SEAL_NAME)
    write_text(Path(directory) / SEAL_NAME, "".join(f"{file_sha256(p)}  {p.name}\n" for p in files))


def model_digest(model_pt: Path) -> str:
    """model.pt's sha256: its seal's (written and checked by the average stage), else hashed here."""
    seal_file = sidecar(model_pt)
    if seal_file.is_file() and (recorded := seal_file.read_text(encoding="utf-8").split()[:1]):
        return recorded[0]
    return file_sha256(model_pt)


def _sealed(directory: Path) -> dict[str, str]:
    path = directory / SEAL_NAME
    if not directory.is_dir():
        raise ExportSealError(f"{directory}: missing; {MEND} (export.enabled: true) first")
    if (directory / "disabled.json").is_file():
        raise ExportSealError(f"{directory}: export.enabled was false, so there is no export; set it to true and {MEND}")
    if not path.is_file():
        raise ExportSealError(f"{path}: missing, so the export's files cannot be checked (written by an interrupted "
                              f"or older export stage); {MEND}")
    sealed = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or "/" in name:
            raise ExportSealError(f"{path}:{n}: not a `sha256  name` line; {MEND}")
        sealed[name] = digest
    return sealed


def verify(directory: Path, model_pt: Path | None = None, spm_model: Path | None = None) -> dict:
    """The export's config.json once every sealed file matches its sha256 and, where given and present, the
    export was made from `model_pt` and with the tokenizer `spm_model`; else ExportSealError naming the file."""
    directory = Path(directory)
    sealed = _sealed(directory)
    for name in ("model.bin", "config.json", "spm.model"):
        if name not in sealed:
            raise ExportSealError(f"{directory / SEAL_NAME}: does not list {name}; {MEND}")
    for name, digest in sealed.items():
        path = directory / name
        if not path.is_file():
            raise ExportSealError(f"{path}: missing (the export's seal lists it); {MEND}")
        if (actual := file_sha256(path)) != digest:
            raise ExportSealError(f"{path}: sha256 {actual[:12]}... does not match {SEAL_NAME} ({digest[:12]}...): "
                                  f"truncated or corrupt; {MEND}")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    about = config.get("project") or {}
    if model_pt is not None and Path(model_pt).is_file() and model_digest(Path(model_pt)) != about.get("model_sha256"):
        raise ExportSealError(
            f"{directory}: exported from another model (its model.pt sha256 {str(about.get('model_sha256'))[:12]}..., "
            f"params_hash {str(about.get('params_hash'))[:12]}...), not {model_pt} "
            f"(sha256 {model_digest(Path(model_pt))[:12]}...); {MEND}")
    if spm_model is not None and Path(spm_model).is_file() and file_sha256(spm_model) != about.get("spm_sha256"):
        raise ExportSealError(f"{directory / 'spm.model'}: not the tokenizer {spm_model} (sha256 differs): the export "
                              f"belongs to another tokenize run; {MEND}")
    return config
