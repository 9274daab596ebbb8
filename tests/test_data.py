"""Data pipeline: tokenizer, the bundled corpus, the text and hf loaders, shards and batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stages import Batches, DataError, load_corpus, val_batches
from stages.data import DOC_SEP, ByteTokenizer, build_stdlib_corpus, stdlib_files
from stages.manifest import DataConfig


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓ 🐍"
    ids = tok.encode(text)
    assert ids.dtype == torch.uint8 and ids.ndim == 1
    assert ids.numel() == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids.long().tolist()) == text
    # a window cut mid-character decodes with a replacement char instead of raising
    assert "\ufffd" in tok.decode(ids[:-1])
    assert tok.vocab_size == 256


def test_stdlib_corpus_build_is_deterministic_and_cached(tmp_path):
    cfg = DataConfig()
    a = load_corpus(cfg, tmp_path / "a")
    b = load_corpus(cfg, tmp_path / "b")
    assert a.train.dtype == torch.uint8 and a.train.ndim == 1
    assert a.train.numel() > 1_000_000 and a.val.numel() > 10_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    (cache,) = list((tmp_path / "a").iterdir())
    assert (cache / "train.u8").read_bytes() == (tmp_path / "b" / cache.name / "train.u8").read_bytes()
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]  # atomic writes leave no temp files
    # the second load comes from the cache: change the cached bytes and see them come back
    data = bytearray((cache / "train.u8").read_bytes())
    data[0] = ord("Q")
    (cache / "train.u8").write_bytes(bytes(data))
    assert load_corpus(cfg, tmp_path / "a").train[0].item() == ord("Q")
    # a truncated cache is detected and rebuilt
    (cache / "val.u8").write_bytes(b"short")
    assert torch.equal(load_corpus(cfg, tmp_path / "a").val, a.val)


def test_stdlib_corpus_excludes_tests_and_site_packages():
    names = [n for n, _ in stdlib_files()]
    assert names == sorted(names)
    assert "json/decoder.py" in names
    for n in names:
        parts = n.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), n
        assert not parts[-1].startswith("test_"), n


def test_stdlib_val_split_is_by_whole_files():
    train, val, meta = build_stdlib_corpus(0.05)
    assert meta["train_bytes"] == len(train) and meta["val_bytes"] == len(val)
    t_docs = set(train.split(DOC_SEP)) - {b""}
    v_docs = set(val.split(DOC_SEP)) - {b""}
    assert len(v_docs) >= 5
    assert not t_docs & v_docs


def test_text_file_and_folder(tmp_path):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document number {i}\n" * 20)
    (folder / "sub" / "nested.md").write_text("# nested file, read too\n" * 10)
    (folder / ".hidden").write_text("skip me")
    (folder / "image.bin").write_bytes(b"\x89PNG\x00\x00\x01")
    corpus = load_corpus(DataConfig(source="text", path=str(folder), val_fraction=0.2))
    everything = bytes(corpus.train.tolist()) + bytes(corpus.val.tolist())
    assert b"document number 0\n" in everything and b"document number 39\n" in everything
    assert b"nested file, read too" in everything
    assert b"skip me" not in everything and b"PNG" not in everything
    assert corpus.val.numel() > 0 and corpus.train.numel() > corpus.val.numel()
    assert "text:" in corpus.description
    # whole documents: no document straddles the split
    val_docs = set(bytes(corpus.val.tolist()).split(DOC_SEP)) - {b""}
    assert val_docs and not val_docs & set(bytes(corpus.train.tolist()).split(DOC_SEP))
    again = load_corpus(DataConfig(source="text", path=str(folder), val_fraction=0.2))
    assert torch.equal(again.train, corpus.train)

    single = tmp_path / "one.txt"
    single.write_text("hello world, " * 1000)
    c1 = load_corpus(DataConfig(source="text", path=str(single), val_fraction=0.1))
    assert c1.val.numel() == pytest.approx(13001 * 0.1, abs=2)
    assert ByteTokenizer().decode(c1.train[:12]) == "hello world,"


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")  # a dev dependency; the venv has it
    rows = [f"row {i}: the quick brown fox jumps over the lazy dog\n" * 5 for i in range(60)]
    datasets.Dataset.from_dict({"content": rows, "n": list(range(60))}).save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(source="hf", path=str(tmp_path / "ds"), text_field="content", val_fraction=0.2)
    corpus = load_corpus(cfg)
    train_docs = set(bytes(corpus.train.tolist()).split(DOC_SEP)) - {b""}
    val_docs = set(bytes(corpus.val.tolist()).split(DOC_SEP)) - {b""}
    assert train_docs | val_docs == {r.encode() for r in rows}
    assert val_docs and train_docs and not train_docs & val_docs
    assert "hf:" in corpus.description
    with pytest.raises(DataError, match="column 'text' not in the dataset.*content, n"):
        load_corpus(dataclasses.replace(cfg, text_field="text"))
    with pytest.raises(DataError, match="column 'n' row 0 is int, not text"):
        load_corpus(dataclasses.replace(cfg, text_field="n"))
    # a DatasetDict saved to disk: its train split is used
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows[:30]})}).save_to_disk(
        str(tmp_path / "dd"))
    dd = load_corpus(DataConfig(source="hf", path=str(tmp_path / "dd"), val_fraction=0.2))
    assert dd.train.numel() + dd.val.numel() == sum(len(r) + 1 for r in rows[:30])


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source="text", path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source="hf", path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no non-empty text files"):
        load_corpus(DataConfig(source="text", path=str(tmp_path / "empty")))
    (tmp_path / "notds").mkdir()
    (tmp_path / "notds" / "x.txt").write_text("x")
    with pytest.raises(DataError, match="save_to_disk"):
        load_corpus(DataConfig(source="hf", path=str(tmp_path / "notds")))
    with pytest.raises(DataError, match="fewer than seq_len"):
        Batches(torch.zeros(100, dtype=torch.uint8), 2, 64, seed=0, shard=0, num_shards=4)
    with pytest.raises(ValueError, match="shard must be"):
        Batches(torch.zeros(100, dtype=torch.uint8), 2, 8, seed=0, shard=4, num_shards=4)


def test_batches_shards_disjoint_and_deterministic():
    tokens = (torch.arange(10_000) % 251).to(torch.uint8)
    n_shards = 3
    seen = []
    for s in range(n_shards):
        b = Batches(tokens, batch_size=8, seq_len=16, seed=5, shard=s, num_shards=n_shards)
        positions = set()
        for _, x in zip(range(30), b):
            assert x.shape == (8, 16) and x.dtype == torch.int64
            for off in b.offsets(b.step - 1):
                assert b.start <= off and off + 16 <= b.end
                positions.update(range(int(off), int(off) + 16))
        seen.append(positions)
    assert not seen[0] & seen[1] and not seen[1] & seen[2] and not seen[0] & seen[2]
    # determinism: same seed and shard -> same stream; resuming at step k continues it
    a = Batches(tokens, 8, 16, seed=5, shard=1, num_shards=3)
    b = Batches(tokens, 8, 16, seed=5, shard=1, num_shards=3)
    xs = [next(a) for _ in range(5)]
    b.step = 3
    assert torch.equal(next(b), xs[3]) and torch.equal(next(b), xs[4])
    c = Batches(tokens, 8, 16, seed=6, shard=1, num_shards=3)
    assert not torch.equal(next(c), xs[0])
    # windows are real slices of the stream
    off = a.offsets(0)[0]
    assert torch.equal(xs[0][0], tokens[off:off + 16].long())


def test_val_batches_evenly_spaced():
    tokens = torch.arange(1000).to(torch.uint8)
    vb = val_batches(tokens, batch_size=4, seq_len=10, n=3)
    assert len(vb) == 3 and all(v.shape == (4, 10) for v in vb)
    assert vb[0][0, 0].item() == 0 and vb[-1][-1, -1].item() == 999 % 256
    assert all(torch.equal(a, b) for a, b in zip(vb, val_batches(tokens, 4, 10, 3)))
