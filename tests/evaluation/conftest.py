import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    """The fixture model is tiny: with two threads on a busy shared 2-core machine, thread hand-offs stall each
    matmul by milliseconds (a 5x slowdown measured); one thread keeps these tests fast. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
