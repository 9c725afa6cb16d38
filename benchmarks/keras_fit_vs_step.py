"""Is the harness's Keras training step as fast as a plain `model.fit`? Run in the tensorflow env:

    tox exec -e tensorflow -- python benchmarks/keras_fit_vs_step.py --model mnist_mlp --precision fp32

Both train the same network (the adapter's Keras model, the same optimizer and loss) on the same batches.
The harness step is timed one step at a time with a blocking fetch of the loss (as `amp-harness run` does);
`model.fit` runs its own loop without a per-step sync, so it is timed as a whole and divided by the steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from harness.adapter import load_adapter
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.precision import LossScale, parse_precision


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mnist_mlp")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--input-size", type=lambda s: tuple(map(int, s.split("x"))))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each")
    args = parser.parse_args()

    adapter = load_adapter("tensorflow")
    adapter.set_threads(2)
    spec = load_spec(args.model).with_overrides(args.batch_size, args.steps, args.input_size)
    graph, data = infer(spec), Data(spec)
    precision = parse_precision(args.precision)
    trainer = adapter.build(spec, graph, initial_weights(graph, spec.seed), precision, LossScale(),
                            adapter.device("cpu"))
    batches = [data.train_batch(s) for s in range(args.warmup + args.steps)]

    import keras
    from amp_harness_tensorflow.optimizers import loss_fn, make_optimizer

    model = keras.models.clone_model(trainer.net.model)  # same architecture, same policy
    model.set_weights(trainer.net.model.get_weights())
    model.compile(optimizer=make_optimizer(spec.optimizer), loss=lambda y, out: loss_fn(spec.loss, out, y))
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    warm = args.warmup * spec.batch_size

    step_ms, fit_ms = [], []
    for _ in range(args.rounds):
        times = []
        for step, batch in enumerate(batches):
            device_batch = trainer.to_device(*batch, {})  # no dropout masks: the plain loop has no dropout
            t0 = time.perf_counter()
            trainer.train_step(device_batch)
            if step >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        step_ms.append(statistics.median(times))
        model.fit(x[:warm], y[:warm], batch_size=spec.batch_size, epochs=1, shuffle=False, verbose=0)
        t0 = time.perf_counter()
        model.fit(x[warm:], y[warm:], batch_size=spec.batch_size, epochs=1, shuffle=False, verbose=0)
        fit_ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
    print(f"{spec.name} {args.precision} batch {spec.batch_size}, {args.steps} steps x {args.rounds} rounds")
    print(f"  harness tf.function step (median per step, per round): {', '.join(f'{v:.2f}' for v in step_ms)} ms")
    print(f"  keras model.fit (mean per step, per round):            {', '.join(f'{v:.2f}' for v in fit_ms)} ms")
    print(f"  ratio harness / fit (medians over rounds): {statistics.median(step_ms) / statistics.median(fit_ms):.3f}")


if __name__ == "__main__":
    main()
