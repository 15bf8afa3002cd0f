import pytest
from harness import close_pools, job_segments


@pytest.fixture(scope="session", autouse=True)
def _pools_closed_and_no_segments_left():
    """The suite's own jobs leave no shared memory behind (other jobs on the machine may)."""
    before = job_segments()
    yield
    close_pools()
    leftover = job_segments() - before
    assert not leftover, f"shared-memory segments left behind: {sorted(leftover)}"


def pytest_collection_modifyitems(config, items):
    from harness import suite_backend

    from anyccl import gpu

    if suite_backend() != "shm":
        skip = pytest.mark.skip(reason=f"tests the shm transport itself, not {suite_backend()}")
        for item in items:
            if "shm_only" in item.keywords:
                item.add_marker(skip)
        once = pytest.mark.skip(reason="checks of the project run in the shm pass")
        for item in items:
            if "project" in item.keywords:
                item.add_marker(once)

    if gpu.device_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
