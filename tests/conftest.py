"""Shared test configuration: the ``cuda`` marker skips without a GPU with base_moe's CUDA kernels."""

import pytest
import torch

import base_moe

# Tiny models and ops: one intra-op thread is fastest, and immune to OpenMP stalls on a shared machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if base_moe.cuda_available():
        return
    reason = "needs a CUDA GPU and base_moe built with its CUDA kernels"
    if torch.cuda.is_available():
        reason = "base_moe was built without CUDA kernels"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
