"""The README's example runs as written (docs that match the code)."""

import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    error = float(capsys.readouterr().out.strip().splitlines()[-1])
    # Two E4M3 roundings of Gaussian partial sums: ~0.036 (README), inside the 2^-4 bound.
    assert 0.018 <= error <= 2.0**-4
