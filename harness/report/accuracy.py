"""When an accuracy figure means something: a run too short to learn anything scores at chance level, and a
change of accuracy against such a baseline is noise, not a precision effect."""
from __future__ import annotations

CHANCE_MARGIN = 0.05  # fp32 eval accuracy within 5 points of chance: the run was too short to judge accuracy
ACCURACY_MARGIN = 0.02  # an eval-accuracy change beyond 2 points against fp32 is flagged
TOO_SHORT = "too short to judge"


def num_classes(records: list[dict]) -> int | None:
    """The class count of one model's records (records before schema 3 do not state it: not judged)."""
    return next((r["num_classes"] for r in records if isinstance(r.get("num_classes"), int)), None)


def chance(classes: int | None) -> float | None:
    return 1.0 / classes if classes else None


def too_short(fp32_accuracy: float | None, classes: int | None) -> bool:
    """The fp32 run scored at chance level (within CHANCE_MARGIN): its accuracy, and any change against it,
    says nothing about precision."""
    level = chance(classes)
    return fp32_accuracy is not None and level is not None and fp32_accuracy <= level + CHANCE_MARGIN


def change_phrase(delta: float | None, judged: bool) -> str:
    """An accuracy change against fp32, in words a reader cannot misread."""
    if not judged:
        return f"accuracy {TOO_SHORT} (fp32 at chance level)"
    if delta is None:
        return "no accuracy to compare"
    if abs(delta) <= ACCURACY_MARGIN:
        return f"accuracy unchanged ({100 * delta:+.1f} pt, within {100 * ACCURACY_MARGIN:g} pt)"
    return f"accuracy {100 * delta:+.1f} pt vs fp32"
