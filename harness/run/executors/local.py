"""The default executor: every batch in a subprocess of this machine, one after another, or, for runs whose timing
does not matter (fingerprints, diagnoses), `jobs` at a time."""
from __future__ import annotations

import platform
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from harness.limits import slot_cpus


class LocalExecutor:
    """Each batch of requests in a subprocess of this machine (harness.run.process.run_group): one at a time, or
    `jobs` at a time, each job on CPUs of its own (untimed runs only: harness.run.executors.make_executor
    refuses more for timed ones)."""

    name = "local"

    def __init__(self, jobs: int = 1):
        self.jobs = jobs
        self.in_flight = "the current run" if jobs == 1 else "the runs in flight"

    def run_batches(self, batches, timeout_s, on_progress, on_record, stop, on_batch) -> None:
        """harness.run.executors.Executor.run_batches: here, `jobs` batches at a time."""
        from harness.run.process import run_group

        node, lock, failed, slots = platform.node(), threading.Lock(), [], queue.SimpleQueue()
        for slot in range(self.jobs):
            slots.put(slot)
        placement = "alone on this machine (one run at a time)" if self.jobs == 1 else \
            f"{self.jobs} untimed runs at a time on this machine"

        def placed(record: dict) -> None:  # the same fields a cluster's records carry, so reports compare them
            record["env"] = {**(record.get("env") or {}), "executor": self.name, "node": node, "placement": placement}
            with lock:  # one record at a time reaches the runner (its file, its list, its progress bar)
                on_record(record)

        def one(batch) -> None:
            if stop or failed:  # Ctrl-C, or a record that could not be kept: start no other batch
                return
            with lock:
                on_batch(batch)
            slot = slots.get()
            try:
                if self.jobs == 1:
                    run_group(batch, timeout_s, on_progress, placed)
                else:
                    run_group(batch, timeout_s, None, placed, cpus=slot_cpus(slot, batch[0].threads))
            except BaseException:
                failed.append(True)
                raise
            finally:
                slots.put(slot)

        if self.jobs == 1:
            for batch in batches:
                one(batch)
            return
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="amp-harness-batch") as pool:
            batches = shared(batches, self.jobs)
            for future in [pool.submit(one, batch) for batch in batches]:
                future.result()  # the first failure reaches the caller, once the batches in flight have ended


def shared(batches: list[list], jobs: int) -> list[list]:
    """The batches in the order `jobs` processes at a time finish soonest: the largest first, so that the small
    ones fill in at the end (by their number of runs: their times are not known before), and the largest halved
    (its process split in two) until there are `jobs` of them or none has two runs: a diagnose of one precision
    is one batch, and one process would leave the other jobs idle."""
    batches = sorted(batches, key=len, reverse=True)
    while len(batches) < jobs:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]), default=None)
        if largest is None or len(batches[largest]) < 2:
            break
        batch = batches.pop(largest)
        batches[largest:largest] = [batch[:len(batch) // 2], batch[len(batch) // 2:]]
    return batches
