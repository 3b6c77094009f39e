"""The devices the torch-facing tests run on, defined once for every such file (conftest.py's
`tdev` parameter, test_transformers_experts.py's `torch_device`)."""

from __future__ import annotations

import pytest
import routemm


def have_torch_cuda() -> bool:
    """True where both torch and routemm's CUDA backend see a GPU."""
    import torch

    return torch.cuda.is_available() and "cuda" in routemm.available_backends()


def torch_devices() -> list:
    """CPU always; CUDA as a parameter that is skipped, visibly, where torch or routemm has no GPU."""
    skip = pytest.mark.skip(reason="torch or routemm has no CUDA device here")
    return ["cpu", pytest.param("cuda", marks=() if have_torch_cuda() else skip)]
