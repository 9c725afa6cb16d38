"""Is the harness's MXNet training step as fast as a plain hand-written hybridized Gluon loop? Run in the
mxnet env:

    tox exec -e mxnet -- python benchmarks/mxnet_vs_plain_gluon.py --model mnist_mlp

The plain loop is what a Gluon user writes: gluon.nn layers, gluon.loss, gluon.Trainer with MXNet's own
optimizer, hybridized, `trainer.step(batch_size)`, and one `waitall()` at the end (no per-step sync), timed as
a whole and divided by the steps, and also with a `waitall()` after each step. The harness step is timed per step with a `waitall()` each, as
`amp-harness run` does. Supports specs built from dense, conv2d (valid), pools, flatten, relu and sigmoid.
"""
from __future__ import annotations

import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

from harness.adapter import load_adapter
from harness.model.data import Data
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.model.weights import initial_weights
from harness.precision import LossScale, parse_precision


def plain_net(spec) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    for layer in spec.layers:
        t = layer.type
        if t == "dense":
            net.add(gluon.nn.Dense(layer.units, use_bias=layer.use_bias))
        elif t == "conv2d":
            net.add(gluon.nn.Conv2D(layer.filters, layer.kernel_size, strides=layer.strides))
        elif t == "maxpool2d":
            net.add(gluon.nn.MaxPool2D(layer.pool_size, layer.strides))
        elif t == "avgpool2d":
            net.add(gluon.nn.AvgPool2D(layer.pool_size, layer.strides))
        elif t == "flatten":
            net.add(gluon.nn.Flatten())
        elif t in ("relu", "sigmoid"):
            net.add(gluon.nn.Activation(t))
        else:
            raise SystemExit(f"the plain Gluon loop here has no {t!r} layer")
    return net


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mnist_mlp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--input-size", type=lambda s: tuple(map(int, s.split("x"))))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    spec = load_spec(args.model).with_overrides(args.batch_size, args.steps, args.input_size)
    graph, data = infer(spec), Data(spec)
    adapter = load_adapter("mxnet")
    trainer = adapter.build(spec, graph, initial_weights(graph, spec.seed), parse_precision("fp32"), LossScale(),
                            adapter.device("cpu"))
    batches = [data.train_batch(s) for s in range(args.warmup + args.steps)]
    harness_batches = [trainer.to_device(*b, {}) for b in batches]  # no dropout: the plain loop has none
    plain_batches = [(mx.nd.array(x.transpose(0, 3, 1, 2)), mx.nd.array(y)) for x, y in batches]

    net = plain_net(spec)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    opt = spec.optimizer
    if opt.type == "adam":
        plain_trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": opt.learning_rate,
                                      "beta1": opt.beta_1, "beta2": opt.beta_2, "epsilon": opt.epsilon})
    elif opt.type == "rmsprop":
        plain_trainer = gluon.Trainer(net.collect_params(), "rmsprop", {"learning_rate": opt.learning_rate,
                                      "gamma1": opt.rho, "epsilon": opt.epsilon})
    else:
        plain_trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": opt.learning_rate,
                                      "momentum": opt.momentum})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss() if spec.loss.type.startswith("sparse") \
        else gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=True)

    def plain_step(x, y):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        plain_trainer.step(spec.batch_size)

    step_ms, plain_ms, synced_ms = [], [], []
    for _ in range(args.rounds):
        times = []
        for i, batch in enumerate(harness_batches):
            t0 = time.perf_counter()
            trainer.train_step(batch)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        step_ms.append(statistics.median(times))
        for x, y in plain_batches[:args.warmup]:
            plain_step(x, y)
        mx.nd.waitall()
        t0 = time.perf_counter()
        for x, y in plain_batches[args.warmup:]:
            plain_step(x, y)
        mx.nd.waitall()
        plain_ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
        times = []
        for x, y in plain_batches[args.warmup:]:
            t0 = time.perf_counter()
            plain_step(x, y)
            mx.nd.waitall()
            times.append((time.perf_counter() - t0) * 1e3)
        synced_ms.append(statistics.median(times))
    print(f"{spec.name} fp32 batch {spec.batch_size}, {args.steps} steps x {args.rounds} rounds")
    print(f"  harness step (median per step, per round):  {', '.join(f'{v:.2f}' for v in step_ms)} ms")
    print(f"  plain Gluon loop (mean per step, per round): {', '.join(f'{v:.2f}' for v in plain_ms)} ms")
    print(f"  plain Gluon loop, waitall each step (median): {', '.join(f'{v:.2f}' for v in synced_ms)} ms")
    for name, values in (("plain", plain_ms), ("plain synced", synced_ms)):
        print(f"  ratio harness / {name} (medians over rounds): "
              f"{statistics.median(step_ms) / statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
