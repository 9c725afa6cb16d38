"""The report: `view` reads records as harness.records' models (harness.results.typed) and turns them into the
typed objects of `data` (the verdicts and their words in `verdicts`, a precision's runs beside fp32 in `arms`,
statistics in `stats`, what an accuracy figure can say in `accuracy`, the first screen's matrix and
recommendations in `answer`, prose rules in `explain`, charts in `charts`, every figure's format in `format`);
`render` writes the page and the Markdown summary beside it from the templates, a partial per section."""
from harness.report.render import render, write_report
from harness.report.view import build_view

__all__ = ["build_view", "render", "write_report"]
