"""One local Ray for the whole test session, started only if a test asks for it; the tiers
of the suite (`make test-fast` runs neither Ray nor other processes)."""

import inspect
import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Markers a test declares (pytest.ini's list in pyproject.toml) that allow it to start
# processes; `ray` is also set here on every test that uses the session's Ray.
PROCESS_MARKERS = ("slow", "cluster", "ray")


def pytest_collection_modifyitems(config, items):
    """Marks `ray` on each test that uses the session's Ray, checks that a costly session
    fixture is shared within one file, puts the tests that start processes first."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    _check_shared_within_one_file(items)
    # `make test` runs on 2 xdist workers: the longest first, so neither waits alone at the end.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow")
               or item.get_closest_marker("cluster") else 1 if item.get_closest_marker("ray")
               else 2)


class UndeclaredProcess(RuntimeError):
    """A test started a process without declaring it (make test-fast would run it)."""


@pytest.fixture(autouse=True)
def processes_declared(request, monkeypatch):
    """A test that starts a process (a subprocess, Ray, multiprocessing) must be marked
    `slow` (or `cluster`, or use the session's Ray): `make test-fast` leaves those out."""
    if any(request.node.get_closest_marker(name) for name in PROCESS_MARKERS):
        yield
        return

    def refuse(*args, **kwargs):
        raise UndeclaredProcess(f"{request.node.nodeid} starts a process: mark it "
                                "@pytest.mark.slow (tests/conftest.py)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


# Fixtures every worker of `make test` may start for itself: each keeps one local Ray.
PER_WORKER_FIXTURES = {"ray_session"}

# A session fixture whose source does one of these starts processes.
PROCESS_WORDS = ("subprocess", "Popen", 'main(["run"', "main(['run'", "run_pipeline(",
                 "ray.init", "start_head", "ray_head", "start_cluster")


def _check_shared_within_one_file(items) -> None:
    """`make test` gives each pytest-xdist worker whole files (--dist loadfile): a module's
    Ray head or cluster starts once. A session fixture that starts processes (runs that
    several tests read) would start once per worker whose files use it: keep its users in
    one file."""
    users: dict[str, set] = {}
    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name, defs in definitions.items():
            fixture = defs[-1]
            if name in PER_WORKER_FIXTURES or fixture.scope != "session":
                continue
            if Path(inspect.getfile(fixture.func)).parent != Path(__file__).parent:
                continue  # pytest's own (tmp_path_factory, ...)
            if "ray_session" in fixture.argnames or any(
                    word in inspect.getsource(fixture.func) for word in PROCESS_WORDS):
                users.setdefault(name, set()).add(item.path.name)
    for name, files in users.items():
        if len(files) > 1:
            raise pytest.UsageError(f"the session fixture {name!r} starts processes and is "
                                    f"used by {sorted(files)}: keep its tests in one file")


# The embedded Ray of `raydp-train run`: 4 logical CPUs, so 2 workers and Ray Train's
# controller all schedule on 2 cores (ARCHITECTURE.md §4).
SESSION_RAY_CPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is a runtime dependency")
    from raydp_train.train.trainer import ensure_ray

    ensure_ray(None, num_cpus=SESSION_RAY_CPUS)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def session_ray_up(request):
    """A test before may have shut the session's Ray down (a refused --address does): start it
    again as it was. Else Ray Data would start one on its own, with this machine's 2 CPUs,
    which 2 training workers fill, and a dataset shard's read would wait for ever."""
    ray = sys.modules.get("ray")
    if "ray_session" in request.fixturenames and ray is not None and not ray.is_initialized():
        from raydp_train.train.trainer import ensure_ray

        ensure_ray(None, num_cpus=SESSION_RAY_CPUS)
    yield


@pytest.fixture(scope="session")
def documented_run(ray_session, tmp_path_factory):
    """`raydp-train run` of one of tests/test_documented_inputs.py's pipelines, each run once
    per session and shared (tests/test_predict.py predicts on them): its run directory and
    everything it printed."""
    import contextlib
    import io
    import json

    from test_documented_inputs import runs, write_files

    from raydp_train.commands.cli import main

    folder = tmp_path_factory.mktemp("documented")
    pipelines, done = runs(write_files(folder), folder), {}

    def run(name: str):
        if name not in done:
            pipeline, printed = pipelines[name], io.StringIO()
            path = folder / f"{name}.yaml"
            path.write_text(json.dumps(pipeline))
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                code = main(["run", str(path)])
            assert code == 0, printed.getvalue()[-6000:]
            (run_dir,) = Path(pipeline["run"]["output_dir"]).iterdir()
            done[name] = run_dir, printed.getvalue()
        return done[name]

    return run


@pytest.fixture(autouse=True)
def no_accountant_left():
    """A test's budget accountants stop when it ends. The session's Ray would otherwise keep
    every one opened from this process (tens by the end), each an idle process costing the
    2 cores about 0.7% of one; a budget opened again restarts from its ledger."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from raydp_train.budget.actor import actor_name
    from raydp_train.budget.book import NAMESPACE

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(actor_name("")):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
            except ValueError:  # gone since it was listed
                pass


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Each test remembers its own passed model checks (passed_checks) and keeps its own
    default ledger ($RAYDP_TRAIN_HOME/budgets), never the user's."""
    monkeypatch.setenv("RAYDP_TRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("RAYDP_TRAIN_HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def float64():
    """Compare in float64 so 1e-5 relative error measures the method, not rounding."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def pytest_addoption(parser):
    parser.addoption(
        "--long", nargs="?", type=int, const=5000, default=None,
        help="the long mode: the randomized soundness suites check N generated models (default "
             "5000), and the checks that take minutes (a training file larger than Ray's object store) run",
    )
