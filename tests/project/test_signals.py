"""pipeline/core/signals.py: signals raised as exceptions, held through the sections a signal would break."""

import os
import signal

import pytest
import torch

from pipeline.weights import checkpoint
from pipeline.core import signals


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)  # the handler runs before os.kill returns to Python code


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, signals.Stopped),
                                         (signal.SIGHUP, signals.Stopped)])
def test_a_signal_inside_a_held_section_is_raised_when_it_ends(sig, raised):
    done = []
    with signals.stopping():
        with pytest.raises(raised) as stopped:
            with signals.held():
                with signals.held():  # nested: only the outermost raises
                    kill_self(sig)
                    done.append("inner")
                done.append("outer")
            done.append("after")
    assert done == ["inner", "outer"]
    assert sig == signal.SIGINT or stopped.value.code == 128 + sig


def test_a_second_signal_inside_a_held_section_is_raised_at_once():
    done = []
    with signals.stopping(), pytest.raises(KeyboardInterrupt):
        with signals.held():
            kill_self(signal.SIGINT)
            done.append("first held")
            kill_self(signal.SIGINT)
            done.append("second held")
    assert done == ["first held"]
    with signals.stopping(), pytest.raises(signals.Stopped):  # nothing left pending from the first
        kill_self(signal.SIGTERM)


def test_stopping_restores_the_handlers_and_leaves_ignored_signals_ignored():
    before = {sig: signal.getsignal(sig) for sig in signals.SIGNALS}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a command
    try:
        with signals.stopping():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            kill_self(signal.SIGHUP)  # ignored: nothing raised
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_caused_by_signal_follows_the_chain_of_exceptions():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("PytorchStreamWriter failed") from None
    except RuntimeError as e:
        wrapped = e
    assert signals.caused_by_signal(wrapped) and signals.caused_by_signal(signals.Stopped(143))
    assert not signals.caused_by_signal(RuntimeError("boom")) and not signals.caused_by_signal(SystemExit(1))


def test_ctrl_c_while_a_checkpoint_is_written_lets_it_finish_then_stops(tmp_path, monkeypatch):
    """torch.save calls the file's write() from C++: a KeyboardInterrupt raised there became its RuntimeError."""
    real, writes = checkpoint._HashingWriter.write, []

    def write(self, data):
        writes.append(len(data))
        if len(writes) == 1:
            kill_self(signal.SIGINT)
        return real(self, data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", write)
    payload = {"step": 7, "model": {"w": torch.arange(50_000, dtype=torch.float32)}}
    with signals.stopping(), pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, payload, keep=2)
    assert len(writes) > 1
    [saved] = checkpoint.complete_checkpoints(tmp_path)  # written whole and sealed
    assert saved.name == "step_00000007.pt"
    assert torch.equal(checkpoint.load_checkpoint(saved)["model"]["w"], payload["model"]["w"])
