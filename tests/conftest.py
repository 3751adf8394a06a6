import os
import tempfile

import pytest
import torch

from engine_fixture import engine  # noqa: F401  (a real engine process per test module)

pytest_plugins = ["reliability.recorder"]  # the reliability suites' table, also under pytest-xdist

# Without a GPU the Triton kernels run in triton's interpreter. Triton reads this when it is first imported, which
# torch and diffusers may do long before a kernel test, so it is set for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines the nodes auto-launch log to $H3FORGE_LOG_DIR (else ~/.h3forge/logs): keep the tests' logs out of $HOME.
os.environ.setdefault("H3FORGE_LOG_DIR", tempfile.mkdtemp(prefix="h3forge-test-logs-"))


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: one thread runs them faster than two (and far faster on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
