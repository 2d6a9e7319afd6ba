"""One local Ray for the whole test session, started only if a test asks for it."""

import pytest
import torch


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is a runtime dependency")
    from raydp_train.train.trainer import ensure_ray

    # The embedded Ray of `raydp-train run`: 4 logical CPUs, so 2 workers, the progress
    # queue and Ray Train's controller all schedule on 2 cores (ARCHITECTURE.md §4).
    ensure_ray(None, num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Each test remembers its own passed model checks (passed_checks), never the user's."""
    monkeypatch.setenv("RAYDP_TRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))


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
