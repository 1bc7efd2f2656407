import os
from pathlib import Path

import pytest
import torch

# Tests are small: more threads than cores only adds contention on the 2-core CI machines.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared test data directory ($GLASSLM_DATA_DIR; CI points it at ../shared/data)."""
    path = os.environ.get("GLASSLM_DATA_DIR")
    if not path or not Path(path).is_dir():
        pytest.skip("set GLASSLM_DATA_DIR to the shared data directory (tinyshakespeare.txt, gpt2/)")
    return Path(path)


@pytest.fixture(scope="session")
def shakespeare_text(data_dir) -> str:
    path = data_dir / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path.read_text(encoding="utf-8")
