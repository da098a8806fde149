"""Fixtures of the training tests: a tiny in-repo corpus, so no test needs the network."""

from pathlib import Path

import pytest
from train_testing import FIXTURE_CORPUS


@pytest.fixture
def corpus_dir() -> Path:
    return FIXTURE_CORPUS


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """One data cache for every run of the session (the fixture corpus is tokenized once)."""
    return tmp_path_factory.mktemp("cache")
