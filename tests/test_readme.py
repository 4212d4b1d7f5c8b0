"""The README's Python examples run as written, and its commands name files that exist."""
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i, capsys):
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    for expected in re.findall(r"print\(.*\)  # (.*)", BLOCKS[i]):  # "# result" comments are checked
        assert expected in printed


def test_readme_names_two_setup_commands_and_existing_configs():
    assert "bash scripts/setup.sh && .venv/bin/python train.py" in README
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in README
    root = Path(__file__).resolve().parents[1]
    for cfg in set(re.findall(r"configs/\w+\.yaml", README)):
        assert (root / cfg).is_file(), cfg
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in (root / ".ci" / "run").read_text()
