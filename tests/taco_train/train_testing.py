"""Helpers of the training tests (a plain module: see tests/conftest.py for why)."""

from pathlib import Path

FIXTURE_CORPUS = Path(__file__).parent / "fixtures" / "tiny_corpus"
REPO = Path(__file__).parents[2]


def untimed(records: list[dict]) -> list[dict]:
    """Metrics records without their timing fields, which differ between runs."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in records]


def tiny_overrides(out_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """`--set` overrides that point configs/tiny.toml at the fixture corpus and temp dirs."""
    return [
        f"data.corpus={str(FIXTURE_CORPUS)!r}",
        f"data.cache_dir={str(cache_dir)!r}",
        f"run.out_dir={str(out_dir)!r}",
        "run.progress=false",
        *extra,
    ]
