"""docs/training.md's configuration reference lists every key, with its type and default.

One row per key: `| key | type | default | meaning |`, under "## Configuration reference". The
rows are compared with the config dataclasses, so the reference cannot drift from the code.
"""

import dataclasses
import pathlib
import re
import typing

from taco_train import config

DOC = pathlib.Path(__file__).parents[2] / "docs" / "training.md"
ROW = re.compile(r"^\| `(\w+)\.(\w+)` \| ([^|]+) \| ([^|]+) \| (.+) \|$")
# Keys of a section that are no field of its dataclass (the model section's preset name and
# the Hugging Face checkpoint a run starts from, `TrainConfig.init_from`).
EXTRA_KEYS = {
    "model": {
        "preset": ("str", f'"{config.DEFAULT_PRESET}"'),
        "init_from": ("str, optional", "unset"),
    }
}


def render_type(hint) -> str:
    """`int`, `float`, `str`, `bool`; a Literal is `str`; `T | None` is `T, optional`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]).__name__
    if args and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{render_type(inner)}, optional"
    return hint.__name__


def render_default(field: dataclasses.Field) -> str:
    if field.default is dataclasses.MISSING:
        return "from the preset"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def expected_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for section, cls in config._SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            rows[f"{section}.{field.name}"] = (
                render_type(hints[field.name]),
                render_default(field),
            )
        for name, row in EXTRA_KEYS.get(section, {}).items():
            rows[f"{section}.{name}"] = row
    return rows


def documented_rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text().split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            section, name, type_, default, meaning = (g.strip() for g in match.groups())
            key = f"{section}.{name}"
            assert key not in rows, f"{key} is documented twice"
            assert meaning, f"{key} has no meaning"
            rows[key] = (type_, default.strip("`"))
    return rows


def test_every_key_documented_with_its_type_and_default():
    expected, documented = expected_rows(), documented_rows()
    assert sorted(set(expected) - set(documented)) == [], "keys missing from docs/training.md"
    assert sorted(set(documented) - set(expected)) == [], "documented keys the config lacks"
    wrong = {k: (documented[k], v) for k, v in expected.items() if documented[k] != v}
    assert wrong == {}, "(documented, actual) type and default differ"
