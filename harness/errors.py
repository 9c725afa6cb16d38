"""The one error type users see: a single line that names the culprit."""
from __future__ import annotations


class HarnessError(Exception):
    """Bad input or an impossible request. Its message is one line, printed without a traceback."""


class SpecError(HarnessError):
    """A model spec that cannot be loaded, validated or built."""


def clip(value: object, limit: int = 60) -> str:
    """A user's value as it may appear in a one-line message: one line, at most `limit` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
