"""Trainer.profile for JAX: the jitted step's runs under jax.profiler, read back from the XSpace it writes.

On XLA:CPU the profiler records an event per executed HLO instruction (a thunk) on the host plane, with the
instruction's name, its module's name and the executable's program id. The XSpace also holds each loaded
executable's optimised HLO module (the profiler's "Hlo Proto"), so events are joined to the instructions of the
very program that ran, not of a recompilation, which harness.run.xla_profile attributes to scopes; the instants
in which none ran go to the runtime's events or annotations (_timeline).
"""
from __future__ import annotations

import bisect
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from harness.adapter import LOSS_SCALE_SCOPE, RUNTIME_SCOPE, OpTime, ProfiledOps, layer_scope
from harness.errors import HarnessError
from harness.run import xla_profile
from harness.run.xla_profile import SCOPE_TOKEN

BACKWARD_MARK = "transpose("  # in the op_name of the backward ops JAX derives from a forward op
ASYNC = {"convolution"}  # XLA:CPU's convolution thunk runs Eigen's convolution on the intra-op pool, asynchronously
NOTE = ("the timed runs' jitted step, compiled again before the profiled steps (the same program), train_step "
        "wrapped in a profiler annotation; XLA fuses ops across layers: a fusion goes to the layer most of its ops "
        "come from, an instruction XLA made itself to the layer using its result (a weight's gradient to the "
        "weight's layer), and overlapping instructions share the time")


def profile_steps(trainer, run_steps) -> ProfiledOps:
    """Run the core's steps under jax.profiler and return every HLO instruction that ran, with its scopes."""
    weights = {f"{info.path}.{name}": layer_scope(info.path) for info in trainer.net.infos.values()
               for name in info.params}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no event per Python call (overhead): XLA's events are C++ ones
    options.enable_hlo_proto = True  # the executables' HLO modules, which the events are joined to
    # the step compiled again now, ahead of the profiled steps and outside JAX's persistent compilation cache,
    # whose executables give the profiler no HLO module to join its events to (docs/profile.md)
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        fresh = jax.jit(lambda *args: trainer._step_fn(*args), donate_argnums=(0, 1, 2))  # a new trace, a new program
        fresh = fresh.lower(trainer.params, trainer.opt_state, trainer.statistics, *trainer._last_batch,
                            trainer._device_scale, trainer._rate(), None).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
    step, trainer._step = trainer._step, fresh
    # while profiling only: the step's Python around the jitted call (launching it, handing back its outputs) in
    # RUNTIME_SCOPE, the scale's update on the host in LOSS_SCALE_SCOPE
    patched = [(trainer, "train_step", RUNTIME_SCOPE)] + \
        ([(trainer.scaler, "update", LOSS_SCALE_SCOPE)] if trainer.scaler is not None else [])
    for owner, name, scope in patched:
        setattr(owner, name, jax.profiler.annotate_function(getattr(owner, name), scope))
    try:
        with tempfile.TemporaryDirectory(prefix="amp-harness-jax-profile-") as log_dir:
            with jax.profiler.trace(log_dir, profiler_options=options):
                run_steps()
            found = list(Path(log_dir).glob("plugins/profile/*/*.xplane.pb"))
            if len(found) != 1:
                raise HarnessError(f"jax.profiler wrote {len(found)} XSpace files (*.xplane.pb), expected one")
            xspace = found[0].read_bytes()
    finally:
        trainer._step = step
        for owner, name, _ in patched:
            delattr(owner, name)  # the class's method again
    modules = xla_profile.modules(xspace, BACKWARD_MARK)
    plane = jax.profiler.ProfileData.from_serialized_xspace(xspace).find_plane_with_name("/host:CPU")
    instructions, runtime = _events(plane)
    instructions = _intervals(instructions, modules)
    if not instructions:
        raise HarnessError("jax.profiler recorded no HLO instruction (thunk) events on the host plane")
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for (_, _, key), seconds in zip(instructions + runtime, _timeline(instructions, runtime)):
        totals[key][0] += seconds
        totals[key][1] += 1
    ops = []
    for key, (seconds, calls) in totals.items():
        name, hlo = key[-1], modules.get(key[:2])
        if len(key) == 1:  # a runtime event (or a scope the adapter annotated): the instants no instruction ran in
            if seconds > 0:
                ops.append(OpTime(name, name if SCOPE_TOKEN.fullmatch(name) else RUNTIME_SCOPE, seconds, calls=calls))
        elif hlo is None or name not in hlo.by_name:  # not expected: its time is then "other", under its own name
            ops.append(OpTime(name, "", seconds, calls=calls))
        else:
            ops.append(hlo.op_time(name, seconds, calls, weights))
    return ProfiledOps(f"jax.profiler (jax {jax.__version__}; XLA:CPU instruction events joined to the executable's "
                       f"HLO)", ops, NOTE)


def _events(plane) -> tuple[list, list]:
    """The host plane's events: HLO instructions as (start ns, end ns, ns of the "end: <instruction>" event their
    flow leads to (their "_p" stat, its "_c") or None, (module, program id, instruction)); the runtime's own (jit
    dispatch, the thunk executor, handing back outputs...) as (start ns, end ns, (name,))."""
    started, finished, runtime = [], {}, []
    for line in plane.lines if plane is not None else ():
        for event in line.events:
            stats = dict(event.stats)
            if "hlo_op" in stats:
                started.append((int(event.start_ns), int(event.end_ns), stats.get("_p"),
                                (stats.get("hlo_module", ""), int(stats.get("program_id", -1)), stats["hlo_op"])))
                continue
            if event.name.startswith("end: ") and "_c" in stats:
                finished[stats["_c"]] = int(event.start_ns)
            if event.end_ns > event.start_ns:
                runtime.append((int(event.start_ns), int(event.end_ns), (event.name,)))
    return [(start, end, finished.get(flow), key) for start, end, flow, key in started], runtime


def _intervals(instructions: list, modules: dict) -> list[tuple[int, int, tuple]]:
    """(start ns, end ns, key) of each instruction: its event's span, except for the instructions XLA:CPU runs
    asynchronously (ASYNC: the event only launches them on the thread pool, whose threads record nothing), which
    end at the first start of an instruction using their result or at their end event, whichever comes first (the
    end event comes once the completion callback has also run the successors it runs inline)."""
    starts = defaultdict(list)  # each instruction's starts, in order
    for start, _, _, key in sorted(instructions, key=lambda event: event[0]):
        starts[key].append(start)
    intervals = []
    for start, end, finished, key in instructions:
        hlo = modules.get(key[:2])
        i = hlo.by_name.get(key[2]) if hlo is not None else None
        if i is not None and hlo.by_id[i].opcode in ASYNC:
            uses = (starts.get((*key[:2], hlo.by_id[j].name), []) for j in hlo.users.get(i, []))
            later = [times[k] for times in uses for k in [bisect.bisect_right(times, start)] if k < len(times)]
            end = max(end, min(later + ([finished] if finished else []), default=end))
        intervals.append((start, end, key))
    return intervals


def _timeline(instructions: list, runtime: list) -> list[float]:
    """Seconds of each event (instructions, then runtime events): an instant in which k instructions ran counts
    1/k to each of them; an instant in which none ran counts to the innermost (latest started) runtime event open
    then, if any."""
    intervals = [(start, end) for start, end, _ in instructions + runtime]
    edges = sorted({t for interval in intervals for t in interval})
    starts, ends = defaultdict(list), defaultdict(list)
    for index, (start, end) in enumerate(intervals):
        starts[start].append(index)
        ends[end].append(index)
    seconds, running, open_ = [0.0] * len(intervals), set(), set()
    for t, following in zip(edges, edges[1:]):
        for index in ends[t]:
            (running if index < len(instructions) else open_).discard(index)
        for index in starts[t]:
            if intervals[index][1] > t:
                (running if index < len(instructions) else open_).add(index)
        if running:
            for index in running:
                seconds[index] += (following - t) / 1e9 / len(running)
        elif open_:
            seconds[max(open_, key=lambda index: (intervals[index][0], index))] += (following - t) / 1e9
    return seconds
