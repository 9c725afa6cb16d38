"""The kit's specs: the goldens' (every built-in model and pitfall spec at CPU-sized batches, embedded in
goldens.json), and failure messages that quote what a spec isolates."""
from __future__ import annotations

from pathlib import Path

import yaml

from harness.conformance.goldens import load
from harness.errors import HarnessError
from harness.model.spec import ModelSpec, validate


def _specs() -> tuple[dict[str, ModelSpec], dict[str, str]]:
    try:
        specs = {g["model"]: validate(g["fingerprint"]["spec"], f"goldens.json: {g['model']}") for g in load()}
    except HarnessError:  # no goldens yet: test_goldens_are_shipped reports it
        return {}, {}
    # a text dataset's default corpus is this Python's standard library, whose files differ between versions:
    # there the spec is re-resolved on the local files (the math checks hold on any text) and its golden,
    # made from other bytes, cannot be compared
    other_corpus = {}
    for name, spec in specs.items():
        if spec.dataset.corpus_hash is not None:
            from harness.model.data import corpus_hash, read_corpus

            local = corpus_hash(read_corpus(spec.dataset.path))
            if local != spec.dataset.corpus_hash:
                other_corpus[name] = f"its corpus here has hash {local}, the golden's {spec.dataset.corpus_hash}"
                specs[name] = spec.model_copy(update={"dataset": spec.dataset.model_copy(
                    update={"corpus_hash": local})})
    return specs, other_corpus


SPECS, OTHER_CORPUS = _specs()


def golden_request(framework: str, name: str, precision: str, loss_scale: str | None = None):
    """The fingerprint run a golden is compared with (a harness.run.worker.RunRequest): the golden's spec and step
    count at the kit's threads. tox fingerprints exactly these runs in fp64 just before the kit, so the kit's
    `fingerprinted(request)` finds them in --amp-fingerprints instead of training them again."""
    from harness.conformance.plugin import THREADS
    from harness.run.worker import RunRequest

    steps = len(next(g for g in load() if g["model"] == name)["loss"])
    return RunRequest(framework=framework, model=name, spec=SPECS[name].with_overrides(steps=steps).model_dump(
        mode="json"), precision=precision, run_id=f"conformance-{name}", warmup=0, mode="fingerprint",
        threads=THREADS, device="cpu", loss_scale=loss_scale)


def residual_stream(name: str, description: str, blocks: int, head: list[dict], seed: int, steps: int) -> dict:
    """A token classifier whose residual stream nothing normalises: an embedding, then `blocks` residual blocks of
    one square dense layer each (each roughly doubles the stream's variance), then `head`. The kit's numerics
    checks grow values past float16's range with it (test_attention_numerics, test_nonfinite)."""
    return {
        "name": name,
        "description": description,
        "input": {"shape": [12], "vocab": 16},
        "dataset": {"name": "synthetic_tokens", "task": "classification", "num_classes": 3, "size": 64},
        "layers": [{"type": "embedding", "dim": 32},
                   *[{"type": "residual", "layers": [{"type": "dense", "units": 32}]}] * blocks,
                   *head],
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "adam", "learning_rate": 1e-5, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
        "batch_size": 16,
        "steps": steps,
        "seed": seed,
    }


def hint(spec: ModelSpec, message: str) -> str:
    """A failure message that names the spec and quotes what it isolates."""
    about = " ".join((spec.description or "").split())
    return f"{spec.name}: {message}" + (f". {spec.name} checks: {about}" if about else "")


def spec_file(folder: Path, name: str) -> str:
    """The kit's spec `name` written to a YAML file in `folder` (for the CLI, which takes spec paths)."""
    path = Path(folder) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(SPECS[name].model_dump(mode="json")))
    return str(path)
