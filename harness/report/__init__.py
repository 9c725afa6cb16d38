"""The report: `view` turns records into a view model (statistics in `stats`, what an accuracy figure can say in
`accuracy`, the first screen's matrix and recommendations in `answer`, prose rules in `explain`, charts in
`charts`); `render` writes the page, and `markdown` the first screen as Markdown beside it."""
from harness.report.render import render, write_report
from harness.report.view import build_view

__all__ = ["build_view", "render", "write_report"]
