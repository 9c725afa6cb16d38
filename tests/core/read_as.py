"""Records as the report reads them (harness.results.typed): the models of harness.records, for tests that hand a
section records directly rather than through build_view."""
from __future__ import annotations

import itertools

from harness.records import Record, RunRecord

_ids = itertools.count()


def read_as(records: list[dict], kind: type[Record] = RunRecord) -> list[Record]:
    """Each record validated as `kind`, with what identifies a run filled in where the test leaves it out (an ok
    run's model and batch size too: what an ok record holds)."""
    return [kind.model_validate({"run_id": f"test-{next(_ids)}", "framework": "torch", "precision": "fp32",
                                 "status": "ok", "model": "m", "batch_size": 1, **r}) for r in records]
