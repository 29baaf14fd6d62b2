"""What train's params ask of this machine and of torch, refused in one line before anything loads or starts.

    checks.train(cfg)     # a ParamsError naming the key, what it needs and the setting that runs here
"""

from __future__ import annotations

import torch

from pipeline.core.config import ParamsError, TrainConfig


def train(cfg: TrainConfig) -> None:
    """Refuse train.cuda_graphs and bf16 gradient compression without a CUDA GPU, and R-Drop under a compiled step."""
    if cfg.cuda_graphs and not torch.cuda.is_available():
        raise ParamsError("train.cuda_graphs = true: CUDA graphs need a CUDA GPU and this machine has none "
                          "(torch.cuda.is_available() is False); set train.cuda_graphs=false")
    if cfg.grad_compression == "bf16" and not torch.cuda.is_available():  # whatever the world (nodes of one process too)
        raise ParamsError("train.grad_compression = bf16: torch's bf16 all-reduce hook needs NCCL (CUDA GPUs) "
                          "and this machine has none; set train.grad_compression=fp16 or none")
    if cfg.compile_scope == "step" and (cfg.compile or cfg.cuda_graphs) and cfg.rdrop_alpha > 0:
        raise ParamsError(f"train.compile_scope = step compiles the plain loss, and train.rdrop_alpha = "
                          f"{cfg.rdrop_alpha:g} asks for R-Drop: set train.compile_scope=layers (or "
                          "train.rdrop_alpha=0)")
