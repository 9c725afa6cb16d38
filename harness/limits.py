"""The largest values amp-harness accepts from its options and files: each bound keeps one command from taking the
machine (threads, memory, disk, time), and each is checked before any worker starts."""
from __future__ import annotations

import os

#: timed steps, and warm-up steps, of one run. A record holds every step's time, loss and loss scale (about 50
#: bytes a step): 500,000 timed plus 500,000 warm-up steps make a record of about 40 MB, under
#: harness.results.MAX_RECORD_BYTES, which a longer one would exceed and so never be read back.
MAX_STEPS = 500_000
#: runs of each cell, each a fresh process
MAX_REPEATS = 1000
#: runs one command may start (cells x precisions x variants x loss scales x repeats)
MAX_RUNS = 100_000
#: models in one command (--model, a matrix file)
MAX_MODELS = 1000
#: --timeout per run and --budget for --repeats auto: a week (past it, a wait overflows what a lock can wait for
#: long before the figure means anything)
MAX_SECONDS = 7 * 24 * 3600.0
#: clean steps before a dynamic loss scale grows: the frameworks keep the count in a 32-bit integer
MAX_GROWTH_INTERVAL = 2**31 - 1


#: --threads with --executor ray, where the nodes' CPUs are not this machine's: more than any node has
MAX_THREADS = 4096


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or `taskset` narrows), else the
    machine's: the most --threads a run here may take. More only contend, and 100,000 of them exhaust what the
    machine has for threads, failing other processes too."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on macOS
        return os.cpu_count() or 1


def default_threads() -> int:
    """A run's intra-op threads where --threads gives none: $AMP_HARNESS_THREADS, else every CPU this process may
    use. tox's test envs set 1: there two processes run at a time (`--jobs 2`, pytest -n 2), and two processes
    of two threads each on two cores wait on each other's spinning threads (a fingerprint ran 20-50x slower)."""
    given = os.environ.get("AMP_HARNESS_THREADS", "")
    return min(int(given), usable_cpus()) if given.isdigit() and int(given) > 0 else usable_cpus()


def slot_cpus(slot: int, threads: int) -> set[int]:
    """The CPUs of job `slot` when several processes of `threads` threads each share this process's CPUs: its own
    `threads` of them (wrapping round where the jobs ask for more than there are). Pinned there, two jobs never
    run on one core while another idles, whatever each framework does with its threads (JAX's XLA sizes its pool
    by the CPUs a process may use)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()
    return {cpus[(slot * threads + i) % len(cpus)] for i in range(min(threads, len(cpus)))}
