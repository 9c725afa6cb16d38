"""The report's one jinja2 environment (autoescape on): the page's template and the sections' partials."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def environment():
    from jinja2 import Environment, PackageLoader, select_autoescape

    from harness.report import format

    env = Environment(loader=PackageLoader("harness.report", "templates"), autoescape=select_autoescape(["html", "j2"]))
    env.filters.update(ms=format.ms, number=format.number, percent=format.percent,
                       percent_number=format.percent_number, ratio=format.ratio)
    return env


def render(template: str, **data) -> str:
    return environment().get_template(template).render(**data)
