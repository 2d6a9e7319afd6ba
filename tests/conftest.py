"""One local Ray for the whole test session, started only if a test asks for it."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray", reason="ray is a runtime dependency")
    # 4 logical CPUs on a 2-core machine: 2 workers, the progress queue and Ray Train's
    # controller must all schedule (DESIGN §5).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
