"""Fixtures shared by test files."""
import pytest
import torch

import tiny


@pytest.fixture(scope="module")
def one_thread():
    """A 0.8M-parameter model gains nothing from intra-op threads, and on a busy 2-core machine their
    spin-waits cost 5-10x: files that run it in-process use one thread (their `pytestmark`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return tiny.make_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    """A small *random* tiny model (fp32, CPU), shared by a module's tests: those that change weights work on
    a deepcopy. Its next-token distribution is close to uniform over 17 tokens, so EOS (p ~ 1/17 per token)
    ends some responses and the caps end others."""
    return tiny.make_model(tok, seed=0).eval()
