"""Bad input never gets a traceback: a corpus of malformed specs through the CLI, and property-based tests
that throw random and mutated specs at the loader."""
from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.errors import SpecError
from harness.model.graph import infer
from harness.model.spec import MODELS_DIR, validate

BASE = yaml.safe_load((MODELS_DIR / "resnet8.yaml").read_text())
MLP = yaml.safe_load((MODELS_DIR / "mnist_mlp.yaml").read_text())


def edit(base, fn):
    data = copy.deepcopy(base)
    fn(data)
    return yaml.safe_dump(data)


def setpath(path, value):
    def fn(data):
        *parents, last = path
        for p in parents:
            data = data[p]
        data[last] = value
    return fn


def delpath(path):
    def fn(data):
        *parents, last = path
        for p in parents:
            data = data[p]
        del data[last]
    return fn


# (name, YAML text, what the one-line error must say); categories: YAML syntax, structure, unknown keys and
# types, missing fields, wrong types, zero/negative/out-of-range values, shapes that do not fit, dataset, loss,
# optimizer
CORPUS = [
    ("yaml-unclosed-list", "name: x\nlayers: [\n", "invalid YAML"),
    ("yaml-bad-indent", "name: x\n  input: 3\n", "invalid YAML"),
    ("yaml-tab", "name: x\n\tlayers: []\n", "invalid YAML"),
    ("yaml-python-tag", "!!python/object/apply:os.system ['true']\n", "invalid YAML"),
    ("empty-file", "", "expected a mapping at the top level"),
    ("top-level-list", "- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ("top-level-scalar", "42\n", "expected a mapping at the top level, got int"),
    ("unknown-top-key", edit(BASE, setpath(["batchsize"], 3)), "batchsize: unknown key; did you mean 'batch_size'?"),
    ("unknown-layer-key", edit(BASE, setpath(["layers", 0, "filter"], 3)), "layers[0].filter: unknown key; did you mean 'filters'?"),
    ("unknown-layer-type", edit(BASE, setpath(["layers", 2, "type"], "leaky_relu")), "layers[2]: unknown type 'leaky_relu'"),
    ("layer-without-type", edit(BASE, delpath(["layers", 2, "type"])), "layers[2]"),
    ("unknown-nested-type", edit(BASE, setpath(["layers", 3, "layers", 0, "type"], "conv3d")), "layers[3].layers[0]: unknown type 'conv3d'"),
    ("missing-name", edit(BASE, delpath(["name"])), "name: Field required"),
    ("missing-input", edit(BASE, delpath(["input"])), "input: Field required"),
    ("missing-dataset", edit(BASE, delpath(["dataset"])), "dataset: Field required"),
    ("missing-layers", edit(BASE, delpath(["layers"])), "give the network as `layers` or as `native`"),
    ("missing-loss", edit(BASE, delpath(["loss"])), "loss: Field required"),
    ("missing-optimizer", edit(BASE, delpath(["optimizer"])), "optimizer: Field required"),
    ("missing-batch-size", edit(BASE, delpath(["batch_size"])), "batch_size: Field required"),
    ("missing-filters", edit(BASE, delpath(["layers", 0, "filters"])), "layers[0].filters: Field required"),
    ("batch-size-text", edit(BASE, setpath(["batch_size"], "many")), "batch_size: Input should be a valid integer"),
    ("units-float", edit(MLP, setpath(["layers", 1, "units"], 51.5)), "layers[1].units: Input should be a valid integer"),
    ("use-bias-maybe", edit(MLP, setpath(["layers", 1, "use_bias"], "maybe")), "layers[1].use_bias: Input should be a valid boolean"),
    ("layers-not-list", edit(BASE, setpath(["layers"], "conv")), "layers: Input should be a valid list"),
    ("shape-text", edit(BASE, setpath(["input", "shape"], "32x32")), "input.shape: Input should be a valid list"),
    ("batch-size-zero", edit(BASE, setpath(["batch_size"], 0)), "batch_size: Input should be greater than 0"),
    ("steps-negative", edit(BASE, setpath(["steps"], -5)), "steps: Input should be greater than 0"),
    ("units-zero", edit(MLP, setpath(["layers", 1, "units"], 0)), "layers[1].units: Input should be greater than 0"),
    ("filters-negative", edit(BASE, setpath(["layers", 0, "filters"], -2)), "layers[0].filters: Input should be greater than 0"),
    ("kernel-zero", edit(BASE, setpath(["layers", 0, "kernel_size"], 0)), "layers[0].kernel_size: Input should be greater than 0"),
    ("input-dim-zero", edit(BASE, setpath(["input", "shape"], [32, 0, 3])), "input.shape[1]: Input should be greater than 0"),
    ("input-4d", edit(BASE, setpath(["input", "shape"], [1, 32, 32, 3])), "input.shape: List should have at most 3 items"),
    ("dropout-rate", edit(MLP, lambda d: d["layers"].insert(2, {"type": "dropout", "rate": 1.5})), "layers[2].rate: Input should be less than 1"),
    ("bn-momentum", edit(BASE, setpath(["layers", 1, "momentum"], 1.2)), "layers[1].momentum: Input should be less than 1"),
    ("bn-epsilon-zero", edit(BASE, setpath(["layers", 1, "epsilon"], 0)), "layers[1].epsilon: Input should be greater than 0"),
    ("lr-negative", edit(BASE, setpath(["optimizer", "learning_rate"], -0.1)), "optimizer.learning_rate: Input should be greater than 0"),
    ("eval-fraction", edit(BASE, setpath(["dataset", "eval_fraction"], 1.5)), "dataset.eval_fraction: Input should be less than 1"),
    ("padding-full", edit(BASE, setpath(["layers", 0, "padding"], "full")), "layers[0].padding: Input should be 'valid' or 'same'"),
    ("conv-after-flatten", edit(MLP, lambda d: d["layers"].insert(1, {"type": "conv2d", "filters": 2, "kernel_size": 3})), "layers[1] (conv2d): expects an image input"),
    ("dense-on-image", edit(MLP, delpath(["layers", 0])), "layers[0] (dense): expects a vector or a sequence, got an image [28, 28, 1]"),
    ("kernel-too-big", edit(BASE, setpath(["layers", 0], {"type": "conv2d", "filters": 16, "kernel_size": 40})), "layers[0] (conv2d): kernel 40 does not fit input [32, 32, 3]"),
    ("pool-too-big", edit(MLP, lambda d: d["layers"].insert(0, {"type": "maxpool2d", "pool_size": 64})), "layers[0] (maxpool2d): pool 64 does not fit"),
    ("residual-mismatch", edit(BASE, delpath(["layers", 5, "projection"])), "layers[5] (residual): block output [16, 16, 32] does not match its input"),
    ("wrong-class-count", edit(BASE, setpath(["dataset", "num_classes"], 7)), "the network outputs [10] but sparse_categorical_crossentropy on 7 classes needs [7]"),
    ("binary-with-10-classes", edit(BASE, setpath(["loss", "type"], "binary_crossentropy")), "binary_crossentropy needs dataset.num_classes 2"),
    ("empty-layers", edit(BASE, setpath(["layers"], [])), "layers: List should have at least 1 item"),
    ("unknown-dataset", edit(BASE, setpath(["dataset", "name"], "imagenet")), "dataset.name: Input should be 'synthetic', 'digits', 'image_folder', 'text' or 'synthetic_tokens'"),
    ("image-folder-no-path", edit(BASE, setpath(["dataset", "name"], "image_folder")), "dataset: image_folder needs 'path'"),
    ("digits-3-classes", edit(BASE, setpath(["dataset"], {"name": "digits", "num_classes": 3})), "digits has num_classes 10, or 2"),
    ("one-class", edit(BASE, setpath(["dataset", "num_classes"], 1)), "dataset.num_classes: Input should be greater than or equal to 2"),
    ("unknown-loss", edit(BASE, setpath(["loss", "type"], "hinge")), "loss.type: Input should be"),
    ("no-from-logits", edit(BASE, delpath(["loss", "from_logits"])), "loss.from_logits: Field required"),
    ("unknown-optimizer", edit(BASE, setpath(["optimizer", "type"], "lamb")), "optimizer: unknown type 'lamb' (valid: sgd, adam, adamw, rmsprop)"),
    ("rmsprop-placement", edit(BASE, setpath(["optimizer"], {"type": "rmsprop", "learning_rate": 0.1, "rho": 0.9, "epsilon": 1e-7, "epsilon_placement": "middle"})), "optimizer.epsilon_placement: Input should be 'inside' or 'outside'"),
    ("sgd-missing-momentum", edit(BASE, delpath(["optimizer", "momentum"])), "optimizer.momentum: Field required"),
    ("lr-infinite", edit(BASE, setpath(["optimizer", "learning_rate"], float("inf"))), "optimizer.learning_rate: Input should be a finite number"),
    ("epsilon-nan", edit(BASE, setpath(["layers", 1, "epsilon"], float("nan"))), "layers[1].epsilon: Input should be a finite number"),
    ("seed-too-large", edit(BASE, setpath(["seed"], 2**70)), "seed: Input should be less than 4294967296"),
    ("seed-negative", edit(BASE, setpath(["seed"], -1)), "seed: Input should be greater than or equal to 0"),
    ("name-megabytes", edit(BASE, setpath(["name"], "x" * 100_000)), "name: String should have at most 100 characters"),
    ("nested-too-deeply", "name: x\nlayers: " + "[" * 20000 + "]" * 20000 + "\n", "invalid YAML: nested too deeply"),
    ("too-large", "name: x\n" + "#" * (1 << 20) + "\n", "larger than 1 MiB"),
]


def _png(path, width, height, colour=0):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (width, height), colour).save(path)


def _png_header(path, width, height):
    """A PNG whose header claims width x height pixels, with no pixel data: what a decompression bomb looks
    like to a reader that trusts the header."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b""))


def folder_spec(make=None, **dataset):
    """A spec text reading an image folder that `make(root)` fills (two 8x8 classes by default)."""
    def text(tmp_path):
        root = tmp_path / "images"
        if make is None:
            for c in ("a", "b"):
                for i in range(4):
                    _png(root / c / f"{i}.png", 8, 8, 40 * i)
        else:
            make(root)
        data = copy.deepcopy(BASE)
        data["dataset"] = {"name": "image_folder", "num_classes": 2, "path": str(root), **dataset}
        data.update(input={"shape": [8, 8, 1]}, batch_size=2,
                    layers=[{"type": "flatten"}, {"type": "dense", "units": data["dataset"]["num_classes"]}])
        return yaml.safe_dump(data)
    return text


def _two_classes(root, extra=None):
    for c in ("a", "b"):
        for i in range(4):
            _png(root / c / f"{i}.png", 8, 8)
    if extra:
        extra(root)


def _huge_images(root):
    _two_classes(root, lambda r: _png_header(r / "a" / "huge.png", 9000, 8000))


def _laughs():
    layers = ["&x0 {type: residual, layers: [" + ", ".join(["{type: relu}"] * 10) + "]}"]
    layers += [f"&x{i} {{type: residual, layers: [" + ", ".join([f"*x{i - 1}"] * 10) + "]}" for i in range(1, 8)]
    return "name: laughs\nlayers: [" + ", ".join(layers) + "]\n"


SYNTH = edit(BASE, setpath(["dataset", "size"], 100))
# data that cannot serve the run, sizes that cannot fit, strings and structures beyond sane limits
CORPUS += [
    ("batch-exceeds-train-split", edit(yaml.safe_load(SYNTH), setpath(["batch_size"], 90)),
     "batch_size 90 exceeds the 80 training samples"),
    ("batch-exceeds-digits", edit(MLP, setpath(["batch_size"], 1500)), "batch_size 1500 exceeds the 1438 training samples"),
    ("one-sample-dataset", edit(BASE, setpath(["dataset", "size"], 1)), "exceeds the 0 training samples"),
    ("all-for-evaluation", edit(yaml.safe_load(SYNTH), setpath(["dataset", "eval_fraction"], 0.999)),
     "exceeds the 0 training samples"),
    ("digits-vector-not-square", edit(MLP, lambda d: (d.update(input={"shape": [50]}), d["layers"].pop(0))),
     "digits as vectors needs a square input size"),
    ("input-2d", edit(MLP, setpath(["input", "shape"], [28, 28])), "input: shape: give [H, W, C]"),
    ("image-folder-missing", edit(BASE, setpath(["dataset"], {"name": "image_folder", "num_classes": 10,
                                                              "path": "/nonexistent/amp-harness"})), "does not exist"),
    ("image-folder-is-file", lambda tmp: edit(BASE, setpath(["dataset"], {
        "name": "image_folder", "num_classes": 10, "path": str(tmp / "image-folder-is-file.yaml")})),
     "is a file, not a directory of class folders"),
    ("image-folder-empty", folder_spec(lambda root: root.mkdir()), "found 0 class folders"),
    ("image-folder-fewer-classes", folder_spec(num_classes=3), "found 2 class folders ['a', 'b'], the spec says num_classes 3"),
    ("image-folder-class-without-images", folder_spec(lambda root: _two_classes(root, lambda r: (r / "c").mkdir()),
                                                      num_classes=3), "class folder 'c' has no images"),
    ("image-folder-text-as-png", folder_spec(lambda root: _two_classes(
        root, lambda r: (r / "a" / "notes.png").write_text("not an image"))), "notes.png: unreadable image"),
    ("image-folder-truncated-png", folder_spec(lambda root: _two_classes(
        root, lambda r: (r / "b" / "cut.png").write_bytes((r / "b" / "0.png").read_bytes()[:40]))),
     "cut.png: unreadable image"),
    ("image-folder-mixed-sizes", folder_spec(lambda root: _two_classes(
        root, lambda r: _png(r / "b" / "wide.png", 16, 8))), "the images of a dataset must share one size"),
    ("image-folder-huge-image", folder_spec(_huge_images), "huge.png: 9000x8000 pixels: too large"),
    ("image-folder-bomb", folder_spec(lambda root: _two_classes(
        root, lambda r: _png_header(r / "a" / "bomb.png", 60000, 60000))), "bomb.png: unreadable image"),
    ("image-folder-vector-input", lambda tmp: folder_spec()(tmp).replace("shape:\n  - 8\n  - 8\n  - 1", "shape:\n  - 64"),
     "image_folder needs an image input"),
    ("image-folder-two-channels", lambda tmp: folder_spec()(tmp).replace("  - 8\n  - 1\n", "  - 8\n  - 2\n"),
     "image_folder needs an image input [H, W, 1] or [H, W, 3]"),
    ("dense-billions-of-units", edit(MLP, setpath(["layers", 1, "units"], 4_000_000_000)), "needs about"),
    ("image-60000-pixels", edit(BASE, setpath(["input", "shape"], [60000, 60000, 3])), "needs about"),
    ("batch-of-millions", edit(yaml.safe_load(edit(BASE, setpath(["dataset", "size"], 20_000_000))),
                               setpath(["batch_size"], 10_000_000)), "needs about"),
    ("classes-in-billions", edit(MLP, lambda d: (d["dataset"].update(name="synthetic", num_classes=3_000_000_000),
                                                 d["layers"][-1].update(units=3_000_000_000))), "needs about"),
    ("name-with-newline", edit(BASE, setpath(["name"], "two\nlines")), "name: must be one line of printable characters"),
    ("name-with-escape", edit(BASE, setpath(["name"], "\x1b[31mred")), "name: must be one line"),
    ("name-empty", edit(BASE, setpath(["name"], "")), "name: String should have at least 1 character"),
    ("description-megabyte", edit(BASE, setpath(["description"], "d" * 20_000)), "description: String should have at most"),
    ("path-too-long", edit(BASE, setpath(["dataset"], {"name": "image_folder", "num_classes": 10, "path": "p" * 5000})),
     "dataset.path: String should have at most 4096 characters"),
    ("long-unknown-key", edit(BASE, setpath(["k" * 10_000], 1)), "kkk...: unknown key"),
    ("long-unknown-type", edit(BASE, setpath(["layers", 0, "type"], "t" * 10_000)), "unknown type 'ttt"),
    ("yaml-aliases-billion-laughs", _laughs(), "more than 100000 values once its aliases"),
    ("deep-residuals", "name: x\nlayers: [" + "{type: residual, layers: [" * 400 + "{type: relu}" + "]}" * 400 + "]\n",
     "invalid YAML: nested too deeply"),
    ("nul-bytes", "name: x\x00\n", "invalid YAML"),
    ("binary-png-as-spec", lambda tmp: (_png(tmp / "img.png", 4, 4), (tmp / "img.png").read_bytes().decode("latin-1"))[1],
     "not UTF-8 text"),
    ("size-zero", edit(BASE, setpath(["dataset", "size"], 0)), "dataset.size: Input should be greater than 0"),
    ("eval-fraction-zero", edit(BASE, setpath(["dataset", "eval_fraction"], 0)), "dataset.eval_fraction: Input should be greater than 0"),
    ("seed-float", edit(BASE, setpath(["seed"], 1.5)), "seed: Input should be a valid integer"),
    ("seed-text", edit(BASE, setpath(["seed"], "lucky")), "seed: Input should be a valid integer"),
    ("steps-huge-float", edit(BASE, setpath(["steps"], 1e400)), "steps: Input should be"),
    ("lr-nan", edit(BASE, setpath(["optimizer", "learning_rate"], float("nan"))), "optimizer.learning_rate: Input should be a finite number"),
    ("momentum-minus-inf", edit(BASE, setpath(["optimizer", "momentum"], float("-inf"))), "optimizer.momentum: Input should be a finite number"),
    ("dropout-negative", edit(MLP, lambda d: d["layers"].insert(2, {"type": "dropout", "rate": -0.1})), "layers[2].rate: Input should be greater than or equal to 0"),
    ("pool-strides-zero", edit(BASE, lambda d: d["layers"].insert(0, {"type": "avgpool2d", "strides": 0})), "layers[0].strides: Input should be greater than 0"),
    ("conv-strides-negative", edit(BASE, setpath(["layers", 0, "strides"], -1)), "layers[0].strides: Input should be greater than 0"),
    ("gelu-approximate-text", edit(MLP, lambda d: d["layers"].insert(2, {"type": "gelu", "approximate": "maybe"})), "layers[2].approximate: Input should be a valid boolean"),
    ("adam-epsilon-negative", edit(BASE, setpath(["optimizer"], {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": -1e-7})), "optimizer.epsilon: Input should be greater than 0"),
    ("adam-beta-one", edit(BASE, setpath(["optimizer"], {"type": "adam", "learning_rate": 0.001, "beta_1": 1.0, "beta_2": 0.999, "epsilon": 1e-7})), "optimizer.beta_1: Input should be less than 1"),
    ("rmsprop-rho-one", edit(BASE, setpath(["optimizer"], {"type": "rmsprop", "learning_rate": 0.1, "rho": 1.0, "epsilon": 1e-7, "epsilon_placement": "inside"})), "optimizer.rho: Input should be less than 1"),
    ("from-logits-text", edit(BASE, setpath(["loss", "from_logits"], "sometimes")), "loss.from_logits: Input should be a valid boolean"),
    ("input-null", edit(BASE, setpath(["input"], None)), "input: Input should be a valid dictionary"),
    ("dataset-unknown-key", edit(BASE, setpath(["dataset", "root"], "/data")), "dataset.root: unknown key"),
    ("integer-key", edit(BASE, setpath([1], 2)), "[1]: Keys should be strings"),
    ("residual-empty-layers", edit(BASE, setpath(["layers", 3, "layers"], [])), "layers[3].layers: List should have at least 1 item"),
    ("yaml-set", "!!set {a, b}\n", "expected a mapping at the top level, got set"),
    # a key given twice in one mapping: YAML would let the second win, silently
    ("duplicate-top-key", "name: x\nbatch_size: 4\nlayers: []\nbatch_size: 64\n",
     "line 4: key 'batch_size' appears twice, at lines 2 and 4"),
    ("duplicate-layer-key", "name: x\nlayers:\n  - type: dense\n    units: 3\n    units: 5\n",
     "line 5: key 'units' appears twice, at lines 4 and 5"),
    ("duplicate-flow-key", "name: x\nlayers: [{type: relu, type: dense}]\n",
     "key 'type' appears twice, at lines 2 and 2"),
    ("top-level-string", "just some text\n", "expected a mapping at the top level, got str"),
]


@pytest.mark.parametrize("name, text, expected", CORPUS, ids=[c[0] for c in CORPUS])
@pytest.mark.parametrize("command", ["check", "run"])
def test_malformed_spec_corpus(tmp_path, capsys, command, name, text, expected):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text(tmp_path) if callable(text) else text, encoding="latin-1" if name.startswith("binary-png") else None)
    args = ["check", str(path)] if command == "check" else \
        ["run", "--framework", "torch", "--model", str(path), "--out", str(tmp_path / "out")]
    if command == "run":  # the spec is validated before the adapter is needed; skip the adapter check
        from harness import adapter

        adapter_discover = adapter.discover
        adapter.discover = lambda: {"torch": None}
    try:
        code = main(args)
    finally:
        if command == "run":
            adapter.discover = adapter_discover
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("amp-harness: error: "), err
    assert (str(path) in lines[0] or yaml.safe_load(path.read_text())["name"] in lines[0]) and expected in lines[0], \
        lines[0]
    assert not (tmp_path / "out").exists()  # no records: nothing reached a worker


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_spec_that_is_not_utf8_text_is_one_line(tmp_path, capsys, command):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    args = ["check", str(path)] if command == "check" else ["run", "--framework", "fake", "--model", str(path)]
    from harness import adapter

    discover, adapter.discover = adapter.discover, lambda: {"fake": None}
    try:
        code = main(args)
    finally:
        adapter.discover = discover
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{path}: byte 9: not UTF-8 text" in err[0], err


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 100


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_specs_either_load_or_raise_spec_error(data):
    spec = copy.deepcopy(data.draw(st.sampled_from([BASE, MLP])))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(spec) if p]
        path = data.draw(st.sampled_from(paths))
        parent = spec
        for p in path[:-1]:
            parent = parent[p]
        if data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON | st.integers(-2, 70))
    try:
        infer(validate(spec, "mutated"), "mutated")  # what resolving a spec asks (harness.run.plan.resolve)
    except SpecError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200) | JSON)
def test_random_documents_either_load_or_raise_spec_error(doc):
    try:
        validate(yaml.safe_load(doc) if isinstance(doc, str) else doc, "random")
    except SpecError as exc:
        assert "\n" not in str(exc)
    except yaml.YAMLError:
        pass  # load_spec turns these into SpecError; covered by the corpus
