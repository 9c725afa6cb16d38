"""Each test's own cache of machine facts (tests/conftest.py): never the user's ~/.cache/amp-harness, nor what an
earlier test or run left behind."""
from tests.conftest import machine_cache  # noqa: F401  (an autouse fixture: importing it here applies it)
