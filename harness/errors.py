"""The one error type users see: a single line that names the culprit."""
from __future__ import annotations

import re


class HarnessError(Exception):
    """Bad input or an impossible request. Its message is one line, printed without a traceback."""


class SpecError(HarnessError):
    """A model spec that cannot be loaded, validated or built."""


def clip(value: object, limit: int = 60) -> str:
    """A user's value as it may appear in a one-line message: one line, at most `limit` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(exc: BaseException) -> str:
    """The telling line of a framework's exception: frameworks (MXNet) put a C++ traceback before their message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^\w*(Error|Exception)\b", line)]
    return named[-1] if named else f"{type(exc).__name__}: {lines[0] if lines else ''}"
