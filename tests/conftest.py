import pytest
import torch

from tests.oracle import FIXTURE


@pytest.fixture(scope="session", autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For tests of tiny models: with two threads on a busy shared 2-core machine, thread hand-offs stall each matmul
    by milliseconds (a 5x slowdown measured); one thread keeps them fast. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def fixture_path():
    """The official-format tiny checkpoint (model_type qwen3 + mask_token_id), copied from the oracle."""
    return FIXTURE


@pytest.fixture(scope="session")
def model64():
    from refusion_hf import RefusionForCausalLM

    return RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def model32():
    from refusion_hf import RefusionForCausalLM

    return RefusionForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
