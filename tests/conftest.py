import glob

import pytest
from harness import close_pools


@pytest.fixture(scope="session", autouse=True)
def _pools_closed_and_no_segments_left():
    before = set(glob.glob("/dev/shm/anyccl-*"))
    yield
    close_pools()
    leftover = set(glob.glob("/dev/shm/anyccl-*")) - before
    assert not leftover, f"shared-memory segments left behind: {sorted(leftover)}"


def pytest_collection_modifyitems(config, items):
    try:
        import cupy  # noqa: F401

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
