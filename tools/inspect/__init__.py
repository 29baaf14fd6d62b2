"""Any stage's output, readable: one entry point (main.py: `python -m tools.inspect PATH`), one module per kind of
output: data.py (raw, batches), tokens.py (tokenized), training.py (checkpoints, model), output.py (translations,
eval); common.py what the views share, to_mlflow.py a view logged to a stage's MLflow run."""

from tools.inspect.main import main

__all__ = ["main"]
