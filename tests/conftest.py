import pytest
from harness import close_pools, job_files, remove_suite_files


@pytest.fixture(scope="session", autouse=True)
def _pools_closed_and_nothing_left():
    """At the end of the run, the suite's own jobs (their ids start with the suite's prefix;
    other jobs on the machine may leave what they like) have left nothing in /dev/shm or /tmp:
    no shared memory, no job directory; the flight records tests provoked go with the suite's
    flight-record directory."""
    before = job_files()
    yield
    close_pools()
    remove_suite_files()
    leftover = job_files() - before
    assert not leftover, f"left behind by this run's jobs: {sorted(leftover)}"


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
