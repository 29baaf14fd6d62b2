"""How a stage stops on a signal, and the few places a signal must wait for.

    with signals.stopping():     # pipeline.core.cli.run and tracking.stage_run: SIGINT -> KeyboardInterrupt,
        ...                      # SIGTERM / SIGHUP -> Stopped (a SystemExit), so `finally` blocks run
    with signals.held():         # an MLflow call, a checkpoint being written: the first signal waits
        ...                      # until the block ends, then is raised; a second one is raised at once
    signals.caused_by_signal(e)  # True when `e` or an exception it was raised from is one of those
    with signals.deferred() as asked:  # SIGTERM, SIGUSR1 recorded, not raised: a scheduler's notice that the job
        ... asked.signum ...           # stops; the train stage checkpoints at the next step and raises Preempted

A signal raised inside a library's C++ or database code turns into that code's
error or leaves it half done: in torch.save (a Python write callback) it became
"RuntimeError: ... unexpected pos"; in an MLflow call it left the database
session unusable, so the runs stayed RUNNING. Both are `held()` sections. A
SIGINT that a shell set to be ignored (background jobs) and an ignored SIGHUP
(nohup) stay ignored; SIGKILL cannot be caught.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0  # held() sections under way
_pending = 0  # the signal that arrived during one, raised when the outermost ends


class Stopped(SystemExit):
    """SIGTERM or SIGHUP arrived; its code is 128 + the signal number, as a shell reports it."""


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(128 + signum)


def _handler(signum: int, _frame: Any) -> None:
    global _pending
    if _depth and not _pending:
        _pending = signum
        return
    _raise(signum)


def _default(sig: int) -> bool:
    """Still Python's own handling (not ignored, not someone else's handler)."""
    current = signal.getsignal(sig)
    return current is (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """Install the handler for the signals still at their defaults (main thread only); restore them on exit."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            if _default(sig):
                previous[sig] = signal.signal(sig, _handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold the first stopping signal until the block ends (nested blocks: the outermost), then raise it."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending:
            signum, _pending = _pending, 0
            _raise(signum)


def caused_by_signal(error: BaseException) -> bool:
    """`error`, or one it was raised from or while handling, is a KeyboardInterrupt or Stopped."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, Stopped)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


class Preempted(Stopped):
    """Training stopped on a scheduler's signal (deferred) after checkpointing; `line` says where it resumes."""

    def __init__(self, signum: int, line: str):
        super().__init__(128 + signum)
        self.signum, self.line = signum, line


class Asked:
    """The first signal deferred() recorded (None: none yet)."""

    signum: int | None = None


@contextlib.contextmanager
def deferred(sigs: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> Iterator[Asked]:
    """Record `sigs` instead of raising them, whatever handled them before (main thread only); restore on exit.

    SLURM sends SIGTERM to requeue or preempt a job and then waits KillWait seconds before SIGKILL; sbatch
    --signal=USR1@<seconds> warns before the time limit. A step in flight finishes, then the run checkpoints."""
    asked, previous = Asked(), {}

    def record(signum: int, _frame: Any) -> None:
        asked.signum = asked.signum or signum

    if threading.current_thread() is threading.main_thread():
        for sig in sigs:
            previous[sig] = signal.signal(sig, record)
    try:
        yield asked
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
