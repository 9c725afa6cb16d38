"""@HEADER@"""
# The JAX template of `amp-harness export` (harness/export.py fills in the docstring above and CONFIG below):
# pure functions of a dict of weights in jax.numpy and lax, no Flax or optax. JAX's layouts are the canonical ones
# (NHWC images, HWIO conv kernels, [in, out] dense kernels, H, W, C flatten order), so the weights load as they
# are. What keeps the spec's math:
# - 'same' padding is TensorFlow's, given to lax as explicit (low, high) pairs; 'same' average pooling divides
#   each window's sum by the real pixels it covers;
# - the optimizers are written out (the spec's epsilon placements, PyTorch's momentum convention);
# - mixed precision as Flax modules do it: dense and conv cast their input and float32 weights to the compute
#   dtype; normalisation computes in float32; the loss is float32; float16 has a dynamic loss scaler written out.
import argparse
import json
import math
import zlib
from pathlib import Path

import numpy as np

CONFIG = {}  # @CONFIG@

if CONFIG["dtype"] == "float64":  # before any array is made
    import jax

    jax.config.update("jax_enable_x64", True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

PROB_EPSILON = 1e-7  # probabilities are clipped to [eps, 1 - eps] in losses on probabilities
DTYPE = jnp.dtype(CONFIG["dtype"])
COMPUTE = jnp.dtype(CONFIG["compute_dtype"] or CONFIG["dtype"])


def layer_fn(cfg):
    """The function (params, state, x, rng, training) -> (x, state) of one spec layer; state holds batchnorm's
    moving statistics."""
    t, path = cfg["type"], cfg["path"]
    if t == "dense":
        def dense(params, state, x, rng, training):
            y = x.astype(COMPUTE) @ params[f"{path}.kernel"].astype(COMPUTE)
            return (y + params[f"{path}.bias"].astype(COMPUTE) if cfg["use_bias"] else y), state
        return dense
    if t == "conv2d":
        top, bottom, left, right = cfg["pads"]

        def conv(params, state, x, rng, training):
            y = lax.conv_general_dilated(x.astype(COMPUTE), params[f"{path}.kernel"].astype(COMPUTE),
                                         (cfg["strides"],) * 2, [(top, bottom), (left, right)],
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return (y + params[f"{path}.bias"].astype(COMPUTE) if cfg["use_bias"] else y), state
        return conv
    if t in ("maxpool2d", "avgpool2d"):
        k, s = cfg["pool_size"], cfg["strides"]
        top, bottom, left, right = cfg["pads"]
        window, strides, pads = (1, k, k, 1), (1, s, s, 1), [(0, 0), (top, bottom), (left, right), (0, 0)]
        if t == "maxpool2d":
            return lambda params, state, x, rng, training: (
                lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads), state)
        h, w = cfg["in_shape"][:2]
        count = lax.reduce_window(jnp.ones((1, h, w, 1), DTYPE), 0.0, lax.add, window, strides, pads)
        return lambda params, state, x, rng, training: (
            lax.reduce_window(x, 0.0, lax.add, window, strides, pads) / count.astype(x.dtype), state)
    if t == "global_avgpool2d":
        return lambda params, state, x, rng, training: (x.mean(axis=(1, 2)), state)
    if t == "flatten":
        return lambda params, state, x, rng, training: (x.reshape(x.shape[0], -1), state)  # H, W, C order
    if t in ("relu", "tanh", "sigmoid", "softmax", "gelu"):
        fn = {"relu": jax.nn.relu, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
              "softmax": lambda x: jax.nn.softmax(x, axis=-1),
              "gelu": lambda x: jax.nn.gelu(x, approximate=cfg.get("approximate", False))}[t]
        return lambda params, state, x, rng, training: (fn(x), state)
    if t == "batchnorm":
        def batchnorm(params, state, x, rng, training):
            gamma, beta = params[f"{path}.gamma"], params[f"{path}.beta"]
            x = x.astype(gamma.dtype)
            axes = tuple(range(x.ndim - 1))
            if training:
                mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased variance
                m = cfg["momentum"]
                state = dict(state)
                for name, batch in (("moving_mean", mean), ("moving_variance", var)):
                    state[f"{path}.{name}"] = m * state[f"{path}.{name}"] + (1 - m) * lax.stop_gradient(batch)
            else:
                mean, var = state[f"{path}.moving_mean"], state[f"{path}.moving_variance"]
            return (x - mean) / jnp.sqrt(var + cfg["epsilon"]) * gamma + beta, state
        return batchnorm
    if t == "layernorm":
        def layernorm(params, state, x, rng, training):
            gamma, beta = params[f"{path}.gamma"], params[f"{path}.beta"]
            x = x.astype(gamma.dtype)
            mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
            return (x - mean) / jnp.sqrt(var + cfg["epsilon"]) * gamma + beta, state
        return layernorm
    if t == "dropout":
        rate = cfg["rate"]

        def dropout(params, state, x, rng, training):  # jax.random's masks, not the harness's
            if not training or rate == 0:
                return x, state
            key = jax.random.fold_in(rng, zlib.crc32(path.encode()) % 2**31)  # a stream per layer
            keep = jax.random.bernoulli(key, 1 - rate, x.shape)
            return jnp.where(keep, x / (1 - rate), jnp.zeros_like(x)), state
        return dropout
    if t == "residual":
        main = [layer_fn(sub) for sub in cfg["layers"]]
        shortcut = [layer_fn(sub) for sub in cfg["projection"]] if cfg["projection"] else []

        def residual(params, state, x, rng, training):
            y, state = run_layers(main, params, state, x, rng, training)
            z, state = run_layers(shortcut, params, state, x, rng, training)
            return y + z, state
        return residual
    raise ValueError(f"layer type {t!r} is not exported")


def run_layers(fns, params, state, x, rng, training):
    for fn in fns:
        x, state = fn(params, state, x, rng, training)
    return x, state


def loss_fn(cfg, outputs, labels):
    """The batch-mean loss in float32 (float64 in a float64 run), whatever the compute dtype."""
    out = outputs.astype(jnp.promote_types(outputs.dtype, jnp.float32))
    if cfg["type"] == "sparse_categorical_crossentropy":
        if cfg["from_logits"]:
            logp = jax.nn.log_softmax(out, axis=-1)
        else:
            logp = jnp.log(jnp.clip(out / out.sum(axis=-1, keepdims=True), PROB_EPSILON, 1 - PROB_EPSILON))
        return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()
    z, y = out[:, 0], labels.astype(out.dtype)
    if cfg["from_logits"]:
        return (jax.nn.relu(z) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))).mean()
    p = jnp.clip(z, PROB_EPSILON, 1 - PROB_EPSILON)
    return -(y * jnp.log(p) + (1 - y) * jnp.log(1 - p)).mean()


def make_optimizer(cfg):
    """(init, update): update(grads, opt_state, params) -> (params, opt_state), the spec's math."""
    lr, tree = cfg["learning_rate"], jax.tree.map
    zeros = lambda params: tree(jnp.zeros_like, params)  # noqa: E731
    if cfg["type"] == "sgd":  # buf = m*buf + g; p -= lr*buf (nesterov: p -= lr*(g + m*buf))
        m = cfg["momentum"]

        def sgd(grads, state, params):
            buf = tree(lambda b, g: m * b + g, state, grads)
            step = tree(lambda g, b: g + m * b, grads, buf) if cfg["nesterov"] else buf
            return tree(lambda p, d: p - lr * d, params, step), buf
        return zeros, sgd
    if cfg["type"] == "adam":  # p -= lr*m_hat/(sqrt(v_hat) + eps)
        b1, b2, eps = cfg["beta_1"], cfg["beta_2"], cfg["epsilon"]

        def adam(grads, state, params):
            count, mu, nu = state
            count = count + 1
            mu = tree(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
            nu = tree(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
            t = count.astype(DTYPE)
            new = tree(lambda p, m, v: p - lr * (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + eps),
                       params, mu, nu)
            return new, (count, mu, nu)
        return (lambda params: (jnp.zeros((), jnp.int32), zeros(params), zeros(params))), adam
    if cfg["type"] == "rmsprop":  # v = rho*v + (1-rho)*g^2; p -= lr*g/sqrt(v + eps) or lr*g/(sqrt(v) + eps)
        rho, eps, inside = cfg["rho"], cfg["epsilon"], cfg["epsilon_placement"] == "inside"

        def rmsprop(grads, state, params):
            sq = tree(lambda v, g: rho * v + (1 - rho) * g * g, state, grads)
            denom = tree(lambda v: jnp.sqrt(v + eps) if inside else jnp.sqrt(v) + eps, sq)
            return tree(lambda p, g, d: p - lr * g / d, params, grads, denom), sq
        return zeros, rmsprop
    raise ValueError(f"optimizer {cfg['type']!r} is not exported")


def main():
    parser = argparse.ArgumentParser(description=f"train {CONFIG['model']} in JAX, {CONFIG['precision']}")
    parser.add_argument("--data", default=str(Path(__file__).with_name(CONFIG["data_file"])))
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    parser.add_argument("--losses-json", help="write each step's loss here as JSON")
    args = parser.parse_args()

    data = np.load(args.data)
    if str(data["spec_hash"]) != CONFIG["spec_hash"]:
        raise SystemExit(f"{args.data} holds the data of another spec ({data['spec_hash']}); export again")
    if not 1 <= args.steps <= len(data["x"]):
        raise SystemExit(f"--steps: the data file holds {len(data['x'])} batches")
    jax.config.update("jax_default_matmul_precision", "highest")  # strict float32 on GPUs (no TF32)
    weights = {key[2:]: jnp.asarray(data[key], DTYPE) for key in data.files if key.startswith("w/")}
    params = {k: v for k, v in weights.items() if not k.rsplit(".", 1)[1].startswith("moving_")}
    state = {k: v for k, v in weights.items() if k.rsplit(".", 1)[1].startswith("moving_")}
    net = [layer_fn(cfg) for cfg in CONFIG["layers"]]
    init, update = make_optimizer(CONFIG["optimizer"])
    opt_state = init(params)
    ls = CONFIG["loss_scale"]
    scaler = (jnp.asarray(ls["initial"], jnp.float32), jnp.zeros((), jnp.int32)) if ls else None

    @jax.jit
    def train_step(params, state, opt_state, scaler, x, y, rng):
        scale = scaler[0] if ls else 1.0

        def objective(params):
            out, new_state = run_layers(net, params, state, x, rng, True)
            loss = loss_fn(CONFIG["loss"], out, y)
            return loss * scale, (loss, new_state)

        grads, (loss, new_state) = jax.grad(objective, has_aux=True)(params)
        if not ls:
            new_params, new_opt = update(grads, opt_state, params)
            return new_params, new_state, new_opt, scaler, loss
        # dynamic loss scaling: unscale; skip the step (and halve the scale) when a gradient is not finite, else
        # apply it and double the scale after growth_interval clean steps in a row
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        new_params, new_opt = update(grads, opt_state, params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        good = jnp.where(finite, scaler[1] + 1, 0)
        grow = good >= ls["growth_interval"]
        new_scale = jnp.where(finite, jnp.where(grow, scale * ls["growth_factor"], scale),
                              scale * ls["backoff_factor"])
        return (keep(new_params, params), new_state, keep(new_opt, opt_state),
                (new_scale, jnp.where(grow, 0, good)), loss)

    rng = jax.random.PRNGKey(CONFIG["seed"])
    losses = []
    for step in range(args.steps):
        x, y = jnp.asarray(data["x"][step], DTYPE), jnp.asarray(data["y"][step])
        params, state, opt_state, scaler, loss = train_step(params, state, opt_state, scaler, x, y,
                                                            jax.random.fold_in(rng, step))
        losses.append(float(loss))
        print(f"step {step} loss {losses[-1]:.8g}", flush=True)
    if args.losses_json:
        Path(args.losses_json).write_text(json.dumps({
            "model": CONFIG["model"], "framework": "jax", "precision": CONFIG["precision"],
            "spec_hash": CONFIG["spec_hash"], "losses": [v if math.isfinite(v) else None for v in losses]}))


if __name__ == "__main__":
    main()
