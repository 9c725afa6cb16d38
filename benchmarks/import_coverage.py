"""Which real architectures `amp-harness import` translates: the table in docs/import.md ("Coverage"), written by
running the importers, never typed.

    .tox/core/bin/python benchmarks/import_coverage.py            # rewrite the table in docs/import.md
    .tox/core/bin/python benchmarks/import_coverage.py --print    # print it instead

Keras: every model configuration in tests/core/data/keras (keras.applications at 32x32x3 and 10 classes with random
weights, and the importer's test models), imported in this process (the importer reads JSON; Keras is never
imported). PyTorch: every torch model of the native specs (benchmarks/native/torch_*.yaml: Hugging Face GPT-2, Llama,
BERT, ViT, MobileNetV2 in small configs, nn.TransformerEncoder), imported by the torch env's `amp-harness import torch`
(`.tox/torch`, which `tox` builds); without that env their rows say so.
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.errors import HarnessError  # noqa: E402
from harness.model.graph import infer  # noqa: E402
from harness.model.importers.keras import import_keras  # noqa: E402
from harness.model.spec import load_spec, validate  # noqa: E402

KERAS_DATA = ROOT / "tests" / "core" / "data" / "keras"
DOC = ROOT / "docs" / "import.md"
BEGIN, END = "<!-- import coverage: begin -->", "<!-- import coverage: end -->"
TORCH_PYTHON = ROOT / ".tox" / "torch" / "bin" / "python"


def _cell(text: str, limit: int = 220) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def keras_rows() -> list[tuple[str, str, str]]:
    counts = json.loads((KERAS_DATA / "params.json").read_text())
    rows = []
    for path in sorted([*KERAS_DATA.glob("*.json.gz"), *KERAS_DATA.glob("*.json")]):
        name = path.name.removesuffix(".gz").removesuffix(".json")
        if name == "params":
            continue
        with tempfile.TemporaryDirectory() as folder:
            plain = Path(folder) / f"{name}.json"
            plain.write_bytes(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())
            try:
                spec = validate(import_keras(plain).spec, name)
            except HarnessError as exc:
                lines = getattr(exc, "lines", [str(exc)])
                why = lines[0].split(": ", 1)[-1] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
                rows.append((f"Keras `{name}`", "refused", _cell(why)))
                continue
        graph = infer(spec)
        keras = counts.get(name, {})
        same = "= Keras's" if graph.param_count == keras.get("trainable") else f"Keras: {keras.get('trainable')}"
        merges = sum(1 for info in graph.layers if info.type in ("add", "multiply", "concat"))
        rows.append((f"Keras `{name}`", "imported",
                     f"{len(graph.layers)} layers ({merges} merges), {graph.param_count:,} trainable parameters {same}"))
    return rows


def torch_rows() -> list[tuple[str, str, str]]:
    rows = []
    for path in sorted((ROOT / "benchmarks" / "native").glob("torch_*.yaml")):
        spec = load_spec(str(path))
        label = f"PyTorch `{spec.native.target.split(':')[-1]}` ({path.name})"
        if not TORCH_PYTHON.exists():
            rows.append((label, "not tried", "no torch env (.tox/torch): run `tox -e torch` first"))
            continue
        shape = ",".join(map(str, spec.input.shape))
        done = subprocess.run([str(TORCH_PYTHON), "-m", "harness", "import", "torch", spec.native.target,
                               "--input-shape", shape], capture_output=True, text=True, cwd=ROOT, timeout=600)
        errors = [line.removeprefix("amp-harness: error: ") for line in done.stderr.splitlines()
                  if line.startswith("amp-harness: error: ")]
        if done.returncode != 0:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            rows.append((label, "refused", _cell((errors[0] if errors else done.stderr.strip()[-200:]) + more)))
            continue
        graph = infer(validate(yaml.safe_load(done.stdout), label))
        rows.append((label, "imported", f"{len(graph.layers)} layers, {graph.param_count:,} trainable parameters"))
    return rows


def table() -> str:
    rows = keras_rows() + torch_rows()
    done = sum(1 for _, status, _ in rows if status == "imported")
    lines = [f"{done} of {len(rows)} imported (`.tox/core/bin/python benchmarks/import_coverage.py` wrote this table).",
             "", "| model | import | what it gives, or the first problem |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main() -> None:
    text = table()
    if "--print" in sys.argv:
        print(text)
        return
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC}: no {BEGIN} ... {END} to write the table between")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    print(f"wrote the table into {DOC}")


if __name__ == "__main__":
    main()
