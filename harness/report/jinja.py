"""The report's one jinja2 environment (autoescape on): the page's template and the sections' partials."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def environment():
    from jinja2 import Environment, PackageLoader, select_autoescape

    return Environment(loader=PackageLoader("harness.report", "templates"), autoescape=select_autoescape(["html", "j2"]))


def render(template: str, **data) -> str:
    return environment().get_template(template).render(**data)
