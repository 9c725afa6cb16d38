"""What a run measured under, besides its model, framework and precision: the one key every section of the
report groups by (the cells, their fp32 baselines, the pure 16-bit section, the profiles and the loss-scale
study). Records that differ in any field are never pooled; they become rows of their own, labelled by what
differs.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple


class Setting(NamedTuple):
    """What a precision shares with the fp32 run it is compared against. The loss-scale setting is the one part
    of a run's key outside it (`cell_key`): fp32 runs unscaled, and amp_fp16 with a scaler, yet they compare."""
    device: str | None
    node: str | None
    threads: int | None
    variant: str | None
    version: str | None
    batch: int | None


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
    # a run whose variant was chosen for it (`--variant auto`: the fastest here for its model and precision) is
    # compared as "auto": fp32 at its fastest against amp_bf16 at its fastest, whichever each ran
    variant = "auto" if r.get("variant_choice") else r.get("variant")
    return Setting(device_key(r), node(r), (r.get("env") or {}).get("threads"), variant,
                   r.get("framework_version"), r.get("batch_size"))


def loss_scale_setting(r: dict) -> str:
    s = (r.get("loss_scale") or {}).get("settings") or {}
    if s.get("mode") in (None, "none"):
        return "none"
    if s["mode"] == "fixed":
        return f"fixed {s.get('initial'):g}"
    return f"dynamic from {s.get('initial'):g}, growth every {s.get('growth_interval')}"


def cell_key(r: dict) -> tuple:
    """(model, framework, Setting, precision, loss-scale setting): the runs of one cell."""
    return r.get("model"), r.get("framework"), setting(r), r.get("precision"), loss_scale_setting(r)


def compatible(partial: Setting, full: Setting) -> bool:
    """A record whose worker never reported (a crash, a lost node) knows only part of its setting: it belongs
    to every setting that agrees with what it knows."""
    return all(a is None or a == b for a, b in zip(partial, full))


def varying(settings: Iterable[Setting]) -> list[str]:
    """The fields that differ among these settings, in Setting's order."""
    settings = set(settings)
    return [f for i, f in enumerate(Setting._fields) if len({s[i] for s in settings}) > 1]


def describe(s: Setting, fields: Iterable[str]) -> str:
    """" [node b, batch 16]" for the named fields, "" for none."""
    shown = [f"{f} {getattr(s, f)}" for f in fields]
    return f" [{', '.join(shown)}]" if shown else ""
