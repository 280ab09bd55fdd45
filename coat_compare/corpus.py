"""Training text that needs no download: byte corpora built from what the machine already has.

Tokens are bytes (a 256-symbol vocabulary, or fewer: bytes at or above ``vocab_size`` map to
``vocab_size - 1``). Two corpora, each a sequence of documents (one per source file) in a fixed
order, so every machine with the same Python and packages builds the same bytes:

- ``docstrings``: the docstrings of the interpreter's standard library (module, class and
  function documentation: English prose), about 1.4 MB. The tiny CPU presets and demos.
- ``packages``: whole Python source files (code, comments and docstrings) of the standard library
  and of every installed distribution (sorted by name; the files of each sorted by path), taken
  until the byte budget is reached (100 MiB for the accuracy runs: a 113M model cannot memorise it
  in the 33 MB one run reads). Test directories are left out: the standard library's hold
  deliberately malformed and generated sources, and test suites repeat one fixture in many files.

Documents are taken whole, exact duplicates (vendored copies of one file) once. Each goes whole to
the validation split when the SHA-256 of its key (``python/json/decoder.py``,
``numpy/numpy/linalg/_linalg.py``) falls in the lowest ``VALID_FRACTION``, otherwise to the
training split: the split is by file, never by byte offset, so no text of a validation file is
trained on, and a file keeps its split on any machine. ``load_corpus`` builds a corpus once into a
cache directory (``$COAT_CORPUS_DIR``, else ``~/.cache/coat-megatron/corpus``) with a manifest
(every file and its split, the packages' versions, the SHA-256 of each split) and reads it back.

``TrainingWindows`` serves training batches that never repeat a byte; ``validation_windows`` the
fixed held-out windows every mode and seed is evaluated on; ``training_windows`` and
``validation_set`` are both at a preset's sequence, global batch and corpus.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import site
import sysconfig
from dataclasses import dataclass

import torch

VALID_FRACTION = 0.02  # of the files (by the hash of their key), not of the bytes
FORMAT = 1  # of the cache; bump when what a corpus holds for the same files changes
VALIDATION_SEED = 0  # which validation windows are evaluated: one set for every mode, seed and data order
POOL_SEED = 0  # which training windows a data pool holds: one pool for every data order (TrainingWindows)
PROJECT = "coat-megatron"  # its own sources are no training text
STDLIB_KEY = "python"
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# the docstring corpus keeps the directories it always read (idlelib's docstrings are GUI notes)
DOCSTRING_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
SOURCE_SKIPPED_DIRS = TEST_DIRS | {"site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------- the sources


@dataclass(frozen=True)
class SourceFile:
    """One candidate document: ``key`` names it on every machine ("python/json/decoder.py",
    "numpy/numpy/linalg/_linalg.py"), ``path`` is where it is here, ``size`` its bytes on disk."""

    key: str
    path: str
    size: int


def stdlib_files(skipped_dirs=SOURCE_SKIPPED_DIRS) -> list[SourceFile]:
    """The ``.py`` files of the interpreter's standard library, directories and files sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skipped_dirs)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root).replace(os.sep, "/")
            found.append(SourceFile(f"{STDLIB_KEY}/{relative}", path, os.path.getsize(path)))
    return found


def canonical_name(name: str) -> str:
    """A distribution's name as pip compares them: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> dict[str, importlib.metadata.Distribution]:
    """The distributions installed in this interpreter's site-packages (not the working directory
    or $PYTHONPATH, which change with where a command runs), by canonical name, the first found
    where one is installed twice; the project itself left out."""
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths = list(dict.fromkeys(os.path.realpath(p) for p in paths if os.path.isdir(p)))
    found = {}
    for dist in importlib.metadata.distributions(path=paths):
        name = canonical_name(dist.metadata["Name"] or "")
        if name and name != PROJECT and name not in found:
            found[name] = dist
    return found


def package_files() -> tuple[list[SourceFile], dict[str, str]]:
    """The standard library's ``.py`` files, then every installed distribution's (sorted by
    canonical name, files by path; test directories left out), and {name: version} of them all."""
    files = stdlib_files()
    versions = {STDLIB_KEY: platform.python_version()}
    for name, dist in sorted(installed_distributions().items()):
        versions[name] = dist.version
        for relative in sorted(dist.files or [], key=str):
            parts = relative.parts
            if not str(relative).endswith(".py") or ".." in parts or SOURCE_SKIPPED_DIRS.intersection(parts[:-1]):
                continue
            path = str(dist.locate_file(relative))
            try:
                size = os.path.getsize(path)
            except OSError:  # listed in RECORD, not on disk
                continue
            files.append(SourceFile(f"{name}/{relative}", path, size))
    return files, versions


def read_source(path: str) -> bytes | None:
    """A source file's bytes, ending in a newline; None when it is empty or not UTF-8 text."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not data.strip():
        return None
    return data if data.endswith(b"\n") else data + b"\n"


def file_docstrings(path: str) -> bytes | None:
    """The docstrings (longer than 80 characters) of a module, its classes and functions, each
    followed by a blank line; None when it has none or does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                parts.append(doc.encode("utf-8") + b"\n\n")
    return b"".join(parts) or None


def stdlib_docstrings(max_bytes: int = 4 << 20) -> bytes:
    """Docstrings of the standard library, up to ``max_bytes``, separated by blank lines (one
    stream, no split: the demos and tests that draw their own windows)."""
    parts, total = [], 0
    for source in stdlib_files(DOCSTRING_SKIPPED_DIRS):
        text = file_docstrings(source.path)
        if text:
            parts.append(text)
            total += len(text)
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)


def _docstring_sources():
    return stdlib_files(DOCSTRING_SKIPPED_DIRS), {STDLIB_KEY: platform.python_version()}


# name: (what it is, its candidate files and versions, how a file becomes a document, what to do when it is too small)
SOURCES = {
    "docstrings": (
        "the standard library's docstrings",
        _docstring_sources,
        file_docstrings,
        "use --corpus-bytes {available} or less, or --corpus packages",
    ),
    "packages": (
        "Python sources of the standard library and the installed distributions",
        package_files,
        read_source,
        "install more Python packages (e.g. pip install sympy networkx scipy pandas transformers) or use --corpus-bytes {available}",
    ),
}
# each corpus's size when none is asked for (None: every file the source has)
DEFAULT_MAX_BYTES = {"docstrings": None, "packages": 100 << 20}


# --------------------------------------------------------------------------- building and loading


def is_validation_file(key: str) -> bool:
    """Whether the document ``key`` belongs to the validation split: the first 8 bytes of the
    SHA-256 of its key, as a fraction of 2^64, below VALID_FRACTION."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < VALID_FRACTION * 2**64


def collect_documents(
    files: list[SourceFile], read, max_bytes: int | None
) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """Documents ``(key, bytes)`` read from ``files`` in order until they hold ``max_bytes`` (all
    of them for None), exact duplicates once; and how many files were left out, and why."""
    documents, seen, total = [], set(), 0
    skipped = {"duplicate": 0, "empty_or_not_utf8": 0}
    for source in files:
        if max_bytes is not None and total >= max_bytes:
            break
        text = read(source.path)
        if not text:
            skipped["empty_or_not_utf8"] += 1
            continue
        digest = hashlib.sha256(text).digest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        documents.append((source.key, text))
        total += len(text)
    return documents, skipped


@dataclass(frozen=True)
class Corpus:
    """A built corpus: ``train`` and ``valid``, uint8 tensors of shape (bytes,), and the manifest
    (``manifest["train"]["sha256"]``, the files, the package versions: see ``load_corpus``)."""

    name: str
    train: torch.Tensor
    valid: torch.Tensor
    manifest: dict

    def identity(self) -> dict:
        """What a report row records of the data: the corpus, each split's bytes and SHA-256."""
        m = self.manifest
        return {
            "corpus": self.name,
            "corpus_files": m["train"]["files"] + m["valid"]["files"],
            **{f"corpus_{split}_{k}": m[split][k] for split in ("train", "valid") for k in ("bytes", "sha256")},
        }


def default_cache_dir() -> str:
    if os.environ.get("COAT_CORPUS_DIR"):
        return os.environ["COAT_CORPUS_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "coat-megatron", "corpus")


def load_corpus(name: str, max_bytes: int | None = None, cache_dir: str | None = None) -> Corpus:
    """The corpus ``name`` ("docstrings" or "packages"): whole documents in order until they hold
    ``max_bytes`` (every document the source has for None), split by file.

    Built once into ``{cache_dir}/{name}-{fingerprint}/`` (train.bin, valid.bin, manifest.json);
    the fingerprint covers every candidate file's key and size, the budget, the Python version
    and ``FORMAT``, so an installed or upgraded package makes a new build. Each split is checked
    against its SHA-256 when read. Raises ValueError, naming what to do, when the source holds
    fewer than ``max_bytes``."""
    if name not in SOURCES:
        raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(SOURCES)}")
    what, list_files, read, too_small = SOURCES[name]
    files, versions = list_files()
    fingerprint = hashlib.sha256(
        json.dumps(
            [FORMAT, name, max_bytes, VALID_FRACTION, platform.python_version(), [(f.key, f.size) for f in files]]
        ).encode()
    ).hexdigest()
    directory = os.path.join(
        cache_dir or default_cache_dir(), f"{name}-{'all' if max_bytes is None else max_bytes}-{fingerprint[:16]}"
    )
    if not os.path.exists(os.path.join(directory, "manifest.json")):
        _build(directory, name, what, files, versions, read, max_bytes, too_small, fingerprint)
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    splits = {split: _read_split(directory, split, manifest[split]) for split in ("train", "valid")}
    return Corpus(name, splits["train"], splits["valid"], manifest)


def _build(directory, name, what, files, versions, read, max_bytes, too_small, fingerprint) -> None:
    documents, skipped = collect_documents(files, read, max_bytes)
    total = sum(len(text) for _, text in documents)
    if max_bytes is not None and total < max_bytes:
        raise ValueError(
            f"the {name} corpus ({what}) needs {max_bytes:,} bytes; this machine has {total:,}: "
            + too_small.format(available=total)
        )
    splits = {"train": [], "valid": []}
    for key, text in documents:
        splits["valid" if is_validation_file(key) else "train"].append((key, text))
    used = {key.split("/", 1)[0] for key, _ in documents}
    manifest = {
        "format": FORMAT,
        "corpus": name,
        "source": what,
        "max_bytes": max_bytes,
        "valid_fraction": VALID_FRACTION,
        "split_rule": "a file is in valid iff int(sha256(key)[:8 bytes]) < valid_fraction * 2**64",
        "python": platform.python_version(),
        "fingerprint": fingerprint,
        "packages": {k: v for k, v in versions.items() if k in used},
        "skipped_files": skipped,
        "files": [[key, len(text), split] for split, docs in splits.items() for key, text in docs],
    }
    # a private directory renamed into place: processes building at once (torchrun ranks) cannot
    # read each other's half-written files, and the first rename wins
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    scratch = f"{directory}.building-{os.getpid()}"
    os.makedirs(scratch, exist_ok=True)
    try:
        for split, docs in splits.items():
            data = b"".join(text for _, text in docs)
            if not data:
                raise ValueError(
                    f"the {name} corpus has no {split} file out of {len(documents)}: give it a larger --corpus-bytes"
                )
            with open(os.path.join(scratch, f"{split}.bin"), "wb") as f:
                f.write(data)
            manifest[split] = {"bytes": len(data), "files": len(docs), "sha256": hashlib.sha256(data).hexdigest()}
        with open(os.path.join(scratch, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        try:
            os.rename(scratch, directory)
        except OSError:
            if not os.path.exists(os.path.join(directory, "manifest.json")):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read_split(directory: str, split: str, expected: dict) -> torch.Tensor:
    path = os.path.join(directory, f"{split}.bin")
    data = bytearray(os.path.getsize(path))
    with open(path, "rb") as f:
        f.readinto(data)
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise ValueError(
            f"{path} does not match the SHA-256 in its manifest: delete {directory} and run again to rebuild it"
        )
    return torch.frombuffer(data, dtype=torch.uint8)


# --------------------------------------------------------------------------- batches


def _as_tokens(windows: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """{tokens, labels (the next bytes), position_ids}, int64 of shape (rows, seq_length), from
    uint8 windows of shape (rows, seq_length + 1)."""
    tokens = windows.long().clamp_(max=vocab_size - 1)
    rows, seq_length = tokens.shape[0], tokens.shape[1] - 1
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_length).expand(rows, -1).contiguous(),
    }


class TrainingWindows:
    """Training batches that never repeat a byte.

    ``data`` (uint8, (bytes,)) is cut into non-overlapping windows of ``seq_length + 1`` bytes;
    a generator seeded by ``seed`` (the data order) permutes them once; batch ``i`` holds windows
    ``i * batch_size`` .. ``(i + 1) * batch_size - 1`` of that order, as int64 tokens and labels
    of shape (batch_size, seq_length). There are ``len(self)`` batches; asking for more raises
    (use ``check_steps`` before training): a run never wraps around to text it has seen.

    ``pool``: draw from a fixed set of this many windows (picked by a generator seeded with
    ``POOL_SEED``, the same for every ``seed``) instead of the whole split, so that two data orders
    train on the same text in another order, not on other text; a run then has at most
    ``pool // batch_size`` batches.
    """

    def __init__(
        self,
        data: torch.Tensor,
        seq_length: int,
        batch_size: int,
        *,
        seed: int,
        vocab_size: int = 256,
        pool: int | None = None,
    ):
        count = len(data) // (seq_length + 1)
        self.windows = data[: count * (seq_length + 1)].view(count, seq_length + 1)
        if pool is None:
            self.order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        else:
            if not 0 < pool <= count:
                raise ValueError(
                    f"a data pool of {pool:,} windows of {seq_length + 1} bytes: the train split holds {count:,}; "
                    "give a pool between 1 and that (the preset's data_pool), or a bigger corpus (--corpus-bytes)"
                )
            chosen = torch.randperm(count, generator=torch.Generator().manual_seed(POOL_SEED))[:pool]
            self.order = chosen[torch.randperm(pool, generator=torch.Generator().manual_seed(seed))]
        self.pool = pool
        self.seq_length, self.batch_size, self.vocab_size = seq_length, batch_size, vocab_size

    def __len__(self) -> int:
        return len(self.order) // self.batch_size

    def check_steps(self, steps: int) -> None:
        """Raise, naming the fix, when ``steps`` batches need more windows than there are."""
        if steps > len(self):
            need, have = steps * self.batch_size, len(self.order)
            width = self.seq_length + 1
            where = "the corpus's train split" if self.pool is None else "the preset's data pool"
            raise ValueError(
                f"{steps} steps of {self.batch_size} sequences need {need:,} windows of {width} bytes "
                f"({need * width / 1e6:.1f} MB) of training text, and {where} holds {have:,} "
                f"({have * width / 1e6:.1f} MB), each to be seen at most once: use --steps {len(self)} or fewer, "
                + (
                    "or a bigger corpus (--corpus packages, --corpus-bytes)"
                    if self.pool is None
                    else f"or a preset whose data_pool (here {self.pool:,} windows) holds them"
                )
            )

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            self.check_steps(index + 1)
        chosen = self.order[index * self.batch_size : (index + 1) * self.batch_size]
        return _as_tokens(self.windows[chosen], self.vocab_size)


def validation_windows(data: torch.Tensor, seq_length: int, count: int) -> torch.Tensor:
    """``count`` non-overlapping windows of ``seq_length + 1`` bytes of the validation split
    ``data`` (uint8), shape (count, seq_length + 1), picked by a generator with the fixed
    ``VALIDATION_SEED``: the same for every mode, seed and data order of one corpus and length."""
    available = len(data) // (seq_length + 1)
    if count > available:
        raise ValueError(
            f"{count} validation windows of {seq_length + 1} bytes asked for, and the validation split ({len(data):,} bytes) "
            f"holds {available}: use --eval-windows {available} or fewer, or a bigger corpus (--corpus-bytes)"
        )
    windows = data[: available * (seq_length + 1)].view(available, seq_length + 1)
    chosen = torch.randperm(available, generator=torch.Generator().manual_seed(VALIDATION_SEED))[:count]
    return windows[chosen.sort().values]


def validation_batches(windows: torch.Tensor, batch_size: int, vocab_size: int = 256) -> list[dict[str, torch.Tensor]]:
    """``windows`` (uint8, (count, seq_length + 1); count a multiple of ``batch_size``) as batches
    of ``batch_size`` rows: {tokens, labels, position_ids}, int64 (batch_size, seq_length)."""
    if len(windows) % batch_size:
        raise ValueError(f"{len(windows)} validation windows do not split into batches of {batch_size}")
    return [_as_tokens(windows[i : i + batch_size], vocab_size) for i in range(0, len(windows), batch_size)]


def training_windows(preset, data_seed: int, dp: int = 1, corpus: Corpus | None = None) -> TrainingWindows:
    """The training batches of ``preset``'s corpus (or of its ``data_pool``) in the order of
    ``data_seed``: the global batch (``preset.global_batch_for(dp)`` windows) per step, checked to
    last ``preset.steps`` steps without repeating a byte."""
    if corpus is None:
        corpus = load_corpus(preset.corpus, preset.corpus_max_bytes)
    data = TrainingWindows(
        corpus.train,
        preset.seq,
        preset.global_batch_for(dp),
        seed=data_seed,
        vocab_size=preset.vocab,
        pool=preset.data_pool,
    )
    data.check_steps(preset.steps)
    return data


def validation_set(preset, corpus: Corpus, dp: int = 1) -> tuple[list[dict], str]:
    """The validation batches (global batches of micro-batch x ``dp`` windows: ``preset.eval_windows``
    rounded up to a multiple) and the SHA-256 of their bytes, which names them in the report."""
    global_batch = preset.micro_batch * dp
    count = -(-preset.eval_windows // global_batch) * global_batch
    windows = validation_windows(corpus.valid, preset.seq, count)
    digest = hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest()
    return validation_batches(windows, global_batch, preset.vocab), digest


class ByteBatches:
    """Random windows of a byte corpus as next-token-prediction batches (windows may repeat and
    overlap: the demos and tests that train for a few steps on ``stdlib_docstrings``; the
    comparison jobs use ``TrainingWindows``).

    Holds out the last ``holdout`` fraction of the bytes for validation. ``batch(generator)``
    returns tokens and labels (the next bytes) of shape (batch_size, seq_length), int64.
    """

    def __init__(self, data: bytes, seq_length: int, batch_size: int, vocab_size: int = 256, holdout: float = 0.05):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().clamp_(max=vocab_size - 1)
        split = int(len(tokens) * (1 - holdout))
        self.train, self.valid = tokens[:split], tokens[split:]
        self.seq_length, self.batch_size, self.vocab_size = seq_length, batch_size, vocab_size

    def batch(self, generator: torch.Generator, split: str = "train") -> dict[str, torch.Tensor]:
        data = self.train if split == "train" else self.valid
        starts = torch.randint(0, len(data) - self.seq_length - 1, (self.batch_size,), generator=generator)
        return _as_tokens(torch.stack([data[s : s + self.seq_length + 1] for s in starts.tolist()]), self.vocab_size)


class ByteWindows(torch.utils.data.Dataset):
    """Next-byte-prediction samples from a byte corpus, in the form of Megatron's ``GPTDataset``.

    Sample ``i`` is the window of ``seq_length + 1`` bytes at a start drawn from a generator seeded
    by ``seed`` (all starts are drawn up front), as a dict of ``tokens`` and ``labels`` (the next
    bytes), int64 of shape (seq_length,), ``loss_mask`` (FP32 ones) and ``position_ids``. Every rank
    and every run with the same arguments sees the same samples, which is what Megatron's samplers
    expect of a dataset (they pick indices per data-parallel rank).
    """

    def __init__(self, data: bytes, seq_length: int, num_samples: int, *, seed: int = 0, vocab_size: int = 256):
        if len(data) <= seq_length + 1:
            raise ValueError(f"a corpus of {len(data)} bytes has no window of seq_length + 1 = {seq_length + 1} bytes")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().clamp_(max=vocab_size - 1)
        self.seq_length = seq_length
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.tokens) - seq_length - 1, (num_samples,), generator=g)
        self.position_ids = torch.arange(seq_length)
        self.loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[i])
        window = self.tokens[start : start + self.seq_length + 1]
        return {
            "tokens": window[:-1].clone(),
            "labels": window[1:].clone(),
            "loss_mask": self.loss_mask.clone(),
            "position_ids": self.position_ids.clone(),
        }
