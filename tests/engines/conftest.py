"""The engines' room's fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest


# Tiny models built in the session (tools/tiny_models.py: random weights, a tokenizer trained on
# made-up text, nothing downloaded), for the parity tests and check-model's.
@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    from tools.tiny_models import build_bert

    return build_bert(tmp_path_factory.mktemp("tiny-bert"), seed=1)


@pytest.fixture(scope="session")
def tiny_modernbert(tmp_path_factory) -> Path:
    from tools.tiny_models import build_modernbert

    return build_modernbert(tmp_path_factory.mktemp("tiny-modernbert"), seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from tools.tiny_models import build_llama

    return build_llama(tmp_path_factory.mktemp("tiny-llama"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from tools.tiny_models import build_qwen3

    return build_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), seed=1)
