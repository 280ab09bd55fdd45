"""The byte corpora (``coat_compare.corpus``): deterministic builds recorded by SHA-256, a split by
file with no file in both splits, training windows that never repeat, fixed validation windows."""

import hashlib
import json
import os

import pytest
import torch

from coat_compare import corpus
from coat_compare.corpus import (
    SourceFile,
    TrainingWindows,
    collect_documents,
    is_validation_file,
    load_corpus,
    read_source,
    validation_batches,
    validation_windows,
)

BUDGET = 2_000_000  # a few MB: the accuracy runs use 100 MiB; a CPU test builds what it needs in about a second


@pytest.fixture(scope="session")  # xdist may run other modules between its group's tests
def built(tmp_path_factory):
    """The packages corpus built twice, into two cache directories."""
    first, second = tmp_path_factory.mktemp("cache1"), tmp_path_factory.mktemp("cache2")
    return (
        load_corpus("packages", BUDGET, cache_dir=str(first)),
        load_corpus("packages", BUDGET, cache_dir=str(second)),
        first,
    )


def test_a_build_is_deterministic_and_recorded_by_its_sha256(built):
    a, b, _ = built
    for split in ("train", "valid"):
        assert torch.equal(getattr(a, split), getattr(b, split))
        data = getattr(a, split).numpy().tobytes()
        assert a.manifest[split]["sha256"] == b.manifest[split]["sha256"] == hashlib.sha256(data).hexdigest()
        assert a.manifest[split]["bytes"] == len(data)
    assert len(a.train) + len(a.valid) >= BUDGET  # whole files until the budget is reached
    assert a.identity() == b.identity() and a.identity()["corpus_train_sha256"] == a.manifest["train"]["sha256"]
    assert a.manifest["packages"]["python"]  # the interpreter's version: the standard library comes first
    assert all(key.startswith("python/") for key, _, _ in a.manifest["files"][:10])


def test_a_second_load_reads_the_cache(built):
    _, _, cache = built
    (directory,) = os.listdir(cache)
    built_at = os.path.getmtime(cache / directory / "train.bin")
    again = load_corpus("packages", BUDGET, cache_dir=str(cache))
    assert os.listdir(cache) == [directory] and os.path.getmtime(cache / directory / "train.bin") == built_at
    assert again.identity() == built[0].identity()


def test_the_split_is_by_file_and_no_file_is_in_both(built):
    files = built[0].manifest["files"]
    keys = [key for key, _, _ in files]
    assert len(keys) == len(set(keys))  # each file once, in one split
    for key, _, split in files:
        assert split == ("valid" if is_validation_file(key) else "train")
    for split in ("train", "valid"):  # each split is its files' bytes, whole
        assert sum(size for _, size, s in files if s == split) == built[0].manifest[split]["bytes"]
    valid = sum(split == "valid" for _, _, split in files)
    assert 0 < valid < 0.1 * len(files)


def test_a_damaged_cache_is_refused(built):
    _, _, cache = built
    (directory,) = os.listdir(cache)
    path = cache / directory / "valid.bin"
    original = path.read_bytes()
    try:
        path.write_bytes(b"x" + original[1:])
        with pytest.raises(ValueError, match="does not match the SHA-256 in its manifest: delete"):
            load_corpus("packages", BUDGET, cache_dir=str(cache))
    finally:
        path.write_bytes(original)


def test_duplicates_and_files_that_are_not_text_are_left_out(tmp_path):
    texts = {"a.py": b"x = 1\n", "b.py": b"x = 1\n", "c.py": b"\xff\xfe not utf-8", "d.py": b"y = 2"}
    files = []
    for name, text in texts.items():
        (tmp_path / name).write_bytes(text)
        files.append(SourceFile(f"pkg/{name}", str(tmp_path / name), len(text)))
    documents, skipped = collect_documents(files, read_source, None)
    assert documents == [("pkg/a.py", b"x = 1\n"), ("pkg/d.py", b"y = 2\n")]  # a newline ends every document
    assert skipped == {"duplicate": 1, "empty_or_not_utf8": 1}
    documents, _ = collect_documents(files, read_source, 3)  # whole files until the budget is reached
    assert documents == [("pkg/a.py", b"x = 1\n")]


def test_a_machine_with_too_little_text_is_told_what_to_install(tmp_path, monkeypatch):
    what, _, read, too_small = corpus.SOURCES["packages"]
    few = corpus.stdlib_files()[:5]
    monkeypatch.setitem(corpus.SOURCES, "packages", (what, lambda: (few, {"python": "3"}), read, too_small))
    with pytest.raises(
        ValueError,
        match=r"needs 100,000,000 bytes; this machine has [\d,]+: install more Python packages \(e.g. pip install",
    ):
        load_corpus("packages", 100_000_000, cache_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing half-built is left


def test_training_windows_never_repeat_and_run_out_loudly():
    seq, batch = 16, 4
    data = torch.randint(0, 256, (50 * (seq + 1) + 7,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    windows = TrainingWindows(data, seq, batch, seed=3)
    assert len(windows) == 50 // batch  # 50 windows of 17 bytes: 12 batches; the 7-byte tail and 2 windows unused
    seen = []
    for i in range(len(windows)):
        b = windows.batch(i)
        assert b["tokens"].shape == b["labels"].shape == (batch, seq) and b["tokens"].dtype == torch.int64
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])  # labels: the next bytes
        seen.append(torch.cat([b["tokens"], b["labels"][:, -1:]], 1))
    seen = torch.cat(seen)
    cut = data[: 50 * (seq + 1)].view(50, seq + 1).long()
    assert len(torch.unique(seen, dim=0)) == len(seen) == 48  # no window twice
    assert all((cut == row).all(1).any() for row in seen)  # each one a window of the non-overlapping cut
    with pytest.raises(
        ValueError, match=r"13 steps of 4 sequences need 52 windows of 17 bytes .* use --steps 12 or fewer"
    ):
        windows.check_steps(13)
    with pytest.raises(ValueError, match="--steps 12 or fewer"):
        windows.batch(12)
    windows.check_steps(12)
    # the data seed orders the windows: the same seed the same batches, another seed others
    assert torch.equal(TrainingWindows(data, seq, batch, seed=3).batch(0)["tokens"], windows.batch(0)["tokens"])
    assert not torch.equal(TrainingWindows(data, seq, batch, seed=4).batch(0)["tokens"], windows.batch(0)["tokens"])


def test_a_data_pool_trains_the_same_windows_in_another_order_per_data_seed():
    seq, batch, pool = 16, 4, 20
    data = torch.randint(0, 256, (50 * (seq + 1),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    def windows_of(seed):
        w = TrainingWindows(data, seq, batch, seed=seed, pool=pool)
        assert len(w) == pool // batch == 5
        rows = [torch.cat([w.batch(i)["tokens"], w.batch(i)["labels"][:, -1:]], 1) for i in range(len(w))]
        return torch.cat(rows)

    a, b = windows_of(3), windows_of(4)
    assert len(torch.unique(a, dim=0)) == len(a) == pool  # each pooled window once
    assert not torch.equal(a, b)  # another order ...
    assert torch.equal(torch.unique(a, dim=0), torch.unique(b, dim=0))  # ... of the same windows
    assert torch.equal(windows_of(3), a)  # the same seed: the same batches
    whole = torch.unique(
        torch.cat([TrainingWindows(data, seq, batch, seed=s).batch(0)["tokens"] for s in (3, 4)]), dim=0
    )
    assert len(whole) == 2 * batch  # without a pool, two seeds start on other windows (here all distinct)
    with pytest.raises(ValueError, match=r"6 steps of 4 sequences need 24 windows .* the preset's data pool holds 20"):
        TrainingWindows(data, seq, batch, seed=3, pool=pool).check_steps(6)
    with pytest.raises(ValueError, match=r"a data pool of 51 windows of 17 bytes: the train split holds 50"):
        TrainingWindows(data, seq, batch, seed=3, pool=51)


def test_bytes_above_the_vocabulary_map_to_its_last_token():
    data = torch.tensor([10, 200, 255, 3, 7], dtype=torch.uint8)
    b = TrainingWindows(data, 4, 1, seed=0, vocab_size=128).batch(0)
    assert b["tokens"].tolist() == [[10, 127, 127, 3]] and b["labels"].tolist() == [[127, 127, 3, 7]]


def test_validation_windows_are_fixed_and_checked():
    data = torch.randint(0, 256, (40 * 9,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    chosen = validation_windows(data, 8, 12)
    assert chosen.shape == (12, 9) and torch.equal(chosen, validation_windows(data, 8, 12))
    assert len(torch.unique(chosen, dim=0)) == 12
    batches = validation_batches(chosen, 4)
    assert len(batches) == 3 and batches[0]["tokens"].shape == (4, 8)
    assert torch.equal(torch.cat([b["tokens"] for b in batches]), chosen[:, :-1].long())
    with pytest.raises(ValueError, match="use --eval-windows 40 or fewer"):
        validation_windows(data, 8, 41)
    with pytest.raises(ValueError, match="do not split into batches of 5"):
        validation_batches(chosen, 5)


def test_the_docstring_corpus_is_split_by_file_too(tmp_path):
    docs = load_corpus("docstrings", 200_000, cache_dir=str(tmp_path))
    files = docs.manifest["files"]
    assert docs.manifest["train"]["bytes"] + docs.manifest["valid"]["bytes"] >= 200_000
    assert all(split == ("valid" if is_validation_file(key) else "train") for key, _, split in files)
    text = docs.train.numpy().tobytes().decode("utf-8")
    assert "Return" in text or "return" in text  # English prose
    manifest = json.loads((tmp_path / os.listdir(tmp_path)[0] / "manifest.json").read_text())
    assert manifest["corpus"] == "docstrings" and manifest["valid"]["sha256"] == docs.identity()["corpus_valid_sha256"]
