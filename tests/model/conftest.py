import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread():
    """One intra-op thread unless ORBITFLOW_TEST_THREADS says otherwise.

    On a shared, oversubscribed box multi-threaded OpenMP regions stall badly; parity checks still run ours
    and transformers under the same setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("ORBITFLOW_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(previous)
