"""Datasets and batch order, produced once in the core so that every framework sees the same batches.

Samples come out as float32 in the spec's input shape (NHWC images, or vectors), or as int64 token ids [T];
labels as int64 class ids, or for next-token prediction the int64 ids of the next token at every position [T].
The samples and the split depend on the spec's seed only; the per-epoch shuffles on the run's seed (the spec's
unless a repeat shifts it: harness.run.worker.run_seed).
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import math
import sysconfig
import warnings
from pathlib import Path

import numpy as np

from harness.errors import HarnessError, clip
from harness.model.spec import ModelSpec

CACHE_LIMIT_BYTES = 256 * 2**20  # materialise a whole dataset only when it is this small
INPUT_BYTES = 4  # images and vectors are handed over as float32
TOKEN_BYTES = 8  # token ids as int64


def sample_bytes(spec: ModelSpec) -> int:
    """The bytes of one element of a sample as the core hands it over."""
    return TOKEN_BYTES if spec.tokens else INPUT_BYTES


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp"}


def _resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of [N, h, w, C] float32 images."""
    n, h, w, c = images.shape
    if (h, w) == (height, width):
        return images
    from PIL import Image

    out = np.empty((n, height, width, c), np.float32)
    for i in range(n):
        for ch in range(c):
            img = Image.fromarray(np.ascontiguousarray(images[i, :, :, ch]), mode="F")
            out[i, :, :, ch] = np.asarray(img.resize((width, height), Image.BILINEAR))
    return out


def _fit_channels(images: np.ndarray, channels: int) -> np.ndarray:
    have = images.shape[-1]
    if have == channels:
        return images
    if have == 1:
        return np.repeat(images, channels, axis=-1)
    if channels == 1:
        return images.mean(axis=-1, keepdims=True)
    raise HarnessError(f"cannot turn {have}-channel images into {channels} channels")


class Source:
    """A finite set of labelled samples; `samples(indices)` gives them in the spec's input shape."""

    labels: np.ndarray

    def __init__(self, spec: ModelSpec):
        self.shape = spec.sample_shape
        self.seed = spec.seed

    def samples(self, indices: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def split(self, n_eval: int) -> tuple[np.ndarray, np.ndarray]:
        """(evaluation, training) sample indices, sorted: a random split by the spec's seed."""
        order = np.random.default_rng([self.seed, 3]).permutation(len(self.labels))
        return np.sort(order[:n_eval]), np.sort(order[n_eval:])


class Synthetic(Source):
    """A learnable task: each class has a fixed low-frequency template; samples are template + noise."""

    NOISE = 1.5

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        ds = spec.dataset
        rng = np.random.default_rng([spec.seed, 1])
        self.labels = rng.integers(0, ds.num_classes, ds.size).astype(np.int64)
        if len(self.shape) == 3:
            h, w, c = self.shape
            coarse = rng.standard_normal((ds.num_classes, 4, 4, c)).astype(np.float32)
            reps = (math.ceil(h / 4), math.ceil(w / 4))
            self.templates = np.repeat(np.repeat(coarse, reps[0], 1), reps[1], 2)[:, :h, :w, :]
        else:
            self.templates = rng.standard_normal((ds.num_classes, *self.shape)).astype(np.float32)

    def samples(self, indices):
        noise = np.stack([np.random.default_rng([self.seed, 2, int(i)]).standard_normal(self.shape, np.float32)
                          for i in indices])
        return self.templates[self.labels[indices]] + self.NOISE * noise


class Digits(Source):
    """The 8x8 handwritten digits scikit-learn bundles (1797 images, no download), scaled to [0, 1]."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        pixels, labels = digits()
        self.images = (pixels / 16.0).astype(np.float32)[..., None]
        self.labels = (labels >= 5).astype(np.int64) if spec.dataset.num_classes == 2 else labels
        self.flat = len(self.shape) == 1  # a vector input: square images, flattened
        if self.flat:
            side = math.isqrt(self.shape[0])
            if side * side != self.shape[0]:
                raise HarnessError(f"{spec.name}: digits as vectors needs a square size, got {self.shape[0]}")
            self.shape = (side, side, 1)

    def samples(self, indices):
        h, w, c = self.shape
        out = _fit_channels(_resize(self.images[indices], h, w), c)
        return out.reshape(len(indices), -1) if self.flat else out


DIGITS_FILE = Path(__file__).resolve().parent / "datasets" / "digits.csv.gz"


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn's `load_digits()` gives them ([1797, 8, 8] pixel values 0-16, and their labels),
    from its file, shipped here (datasets/README.md): scikit-learn is no dependency, since where it is installed
    `import keras` imports it too, a second more in each of the many TensorFlow processes a matrix starts."""
    with gzip.open(DIGITS_FILE, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


class ImageFolder(Source):
    """A directory with one sub-folder of images per class, as Keras' flow_from_directory reads it."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        try:
            self.files, labels = image_folder_files(spec)
        except HarnessError as exc:
            raise HarnessError(f"{spec.name}: {exc}") from None
        self.labels = np.array(labels, np.int64)

    def samples(self, indices):
        from PIL import Image, UnidentifiedImageError

        h, w, c = self.shape
        out = np.empty((len(indices), h, w, c), np.float32)
        for row, i in enumerate(indices):
            try:
                with Image.open(self.files[i]) as img:
                    img = img.convert("L" if c == 1 else "RGB").resize((w, h), Image.BILINEAR)
                    arr = np.asarray(img, np.float32) / 255.0
            except (OSError, UnidentifiedImageError) as exc:
                raise HarnessError(f"{self.files[i]}: unreadable image: {exc}") from None
            out[row] = _fit_channels(arr.reshape(h, w, -1), c)
        return out


class SyntheticTokens(Source):
    """A learnable token task, drawn once from the spec's seed ([size, T] ids in [0, vocab)).

    next_token: each token after the second is, with probability SIGNAL, a fixed function of the two before it
    (successor[(a + b) mod vocab], a random permutation), else uniform: predicting it needs the previous position
    as well as the current one, which is what attention gives, and the best loss is well below ln(vocab).
    classification: each class has SIGNATURE tokens of its own; each position is, with probability SIGNAL / 2,
    one of its class's, else uniform: a mean over positions finds the class.
    """

    SIGNAL = 0.8
    SIGNATURE = 3

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        ds, vocab, (length,) = spec.dataset, spec.input.vocab, self.shape
        rng = np.random.default_rng([spec.seed, 6])
        uniform = rng.integers(0, vocab, (ds.size, length + 1))
        if ds.next_token:
            successor = rng.permutation(vocab)
            signal = rng.random((ds.size, length + 1)) < self.SIGNAL
            tokens = uniform
            for t in range(2, length + 1):
                tokens[:, t] = np.where(signal[:, t], successor[(tokens[:, t - 2] + tokens[:, t - 1]) % vocab],
                                        tokens[:, t])
            self.tokens, self.labels = tokens[:, :-1], tokens[:, 1:]
        else:
            self.labels = rng.integers(0, ds.num_classes, ds.size).astype(np.int64)
            signatures = rng.integers(0, vocab, (ds.num_classes, self.SIGNATURE))
            pick = signatures[self.labels[:, None], rng.integers(0, self.SIGNATURE, (ds.size, length))]
            self.tokens = np.where(rng.random((ds.size, length)) < self.SIGNAL / 2, pick, uniform[:, :-1])
        self.tokens = np.ascontiguousarray(self.tokens, np.int64)
        self.labels = np.ascontiguousarray(self.labels, np.int64)

    def samples(self, indices):
        return self.tokens[indices]


MAX_CORPUS_BYTES = 256 * 2**20  # read whole into memory: a corpus larger than this is not a benchmark's
MAX_CORPUS_FILES = 100_000  # a path of "/" must not walk the whole file system


def corpus_files(path: str | None) -> list[Path]:
    """The files of a text dataset, sorted: `path` a file, a directory (its files, recursively) or a glob; without
    it the top-level .py files of this Python's standard library (no download: every Python has them)."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in root.glob("*.py") if p.is_file())
    where = f"dataset.path '{clip(path)}'"
    if any(c in path for c in "*?["):
        names = glob.iglob(str(Path(path).expanduser()), recursive=True)
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise HarnessError(f"{where} does not exist")
        names = [str(root)] if root.is_file() else (str(p) for p in root.rglob("*"))
    files = []
    try:
        for name in names:
            if Path(name).is_file():
                files.append(Path(name))
                if len(files) > MAX_CORPUS_FILES:
                    raise HarnessError(f"{where}: more than {MAX_CORPUS_FILES} files: name a smaller corpus")
    except OSError as exc:
        raise HarnessError(f"{where}: cannot list: {exc.strerror}") from None
    if not files:
        raise HarnessError(f"{where}: no files match")
    return sorted(files)


def read_corpus(path: str | None) -> bytes:
    """The bytes of a text dataset's files, concatenated in sorted order (a HarnessError naming the problem)."""
    files = corpus_files(path)
    sizes = []
    for f in files:
        try:
            sizes.append(f.stat().st_size)
        except OSError as exc:
            raise HarnessError(f"dataset.path: {clip(f)}: {exc.strerror}") from None
    if sum(sizes) > MAX_CORPUS_BYTES:
        raise HarnessError(f"dataset.path: the corpus has {sum(sizes) / 2**20:.0f} MiB in {len(files)} files, more "
                           f"than the {MAX_CORPUS_BYTES // 2**20} MiB a text dataset may read")
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError as exc:
            raise HarnessError(f"dataset.path: {clip(f)}: unreadable: {exc.strerror}") from None
    return b"".join(chunks)


def corpus_hash(corpus: bytes) -> str:
    return hashlib.sha256(corpus).hexdigest()[:16]


def text_windows(corpus_bytes: int, length: int, size: int) -> np.ndarray:
    """The start offsets of a text dataset's windows of length+1 bytes: at most `size` of them, spread evenly over
    the corpus and never overlapping."""
    count = min(size, (corpus_bytes - 1) // length)
    if count < 1:
        return np.zeros(0, np.int64)
    return np.linspace(0, corpus_bytes - length - 1, count).round().astype(np.int64)


class Text(Source):
    """Next-byte prediction on text files (vocab 256): window i is bytes [s_i, s_i + T] of the corpus, its input the
    first T, its labels the last T. The split is by position, the last windows evaluating, so that evaluation
    text is never a training window's neighbour."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        corpus = read_corpus(spec.dataset.path)
        self.hash = corpus_hash(corpus)
        if spec.dataset.corpus_hash and spec.dataset.corpus_hash != self.hash:
            raise HarnessError(f"{spec.name}: dataset.path: the corpus's hash is {self.hash}, the spec was resolved "
                               f"on a corpus of hash {spec.dataset.corpus_hash}: its files changed")
        (length,) = self.shape
        data = np.frombuffer(corpus, np.uint8)
        starts = text_windows(len(data), length, spec.dataset.size)
        windows = data[starts[:, None] + np.arange(length + 1)].astype(np.int64)
        self.tokens, self.labels = windows[:, :-1], np.ascontiguousarray(windows[:, 1:])

    def samples(self, indices):
        return self.tokens[indices]

    def split(self, n_eval):
        n = len(self.labels)
        return np.arange(n - n_eval, n), np.arange(n - n_eval)


SOURCES = {"synthetic": Synthetic, "digits": Digits, "image_folder": ImageFolder, "text": Text,
           "synthetic_tokens": SyntheticTokens}
DIGITS_SAMPLES = 1797
MAX_IMAGE_PIXELS = 2**26  # a 64-megapixel file is not a training sample; PIL itself refuses 179M as a "bomb"


def image_folder_files(spec: ModelSpec) -> tuple[list[Path], list[int]]:
    """The image files of an image_folder dataset and their class ids (class folders in sorted order)."""
    root = Path(spec.dataset.path).expanduser()
    where = f"dataset.path '{root}'"
    if not root.exists():
        raise HarnessError(f"{where} does not exist")
    if not root.is_dir():
        raise HarnessError(f"{where} is a file, not a directory of class folders")
    try:
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        if len(classes) != spec.dataset.num_classes:
            raise HarnessError(f"{where}: found {len(classes)} class folders {classes[:10]}, the spec says "
                               f"num_classes {spec.dataset.num_classes}")
        files, labels = [], []
        for label, name in enumerate(classes):
            found = sorted(f for f in (root / name).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
            if not found:
                raise HarnessError(f"{where}: class folder '{name}' has no images "
                                   f"({', '.join(sorted(IMAGE_SUFFIXES))})")
            files += found
            labels += [label] * len(found)
    except OSError as exc:
        raise HarnessError(f"{where}: cannot list: {exc.strerror}") from None
    return files, labels


def sample_count(spec: ModelSpec) -> int:
    name = spec.dataset.name
    if name in ("synthetic", "synthetic_tokens"):
        return spec.dataset.size
    if name == "text":
        return len(text_windows(_corpus_size(spec), spec.input.shape[0], spec.dataset.size))
    if name == "digits":
        return DIGITS_SAMPLES
    return len(image_folder_files(spec)[0])


def split_sizes(n: int, eval_fraction: float) -> tuple[int, int]:
    """(evaluation, training) sample counts: the evaluation split gets at least one sample."""
    n_eval = max(1, round(n * eval_fraction))
    return n_eval, n - n_eval


def check(spec: ModelSpec, source: str) -> None:
    """Every data error that is certain before a framework starts (split sizes against the batch, image
    folders, input shapes a dataset cannot produce), as one HarnessError naming `source` (the spec file) and
    the place; reads image headers, not pixels."""
    shape = spec.sample_shape
    if spec.dataset.name == "digits" and len(shape) == 1 and math.isqrt(shape[0]) ** 2 != shape[0]:
        raise HarnessError(f"{source}: input.shape: digits as vectors needs a square input size (64 = 8x8), "
                           f"got {shape[0]}")
    if spec.dataset.name == "image_folder":
        if len(shape) != 3 or shape[2] not in (1, 3):
            raise HarnessError(f"{source}: input.shape: image_folder needs an image input [H, W, 1] or "
                               f"[H, W, 3], got {list(shape)}")
        try:
            _check_images(Path(spec.dataset.path).expanduser(), image_folder_files(spec)[0])
        except HarnessError as exc:
            raise HarnessError(f"{source}: {exc}") from None
    if spec.dataset.name == "text":
        size, length = _corpus_size(spec), shape[0]
        if size == 0:
            raise HarnessError(f"{source}: dataset.path: the corpus is empty")
        if size < length + 1:
            raise HarnessError(f"{source}: input.shape: a window of {length} tokens needs {length + 1} bytes, the "
                               f"corpus has {size}")
    n = sample_count(spec)
    n_eval, n_train = split_sizes(n, spec.dataset.eval_fraction)
    if n_train < spec.batch_size:
        raise HarnessError(f"{source}: batch_size {spec.batch_size} exceeds the {n_train} training samples "
                           f"({n} samples, {n_eval} of them for evaluation)")


def _corpus_size(spec: ModelSpec) -> int:
    try:
        return sum(f.stat().st_size for f in corpus_files(spec.dataset.path))
    except HarnessError as exc:
        raise HarnessError(f"{spec.name}: {exc}") from None
    except OSError as exc:
        raise HarnessError(f"{spec.name}: dataset.path: {exc.strerror}") from None


def _check_images(root: Path, files: list[Path]) -> None:
    from PIL import Image, UnidentifiedImageError

    sizes: dict[tuple[int, int], Path] = {}
    for path in files:
        where = f"dataset.path: {path.relative_to(root)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(path) as img:
                    size = img.size
                    if size[0] * size[1] > MAX_IMAGE_PIXELS:
                        raise HarnessError(f"{where}: {size[0]}x{size[1]} pixels: too large for a training sample")
                    img.verify()  # the file's structure and checksums, without decoding the pixels
        except UnidentifiedImageError:
            raise HarnessError(f"{where}: unreadable image: not an image format PIL knows") from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError,
                Image.DecompressionBombWarning) as exc:
            raise HarnessError(f"{where}: unreadable image: {clip(exc, 120)}") from None
        sizes.setdefault(size, path)
        if len(sizes) > 1:
            (a, first), (b, second) = list(sizes.items())[:2]
            raise HarnessError(f"{where}: {b[0]}x{b[1]} pixels, but {first.relative_to(root)} is {a[0]}x{a[1]}: the "
                               f"images of a dataset must share one size (resize them first)")


class Data:
    """Train/eval split and batch order for one spec."""

    def __init__(self, spec: ModelSpec, order_seed: int | None = None):
        self.spec = spec
        self.order_seed = spec.seed if order_seed is None else order_seed  # the shuffles'; samples keep spec.seed
        self.source = SOURCES[spec.dataset.name](spec)
        n = len(self.source.labels)
        self.eval_idx, self.train_idx = self.source.split(split_sizes(n, spec.dataset.eval_fraction)[0])
        if len(self.train_idx) < spec.batch_size:  # check() says so before any worker starts
            raise HarnessError(f"{spec.name}: batch_size {spec.batch_size} exceeds the "
                               f"{len(self.train_idx)} training samples")
        self.batches_per_epoch = len(self.train_idx) // spec.batch_size  # the last partial batch is dropped
        self._cache: dict[int, np.ndarray] = {}
        if sample_bytes(spec) * math.prod(spec.input.shape) * n <= CACHE_LIMIT_BYTES:
            self._all = self.source.samples(np.arange(n))
        else:
            self._all = None

    def _samples(self, indices: np.ndarray) -> np.ndarray:
        return self._all[indices] if self._all is not None else self.source.samples(indices)

    def train_indices(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.batches_per_epoch)
        perm = np.random.default_rng([self.order_seed, 4, epoch]).permutation(self.train_idx)
        return perm[k * self.spec.batch_size:(k + 1) * self.spec.batch_size]

    def train_batch(self, step: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The batch of a training step; written into `out` (a batch of an earlier call) when given, so that a
        training loop allocates no new batch."""
        idx = self.train_indices(step)
        if out is None:
            return self._samples(idx), self.source.labels[idx]
        x, y = out
        if self._all is not None:
            np.take(self._all, idx, axis=0, out=x)
        else:
            x[...] = self.source.samples(idx)
        np.take(self.source.labels, idx, axis=0, out=y)
        return x, y

    def eval_batches(self):
        bs = self.spec.batch_size
        for start in range(0, len(self.eval_idx), bs):
            idx = self.eval_idx[start:start + bs]
            yield self._samples(idx), self.source.labels[idx]

    def fixed_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The first eval batch: a fixed input for comparing logits across frameworks."""
        return next(self.eval_batches())
