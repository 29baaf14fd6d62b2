"""Test-wide environment: nothing phones home, nothing lands in the repo's own mlflow.db."""

import gc
import os
import shutil
import signal
import sys
from pathlib import Path

# One thread a process unless a test asks for more: two workers share two cores, and two-thread processes side by
# side oversubscribe them (libgomp's waiting threads spin on a core another process needs: measured here, a tiny
# training run at two threads beside another job took 3.6 times the CPU of one at one thread). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pipeline.core import collector  # noqa: E402

# The cyclic garbage collector paused while the test modules load (torch, dynamo, MLflow...: millions of objects that
# live as long as the worker), resumed once all are collected, those objects frozen out of its walks, which otherwise
# go through all of them again and again while the tests allocate (a sixth of the CPU of the in-process tests,
# measured on three files). pipeline/core/collector.py; a stage's command does the same.
collector.pause()

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.fixtures.session import built_once  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PIPELINE_VIEWS", "0")  # pipeline/core/views.py: on only where a test checks them


@pytest.fixture(scope="session")
def _new_store(tmp_path_factory) -> Path:
    """A new sqlite MLflow store, its tables made by MLflow itself (its migrations take seconds a store), once a
    session (tests/fixtures/session.py): each test's store is a copy, made before the test opens it."""
    def make(folder: Path) -> None:
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()

    return built_once(tmp_path_factory, "new_store", make) / "mlflow.db"


@pytest.fixture(autouse=True)
def _private_tracking_store(tmp_path_factory, monkeypatch, _new_store):
    """Each test gets its own sqlite MLflow store (a new one, beside its tmp_path) unless it sets another."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    shutil.copyfile(_new_store, db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(autouse=True)
def _torchs_products_after():
    """A train stage run in the test's process sets its CPU products for the process (oneDNN's on a CPU with AVX-512
    and without AMX, pipeline/device/cpu_matmul.py): each test leaves torch's BLAS and default attention behind."""
    yield
    from pipeline.device import attention, cpu_matmul

    cpu_matmul.use("fp32")
    with pytest.MonkeyPatch.context() as env:  # whatever the test left in TRANSFORMER_SDPA_BACKENDS: CPUs ignore it
        env.delenv(attention.ENV, raising=False)
        attention.use(torch.device("cpu"))


@pytest.fixture
def one_thread(monkeypatch):
    """In-process training on one thread, as each process a test starts (pinned to one core): the same sums."""
    from pipeline.device import distributed

    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def aot_eager(monkeypatch, tmp_path):
    """train.compile with backend aot_eager ($TRANSFORMER_COMPILE_BACKEND, pipeline/device/compiled.py): dynamo
    captures and AOT autograd builds the forward and backward graphs, as with inductor, run with aten kernels
    instead of a C++ build (minutes on a shared 2-core CPU); dynamo reset and its counters cleared around the
    test, and an MLflow store of the test's own."""
    from pipeline.device import compiled

    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps dynamo's counters
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def _private_peak_cache(tmp_path_factory):
    """Training's peak FLOP/s cache (pipeline/device/peak.py) lives under XDG_CACHE_HOME: one for the session, not ~/.cache."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True, scope="session")
def _signals_as_in_a_terminal():
    """SIGINT raises KeyboardInterrupt and SIGHUP stops, as in a terminal, also where the suite started with them ignored
    (a background job of a non-interactive shell, nohup): the signal tests send them to their own process."""
    before = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_DFL)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def pytest_collection_modifyitems(config, items):
    """The files holding a slow test first, in collection order, then the rest: pytest-xdist hands each worker a file
    at a time in this order (`make test`: --dist loadfile --no-loadscope-reorder), so the files that take minutes
    start together and the short ones fill in at the end, instead of one long file running alone last.

    Among the slow files, the first that needs the session's tiny run (tests/fixtures/tiny_run.py) goes first: it
    builds the run while the other worker takes the other slow files, and the rest of its users come after those,
    when the run is built, instead of waiting on its lock side by side."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    tiny = list(dict.fromkeys(item.path for item in items if item.path in slow and "tiny_run" in item.fixturenames))

    def place(item) -> int:
        if item.path not in slow:
            return 3
        if item.path in tiny:
            return 0 if item.path == tiny[0] else 2
        return 1

    items.sort(key=place)


def pytest_collection_finish(session):
    collector.resume()  # see the top


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test and its fixtures' teardown: what is still alive (the modules and caches its
    tests loaded) frozen too, once its garbage is collected, so that the next files' collections walk only their own
    objects (a sixth less CPU in the in-process tests of five files, measured)."""
    yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()
