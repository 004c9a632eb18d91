"""Fixtures shared by test files."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """A 0.8M-parameter model gains nothing from intra-op threads, and on a busy 2-core machine their
    spin-waits cost 5-10x: files that run it in-process use one thread (their `pytestmark`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
