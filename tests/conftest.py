"""Shared test setup.

- The `device` fixture: every op test runs on "cpu", and on "cuda" where it can.
- Under pytest-xdist, each worker runs torch on its share of the cores.
- The `gpu` marker: a test (or a "cuda" case of `device`) carrying it is skipped, with the reason,
  unless a CUDA device is visible and fp8kv was built with its CUDA kernels. `pytest -m gpu`
  selects every GPU case.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp8kv


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores: N workers of torch's default
    (one thread per core) oversubscribe the machine, and a CPU reference that takes 2 s alone took
    over 200 s with 14 workers on a 16-core host."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _cuda_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not fp8kv.has_cuda_kernels():
        return "fp8kv was built without CUDA kernels"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One intra-op CPU thread for modules of tiny models: a second thread only adds synchronization
    (10x slower on a 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
