"""What identifies a run, and what a comparison holds fixed: defined once here, for `--resume` (which requests
already have a result), harness.results.usable (which failed records a later attempt replaced), the report
(which runs are pooled into one cell) and `parity` (which fingerprints are compared).

A run is a framework running one spec (its hash) at one precision, in one variant, under one loss-scale
setting, as one repeat (`RunKey`). A cell of the report is every repeat of one (model, framework, Setting,
precision, loss-scale setting): `Setting` is what a precision shares with the fp32 run it is compared against
(device, node, threads, variant, framework version, batch size, and a scaling study's width and sequence
length). Records that differ in any of these are never
pooled; they become rows of their own, labelled by what differs. `parity` compares the fingerprints of one
(model, spec hash, precision) across frameworks.

A run whose variant `--variant auto` chose (the fastest here for its model and precision) is identified as
"auto", as it was asked for: fp32 at its fastest is compared against amp_bf16 at its fastest, whichever each ran.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from harness.precision import parse_loss_scale, parse_precision

AUTO = "auto"  # the variant of a run whose variant was chosen for it (harness.run.variants)
SCALING_STUDY = "scaling-"  # how a scaling study's id starts (`study scaling`; harness.report.scaling shows it)


def scaling_study(r: dict) -> bool:
    """Whether a record is a run of a scaling study (its sizes vary; the loss-scale study's vary its scale)."""
    return str(r.get("study") or "").startswith(SCALING_STUDY)


class RunKey(NamedTuple):
    """One run across attempts: a rerun by --resume has the key of the run it replaces."""
    framework: str | None
    spec_hash: str | None
    precision: str | None
    variant: str | None
    loss_scale: str  # loss_scale_label
    repeat: int | None


def loss_scale_label(settings: dict | None) -> str:
    """The one string form of a loss-scale setting (harness.precision.LossScale as a dict): "none", "fixed 16",
    "dynamic from 65536, growth every 2000". What tells runs of a loss-scale study apart, and how the report
    names them."""
    s = settings or {}
    if s.get("mode") in (None, "none"):
        return "none"
    if s["mode"] == "fixed":
        return f"fixed {s['initial']:g}"
    return f"dynamic from {s['initial']:g}, growth every {s.get('growth_interval')}"


def loss_scale_setting(r: dict) -> str:
    """A record's loss-scale setting (loss_scale_label)."""
    return loss_scale_label((r.get("loss_scale") or {}).get("settings"))


def variant(r: dict) -> str | None:
    """The variant a record's run was asked for: "auto" where it was chosen for it."""
    return AUTO if r.get("variant_choice") else r.get("variant")


def run_key(r: dict) -> RunKey:
    """What identifies a record's run across attempts."""
    return RunKey(r.get("framework"), r.get("spec_hash"), r.get("precision"), variant(r), loss_scale_setting(r),
                  r.get("repeat"))


def request_key(q) -> RunKey:
    """The key of the run a request (harness.run.worker.RunRequest) asks for: run_key of its record."""
    settings = parse_loss_scale(q.loss_scale, parse_precision(q.precision), q.growth_interval).to_dict()
    return RunKey(q.framework, q.resolved_spec().spec_hash(), q.precision, q.variant, loss_scale_label(settings),
                  q.repeat)


def fingerprint_group(r: dict) -> tuple:
    """(model, spec hash, precision): the fingerprints `parity` holds against each other, one per framework (and
    variant)."""
    return r.get("model"), r.get("spec_hash"), r.get("precision")


class Setting(NamedTuple):
    """What a precision shares with the fp32 run it is compared against. The loss-scale setting is the one part
    of a cell's key outside it (`cell_key`): fp32 runs unscaled, and amp_fp16 with a scaler, yet they compare."""
    device: str | None
    node: str | None
    threads: int | None
    variant: str | None
    version: str | None
    batch: int | None
    width: float | None = None  # a scaling study's width factor (None: the spec's own widths)
    seq_len: int | None = None  # a scaling study's sequence length (tokens_per_sample; elsewhere the spec's own)


def device_key(r: dict) -> str | None:
    """The device a run measured, named as precisely as the record allows ("cpu (Intel Xeon ...)"): runs on
    different devices are never pooled, and the first screen shows one matrix per device."""
    name = r.get("device")
    description = ((r.get("env") or {}).get("device") or {}).get("description")
    return f"{name} ({description})" if name and description and description != name else name


def node(r: dict) -> str | None:
    """The machine a run ran on: the worker's host name, else (a run whose worker never reported) the host name
    the executor's node starts with (a Ray node's adds its address and Ray's id, which change when the cluster
    restarts)."""
    env = r.get("env") or {}
    return env.get("hostname") or (env.get("node") or "").split(" ")[0] or None


def setting(r: dict) -> Setting:
    study = scaling_study(r)  # only a scaling study varies a spec's sizes: elsewhere they are the spec hash's part
    return Setting(device_key(r), node(r), (r.get("env") or {}).get("threads"), variant(r),
                   r.get("framework_version"), r.get("batch_size"), r.get("width") if study else None,
                   r.get("tokens_per_sample") if study else None)


def cell_key(r: dict) -> tuple:
    """(model, framework, Setting, precision, loss-scale setting): the runs of one cell."""
    return r.get("model"), r.get("framework"), setting(r), r.get("precision"), loss_scale_setting(r)


def compatible(partial: Setting, full: Setting) -> bool:
    """A record whose worker never reported (a crash, a lost node) knows only part of its setting: it belongs
    to every setting that agrees with what it knows."""
    return all(a is None or a == b for a, b in zip(partial, full))


def arms_by_setting(records: list[dict], keep: Callable[[dict], bool]) -> dict[tuple, dict[str, list[dict]]]:
    """The run records `keep` accepts, per (model, framework, Setting), by arm: the precision, with its loss-scale
    setting after it ("fp16 (loss scale fixed 16)") where one precision ran under several. A record whose worker
    never reported its setting (a crash) joins every setting it agrees with (compatible)."""
    groups: dict[tuple, dict[tuple, list]] = {}
    partial = []
    for r in records:
        if r.get("mode", "run") != "run" or not r.get("model") or not keep(r):
            continue
        if r.get("status") != "ok" and r.get("device") is None:
            partial.append(r)
            continue
        groups.setdefault((r["model"], r.get("framework"), setting(r)), {}).setdefault(
            (r["precision"], loss_scale_setting(r)), []).append(r)
    for r in partial:
        for (model, framework, setting_), arms in groups.items():
            if (model, framework) == (r["model"], r.get("framework")) and compatible(setting(r), setting_):
                arms.setdefault((r["precision"], loss_scale_setting(r)), []).append(r)
    named = {}
    for key, arms in sorted(groups.items(), key=lambda item: tuple(map(str, item[0]))):
        scales: dict[str, set] = {}
        for precision, scale in arms:
            scales.setdefault(precision, set()).add(scale)
        named[key] = {(p if len(scales[p]) == 1 else f"{p} (loss scale {scale})"): rs
                      for (p, scale), rs in arms.items()}
    return named


def varying(settings: Iterable[Setting]) -> list[str]:
    """The fields that differ among these settings, in Setting's order."""
    settings = set(settings)
    return [f for i, f in enumerate(Setting._fields) if len({s[i] for s in settings}) > 1]


def describe(s: Setting, fields: Iterable[str]) -> str:
    """" [node b, batch 16]" for the named fields, "" for none."""
    shown = [f"{f} {getattr(s, f)}" for f in fields]
    return f" [{', '.join(shown)}]" if shown else ""
