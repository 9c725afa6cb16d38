"""The report's jinja2 environments: the page's templates (*.html.j2, autoescape on) and the Markdown summary's
(*.md.j2, no autoescape; the `md` filter escapes a table cell). Both format figures with harness.report.format,
as filters of the same names."""
from __future__ import annotations

from functools import lru_cache


def md(text) -> str:
    """Text for a Markdown table cell: a pipe would end the cell, a newline the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


@lru_cache(maxsize=2)
def environment(markdown: bool = False):
    from jinja2 import Environment, PackageLoader

    from harness.report import format

    loader = PackageLoader("harness.report", "templates")
    env = Environment(loader=loader, trim_blocks=True, lstrip_blocks=True) if markdown else \
        Environment(loader=loader, autoescape=True)
    env.filters.update(ms=format.ms, number=format.number, percent=format.percent,
                       percent_number=format.percent_number, ratio=format.ratio, md=md)
    return env


def render(template: str, **data) -> str:
    """Render a template of templates/: a .md.j2 one as Markdown, any other as HTML."""
    return environment(template.endswith(".md.j2")).get_template(template).render(**data)
