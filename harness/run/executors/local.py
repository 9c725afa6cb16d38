"""The default executor: every batch in a subprocess of this machine, one after another."""
from __future__ import annotations

import platform


class LocalExecutor:
    """Today's behaviour: each batch of requests in a subprocess of this machine (harness.run.process.run_group)."""

    name = "local"
    in_flight = "the current run"

    def run_batches(self, batches, timeout_s, on_progress, on_record, stop, on_batch) -> None:
        """harness.run.executors.Executor.run_batches: one batch after another, here."""
        from harness.run.process import run_group

        node = platform.node()

        def placed(record: dict) -> None:  # the same fields a cluster's records carry, so reports compare them
            record["env"] = {**(record.get("env") or {}), "executor": self.name, "node": node,
                             "placement": "alone on this machine (one run at a time)"}
            on_record(record)

        for batch in batches:
            if stop:
                break
            on_batch(batch)
            run_group(batch, timeout_s, on_progress, placed)
