"""Helpers of the training tests (a plain module: see tests/conftest.py for why)."""

import os
from pathlib import Path

from process_testing import subprocess_env  # noqa: F401 (the training tests import it from here)

FIXTURE_CORPUS = Path(__file__).parent / "fixtures" / "tiny_corpus"
# A Python with torch and transformers (not project dependencies), for the tests that
# transformers loads an export; unset, those tests skip that check.
HF_PYTHON = os.environ.get("TACO_HF_PYTHON")
REPO = Path(__file__).parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the checkpoint directories under `directory`, ascending."""
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def untimed(records: list[dict]) -> list[dict]:
    """Metrics records without their timing fields, which differ between runs, and without the
    checkpoint records (the timing of saves, which differ between an interrupted run and one
    that was not)."""
    return [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")}
        for r in records
        if r["kind"] != "checkpoint"
    ]


def final_state(out_dir: Path, step: int):
    """The train state saved in `out_dir`'s checkpoint of `step`, as NumPy arrays (whatever
    devices and processes saved it)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = (out_dir / "checkpoints" / str(step) / "default").absolute()
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, restore_args=as_numpy)


def assert_same_state(out_a: Path, out_b: Path, step: int) -> None:
    """The checkpoints of `step` in two run directories hold the same state, bit for bit: for
    runs of the same programs (one configuration, one machine, one session's compile flags),
    whose compilation and CPU execution are deterministic; never across machines."""
    import jax
    import numpy as np

    a, b = final_state(out_a, step), final_state(out_b, step)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def tiny_args(out_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """Command-line arguments of a configs/tiny.toml run (see `tiny_overrides`)."""
    args = ["--config", TINY]
    for override in tiny_overrides(out_dir, cache_dir, *extra):
        args += ["--set", override]
    return args


def tiny_overrides(out_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """`--set` overrides that point configs/tiny.toml at the fixture corpus and temp dirs."""
    return [
        f"data.corpus={str(FIXTURE_CORPUS)!r}",
        f"data.cache_dir={str(cache_dir)!r}",
        f"run.out_dir={str(out_dir)!r}",
        "run.progress=false",
        *extra,
    ]


# A text with words, punctuation and a newline, for tokenizers to agree on.
TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler"


def transformers_loads(directory, cfg, params, tokenizer, tmp_path) -> None:
    """AutoTokenizer encodes as the run's tokenizer did; AutoModelForCausalLM's logits of
    those ids (the first seq_len) equal ours within tests/models/test_hf.py's LOGITS_RTOL
    (its derivation there: the same fp32 arithmetic in another order)."""
    import subprocess

    import numpy as np

    from taco_models.parallel import reference_logits

    script = (
        "import sys, numpy as np, torch, transformers\n"
        "tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = tok(open(sys.argv[2]).read())['input_ids'][: int(sys.argv[5])]\n"
        "with torch.no_grad(): logits = m(torch.tensor([ids])).logits.float().numpy()\n"
        "np.save(sys.argv[3], np.asarray(ids)); np.save(sys.argv[4], logits)\n"
    )
    (tmp_path / "text.txt").write_text(TEXT)
    ids_file, logits_file = tmp_path / "ids.npy", tmp_path / "logits.npy"
    subprocess.run(
        [
            HF_PYTHON,
            "-c",
            script,
            str(directory),
            str(tmp_path / "text.txt"),
            str(ids_file),
            str(logits_file),
            str(cfg.seq_len),
        ],
        check=True,
        timeout=300,
    )
    ids = np.load(ids_file)
    np.testing.assert_array_equal(ids, tokenizer.encode([TEXT])[0][: cfg.seq_len])
    ours = np.asarray(reference_logits(cfg, params, ids[None], dtype="float32"))
    theirs = np.load(logits_file)
    relative = np.max(np.abs(ours[..., : cfg.vocab_size] - theirs)) / np.max(np.abs(theirs))
    assert relative <= 1e-4
