"""Any stage's output, readable: one entry point (main.py: `python -m tools.inspect PATH`), one module per kind of
output: data.py (raw, batches), tokens.py (tokenized), training.py (checkpoints, model), output.py (translations,
eval); common.py what the views share. A view logged to an MLflow run: pipeline/core/views.py."""

from tools.inspect.main import main

__all__ = ["main"]
