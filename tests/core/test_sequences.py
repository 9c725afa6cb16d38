"""Token sequences in the core: the text and synthetic_tokens datasets, the transformer layers' shapes, FLOPs and
memory, the reference's attention, and the one-line refusals of bad transformer specs."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import yaml

from harness.cli import main
from harness.errors import HarnessError, SpecError
from harness.model import memory, reference
from harness.model.data import Data, check
from harness.model.dropout import DropoutMasks
from harness.model.graph import infer
from harness.model.rotary import rotary_tables, rotate
from harness.model.spec import MODELS_DIR, validate
from harness.model.weights import initial_weights
from harness.precision import parse_precision
from harness.run.metrics import loss_and_correct
from harness.run.plan import resolve

GPT = yaml.safe_load((MODELS_DIR / "tiny_gpt.yaml").read_text())
SPECS = MODELS_DIR.parent / "tests" / "specs"


def gpt(**changes) -> dict:
    doc = copy.deepcopy(GPT)
    doc.update(changes)
    return doc


def write(tmp_path, doc, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_text_windows_are_next_byte_pairs_split_by_position(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(bytes(range(256)) * 8)
    (corpus / "b.txt").write_bytes(b"hello world " * 100)
    spec, _ = resolve(write(tmp_path, gpt(dataset={"name": "text", "path": str(corpus), "size": 40})))
    data = Data(spec)
    x, y = data.train_batch(0)
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (spec.batch_size, 64)
    assert (x[:, 1:] == y[:, :-1]).all()  # the label at t is the input at t + 1
    whole = (corpus / "a.txt").read_bytes() + (corpus / "b.txt").read_bytes()
    assert bytes(x[0].astype(np.uint8)) in whole
    # the evaluation windows are the corpus's last ones, never interleaved with training windows
    assert data.eval_idx.min() > data.train_idx.max() and len(data.eval_idx) == 8


def test_the_corpus_hash_joins_the_spec_hash(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"abcdefgh" * 200)
    (tmp_path / "two.txt").write_bytes(b"abcdefgi" * 200)
    hashes = set()
    for name in ("one.txt", "two.txt"):
        spec, _ = resolve(write(tmp_path, gpt(dataset={"name": "text", "path": str(tmp_path / name)})))
        assert spec.dataset.corpus_hash is not None
        hashes.add(spec.spec_hash())
    assert len(hashes) == 2
    pinned = gpt(dataset={"name": "text", "path": str(tmp_path / "one.txt"), "corpus_hash": "0" * 16})
    with pytest.raises(SpecError, match="dataset.corpus_hash: the spec names corpus 0000000000000000"):
        resolve(write(tmp_path, pinned))


def test_the_default_corpus_is_this_pythons_standard_library():
    spec, _ = resolve("tiny_gpt")
    data = Data(spec)
    text = b"".join(bytes(x.astype(np.uint8)) for x in data.fixed_batch()[0])
    assert b"def " in text or b"import " in text


def test_synthetic_next_tokens_follow_the_two_token_rule_mostly():
    spec, _ = resolve(str(SPECS / "pitfall_causal_mask.yaml"))
    source = Data(spec).source
    tokens = np.concatenate([source.tokens, source.labels[:, -1:]], axis=1)
    vocab = spec.input.vocab
    # the rule: tokens[t] = successor[(tokens[t-2] + tokens[t-1]) % vocab] 80% of the time
    keys = (tokens[:, :-2] + tokens[:, 1:-1]) % vocab
    agree = [np.bincount(tokens[:, 2:][keys == k], minlength=vocab).max() / max((keys == k).sum(), 1)
             for k in range(vocab)]
    assert np.mean(agree) > 0.7
    assert (source.tokens[:, 1:] == source.labels[:, :-1]).all()


def test_synthetic_token_classes_have_their_signature_tokens():
    spec, _ = resolve(str(SPECS / "pitfall_attention_dropout.yaml"))
    source = Data(spec).source
    assert source.labels.shape == (spec.dataset.size,) and set(source.labels) == {0, 1, 2}
    counts = np.stack([np.bincount(source.tokens[source.labels == c].ravel(), minlength=24) for c in range(3)])
    assert (counts.argmax(axis=1) != counts.argmax(axis=1)[0]).any()  # the classes' commonest tokens differ


def test_layer_shapes_parameters_and_flops_of_a_transformer():
    spec, graph = resolve("tiny_gpt")
    by_path = {layer.path: layer for layer in graph.layers}
    assert by_path["0"].out_shape == (64, 64) and by_path["0"].params == {"embeddings": (256, 64)}
    attention = by_path["2.layers.1"]
    assert attention.param_count == 4 * 64 * 64 + 4 * 64
    assert attention.flops == 8 * 64 * 64 * 64 + 4 * 64 * 64 * 64  # projections, then the T^2 terms
    assert by_path["7"].flops == 2 * 64 * 64 * 256  # dense on the last axis, at every position
    assert graph.output_shape == (64, 256)
    _, vit = resolve("vit_tiny")
    assert vit.layers[0].out_shape == (64, 64) and vit.layers[0].flops == 2 * 64 * 4 * 4 * 3 * 64


def test_memory_estimate_counts_attention_probabilities_per_t_squared():
    def activations(length):
        doc = yaml.safe_load((SPECS / "pitfall_long_sequence.yaml").read_text())
        doc["input"]["shape"] = [length]
        spec = validate(doc, "long")
        return memory.estimate(infer(spec), spec, parse_precision("fp32")).parts_mb["activations"]

    # the estimate of T 256 against T 128: the layers' outputs double, the heads x T^2 probabilities quadruple,
    # kept three times with attention dropout (the probabilities, the mask, the dropped probabilities)
    spec = validate(yaml.safe_load((SPECS / "pitfall_long_sequence.yaml").read_text()), "long")
    assert spec.layers[2].layers[1].dropout > 0
    probabilities = spec.batch_size * 2 * 256 * 256 * 4 / 2**20
    assert activations(256) - 2 * activations(128) == pytest.approx(3 * probabilities / 2, rel=1e-9)


def test_attention_dropout_masks_are_heads_by_t_by_t():
    spec, graph = resolve(str(SPECS / "pitfall_pre_norm.yaml"))
    masks = DropoutMasks(graph, spec.seed).for_step(0, 4)
    assert {path: m.shape for path, m in masks.items()} == {"2.layers.1": (4, 4, 10, 10)}
    assert 0.7 < masks["2.layers.1"].mean() < 0.9  # rate 0.2


def test_reference_attention_is_causal_and_scaled_before_the_softmax():
    spec, graph = resolve(str(SPECS / "pitfall_causal_mask.yaml"))
    weights = initial_weights(graph, spec.seed)
    x, _ = Data(spec).fixed_batch()
    out = reference.forward(spec, weights, x)
    changed = x.copy()
    changed[:, 6] = (changed[:, 6] + 1) % spec.input.vocab
    moved = np.abs(reference.forward(spec, weights, changed) - out).max(axis=(0, 2))
    assert (moved[:6] == 0).all() and (moved[6:] > 0).all()  # position t sees positions 0..t only
    # one head by hand: softmax(q k^T / sqrt(Dh)) v on the embedded input (no biases in this spec)
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    h = w["0.embeddings"][x[0]]
    q, k, v = (h @ w[f"1.{n}_kernel"] for n in ("query", "key", "value"))
    s = q[:, :8] @ k[:, :8].T / math.sqrt(8) + np.triu(np.full((12, 12), -np.inf), 1)
    p = np.exp(s - s.max(1, keepdims=True))
    head0 = (p / p.sum(1, keepdims=True)) @ v[:, :8]
    # head 0's contribution alone: the output kernel's rows of head 1 zeroed
    w0 = dict(w, **{"1.output_kernel": np.concatenate([w["1.output_kernel"][:8], np.zeros((8, 16))])})
    assert np.allclose(reference._attention(spec.layers[1], "1", w0, h[None], None)[0],
                       head0 @ w["1.output_kernel"][:8], atol=1e-12)


def test_next_token_loss_is_the_mean_over_every_token():
    rng = np.random.default_rng(0)
    logits, labels = rng.standard_normal((3, 5, 7)), rng.integers(0, 7, (3, 5))
    spec = validate(gpt(), "gpt")
    total, correct = loss_and_correct(spec.loss, logits, labels)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert total == pytest.approx(-np.take_along_axis(logp, labels[..., None], -1).sum())
    assert correct == (logits.argmax(-1) == labels).sum()


def _block(doc):
    return doc["layers"][2]["layers"]


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: _block(d)[1].update(heads=3), "layers[2].layers[1] (attention): heads 3 do not divide the model "
                                             "dimension 64"),
    (lambda d: d["input"].update(vocab=100), "input.vocab: text is bytes, vocab 256, got 100"),
    (lambda d: d["layers"][-1].update(units=100), "the network outputs [64, 100] but next-token prediction over "
                                                  "vocab 256 needs [64, 256]"),
    (lambda d: d["layers"][1].update(max_length=32), "layers[1] (position_embedding): the sequence has 64 positions "
                                                     "but the position table max_length 32"),
    (lambda d: d["layers"].insert(1, {"type": "embedding", "dim": 64}), "layers[1] (embedding): an embedding takes "
                                                                        "the token ids: it must be the first layer"),
    (lambda d: d["layers"].pop(0), "layers[0] (position_embedding): the input is token ids: the first layer must be "
                                   "an embedding"),
    (lambda d: d["input"].pop("vocab"), "input.vocab: text gives token ids: give the vocabulary size"),
    (lambda d: d["dataset"].update(num_classes=4), "text is next-token prediction over its bytes"),
    (lambda d: d["layers"].insert(6, {"type": "batchnorm"}), "normalise tokens with layernorm or rmsnorm"),
])
def test_bad_transformer_specs_are_one_line_exit_2(tmp_path, capsys, mutate, expected):
    doc = gpt()
    mutate(doc)
    path = write(tmp_path, doc)
    assert main(["check", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {path}: " in err and expected in err, err


def test_sequence_pool_on_an_image_is_refused(tmp_path, capsys):
    doc = yaml.safe_load((MODELS_DIR / "vit_tiny.yaml").read_text())
    doc["layers"] = [{"type": "sequence_pool", "mode": "mean"}, {"type": "flatten"}, {"type": "dense", "units": 10}]
    assert main(["check", write(tmp_path, doc)]) == 2
    assert "layers[0] (sequence_pool): expects a sequence [T, D], got an image [32, 32, 3]" in capsys.readouterr().err
    doc["layers"] = [{"type": "patches", "size": 5, "dim": 8}, {"type": "sequence_pool", "mode": "mean"},
                     {"type": "dense", "units": 10}]
    assert main(["check", write(tmp_path, doc)]) == 2
    assert "patch size 5 does not divide the image [32, 32, 3]" in capsys.readouterr().err


@pytest.mark.parametrize("corpus, expected", [
    (b"", "the corpus is empty"),
    (b"short text", "input.shape: a window of 64 tokens needs 65 bytes, the corpus has 10"),
])
def test_a_corpus_too_small_is_one_line(tmp_path, capsys, corpus, expected):
    (tmp_path / "c.txt").write_bytes(corpus)
    path = write(tmp_path, gpt(dataset={"name": "text", "path": str(tmp_path / "c.txt")}))
    assert main(["check", path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_a_missing_corpus_is_one_line(tmp_path, capsys):
    path = write(tmp_path, gpt(dataset={"name": "text", "path": str(tmp_path / "nowhere" / "*.txt")}))
    assert main(["check", path]) == 2
    assert "no files match" in capsys.readouterr().err
    with pytest.raises(HarnessError, match="does not exist"):
        check(validate(gpt(dataset={"name": "text", "path": str(tmp_path / "nowhere")}), "g"), "g")


def test_rotary_pairings_are_hugging_faces_and_gpt_js():
    rng = np.random.default_rng(1)
    x, base = rng.standard_normal((2, 5, 8)), 50.0
    inverse = 1.0 / base ** (np.arange(0, 8, 2) / 8)
    angles = np.arange(5)[:, None] * inverse  # [T, Dh/2]
    # Hugging Face's apply_rotary_pos_emb: cos and sin of cat(freqs, freqs), rotate_half(x) = cat(-x2, x1)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    half = x * cos + np.concatenate([-x[..., 4:], x[..., :4]], -1) * sin
    assert np.allclose(rotate(x, *rotary_tables(5, 8, base, "half")), half, atol=1e-15)
    # GPT-J's rotate_every_two: pairs (2i, 2i+1), each frequency repeated twice in place
    cos, sin = np.cos(np.repeat(angles, 2, -1)), np.sin(np.repeat(angles, 2, -1))
    two = np.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)
    assert np.allclose(rotate(x, *rotary_tables(5, 8, base, "interleaved")), x * cos + two * sin, atol=1e-15)
    assert not np.allclose(half, x * cos + two * sin)


def test_grouped_heads_read_their_groups_key_and_value_heads():
    spec, graph = resolve(str(SPECS / "pitfall_rotary.yaml"))
    layer, path = spec.layers[2].layers[1], "2.layers.1"  # 4 query heads, 2 key/value heads, rotary "half"
    shapes = graph.param_shapes()
    assert shapes[f"{path}.key_kernel"] == (16, 8) and shapes[f"{path}.query_kernel"] == (16, 16)
    w = {k: v.astype(np.float64) for k, v in initial_weights(graph, spec.seed).items()}
    x = np.random.default_rng(2).standard_normal((1, 8, 16))
    q, k, v = (x[0] @ w[f"{path}.{n}_kernel"] for n in ("query", "key", "value"))
    tables = rotary_tables(8, 4, 100.0, "half")
    heads = []
    for h in range(4):  # Llama's repeat_kv: query head h reads key/value head h // 2
        g = h // 2
        s = rotate(q[:, 4 * h:4 * h + 4], *tables) @ rotate(k[:, 4 * g:4 * g + 4], *tables).T / 2
        p = np.exp(s + np.triu(np.full((8, 8), -np.inf), 1))
        heads.append(p / p.sum(1, keepdims=True) @ v[:, 4 * g:4 * g + 4])
    want = np.concatenate(heads, -1) @ w[f"{path}.output_kernel"]
    assert np.allclose(reference._attention(layer, path, w, x, None)[0], want, atol=1e-12)


@pytest.mark.parametrize("change, expected", [
    ({"kv_heads": 3}, "kv_heads 3 do not divide the heads 4"),
    ({"heads": 16, "kv_heads": 4}, "rotary turns pairs of dimensions: the head dimension 1 is odd"),
    ({"rotary": {"pairing": "even"}}, "rotary.pairing: Input should be 'half' or 'interleaved'"),
])
def test_bad_rotary_and_grouped_heads_are_one_line(tmp_path, capsys, change, expected):
    doc = yaml.safe_load((SPECS / "pitfall_rotary.yaml").read_text())
    doc["layers"][2]["layers"][1].update(change)
    assert main(["check", write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
