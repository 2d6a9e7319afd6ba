"""One local Ray for the whole test session, started only if a test asks for it; the tiers
of the suite (`make test-fast` runs neither Ray nor other processes)."""

import inspect
from pathlib import Path

import pytest
import torch

# A test whose own source (or its module's helpers it names) does one of these starts
# processes: the CLI in this process (it starts an embedded Ray), a subprocess, a Ray head.
PROCESS_WORDS = ("subprocess", "Popen", 'main(["run"', "main(['run'", "run_pipeline(",
                 "ray.init", "start_head", "ray_head", "start_cluster")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Marks `ray` (uses the session's Ray) and `slow` (starts processes) on each test, keeps
    the tests that share a costly fixture in one xdist group, and puts the slow ones first."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.ray)
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
        group = _shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    # `make test` runs on 2 xdist workers: the longest first, so neither waits alone at the end.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow")
               or item.get_closest_marker("cluster") else 1 if item.get_closest_marker("ray")
               else 2)


# Fixtures every worker of `make test` may start for itself: each keeps one local Ray.
PER_WORKER_FIXTURES = {"ray_session"}


def _shared_fixture_group(item) -> str | None:
    """The test's module (or session fixture) when it uses one of our module- or
    session-scoped fixtures that starts processes: a Ray head, a cluster, runs that other
    tests read. Tests that share one run on the same xdist worker, so it starts once."""
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name, defs in sorted(definitions.items()):
        fixture = defs[-1]
        if name in PER_WORKER_FIXTURES or fixture.scope not in ("module", "session"):
            continue
        if Path(inspect.getfile(fixture.func)).parent != Path(__file__).parent:
            continue  # pytest's own (tmp_path_factory, ...)
        source = inspect.getsource(fixture.func)
        if "ray_session" in fixture.argnames or any(word in source for word in PROCESS_WORDS):
            return name if fixture.scope == "session" else item.module.__name__
    return None


def _starts_processes(item) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    source = inspect.getsource(function)
    module = inspect.getmodule(function)
    helpers = [getattr(module, name) for name in dir(module)
               if name in source and inspect.isfunction(getattr(module, name))
               and getattr(module, name) is not function]
    texts = [source, *(inspect.getsource(helper) for helper in helpers)]
    return any(word in text for text in texts for word in PROCESS_WORDS)


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is a runtime dependency")
    from raydp_train.train.trainer import ensure_ray

    # The embedded Ray of `raydp-train run`: 4 logical CPUs, so 2 workers, the progress
    # queue and Ray Train's controller all schedule on 2 cores (ARCHITECTURE.md §4).
    ensure_ray(None, num_cpus=4)
    yield ray
    ray.shutdown()


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
        help="randomized soundness suite: check N generated models (default 5000) instead of 300",
    )
