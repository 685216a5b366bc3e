"""The product's test fixtures (tests/conftest.py: the tiny model, engines, S3 servers) for the lab's tests."""

from tests.conftest import *  # noqa: F403  (fixtures and the GPU/vLLM skip hook)
from tests.conftest import pytest_collection_modifyitems  # noqa: F401
