"""One local Ray for the whole test session, started only if a test asks for it."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is a runtime dependency")
    from raydp_train.train.trainer import ensure_ray

    # The embedded Ray of `raydp-train run`: 4 logical CPUs, so 2 workers, the progress
    # queue and Ray Train's controller all schedule on 2 cores (DESIGN §5).
    ensure_ray(None, num_cpus=4)
    yield ray
    ray.shutdown()
