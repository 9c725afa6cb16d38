"""The one error type users see: a single line that names the culprit."""
from __future__ import annotations


class HarnessError(Exception):
    """Bad input or an impossible request. Its message is one line, printed without a traceback."""


class SpecError(HarnessError):
    """A model spec that cannot be loaded, validated or built."""
