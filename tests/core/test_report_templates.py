"""The report's layering: markup lives in the templates (harness/report/templates), figures are formatted by
harness/report/format.py, and each precision's chart style lives in its registry entry."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from harness.report import format as f

REPORT = Path(__file__).resolve().parents[2] / "harness" / "report"
# the page's elements; the charts' SVG (svg, g, path, text, tspan, title) is written by harness.report.svg
HTML_TAG = re.compile(r"</?(html|head|body|section|nav|h[1-6]|p|div|span|a|br|ul|ol|li|table|caption|thead|tbody|tr|"
                      r"th|td|details|summary|figure|figcaption|strong|em|b|i|code|pre|img|link|script|style)\b[ />]",
                      re.IGNORECASE)
CHART_MODULES = {"svg.py", "charts.py"}  # coordinates and axis ticks of the plotting layer
NOT_OURS = {"setting.py"}  # the identity module words loss-scale settings itself


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal in code, f-strings' literal parts included, docstrings not."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            docstrings.add(id(node.body[0].value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def _modules() -> list[Path]:
    return sorted(REPORT.glob("*.py"))


def test_no_html_in_python_strings():
    found = [f"{path.name}:{line}: {text[:60]!r}" for path in _modules()
             for line, text in _strings(ast.parse(path.read_text())) if HTML_TAG.search(text)]
    assert not found, "HTML belongs in harness/report/templates, not in Python strings:\n" + "\n".join(found)


def test_every_figure_is_formatted_by_the_format_module():
    """No format spec ({x:.2f}, {x:.0%}) outside format.py: a figure reads the same wherever it appears."""
    found = []
    for path in _modules():
        if path.name in CHART_MODULES | NOT_OURS | {"format.py"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "format figures with harness.report.format:\n" + "\n".join(found)


def test_templates_format_figures_through_the_format_module_filters():
    templates = sorted((REPORT / "templates").glob("*.j2"))
    assert {t.name for t in templates} >= {"report.html.j2", "report.md.j2", "_answer.html.j2", "_answer.md.j2",
                                           "_pure16.html.j2", "_pure16.md.j2", "_profile.html.j2", "_profile.md.j2",
                                           "_why.html.j2", "_why.md.j2"}
    found = [f"{t.name}: {m.group(0)}" for t in templates for m in re.finditer(r"'%[^']*'\s*%", t.read_text())]
    assert not found, found  # '%.2f' % x: a figure formatted beside the format module


def test_figures_as_the_report_words_them():
    assert (f.ms(3.14159), f.ms(1234.5), f.ms(None)) == ("3.14", "1,234", "-")
    assert (f.percent(0.1234), f.percent(0.1234, 1, spaced=True), f.percent(float("nan"))) == ("12.3%", "12.3 %", "-")
    assert f.percent_range(0.121, 0.124) == "12%" and f.percent_range(0.12, 0.15) == "12%-15%"
    assert (f.points(-0.031), f.percent_span(0.912, 0.92)) == ("-3.1 pt", "91.2-92.0%")
    assert (f.ratio(1.234), f.faster(1.234), f.faster(0.5), f.times_slower(0.05)) == \
        ("x1.23", "1.23x faster", "2.00x slower", "20x slower")
    assert (f.factor(1.54), f.factor(24.0), f.factor(None)) == ("1.5x", "24x", "-")
    assert (f.scale(65536.0), f.scale(3.0), f.power_of_two(4)) == ("2^16", "3", "2^4")
