"""The one base of every failure the pipeline expects: bad params, a missing or broken input, a failed download or write.

Each subclass lives beside the code that raises it (config.ParamsError,
files.InputError and OutputError, fetch.DownloadError, checkpoint.CheckpointError,
averaging.AverageError, scoring.ScoringError,
compiled.CompileClockError). Its message names the file and
line or the params key, and what was expected; pipeline.core.cli.run prints it as
one line. Anything else is a bug and keeps its traceback.
"""


class PipelineError(Exception):
    """An expected failure; the message alone tells the user what to fix."""


class ParamsError(PipelineError, ValueError):
    """A params file does not match the schema; the message names the key (pipeline.core.config, checks)."""
