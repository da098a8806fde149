"""Fixtures of the training tests: a tiny in-repo corpus, so no test needs the network."""

from pathlib import Path

import pytest
from train_testing import FIXTURE_CORPUS


@pytest.fixture
def corpus_dir() -> Path:
    return FIXTURE_CORPUS
