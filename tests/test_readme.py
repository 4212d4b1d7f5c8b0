"""The README's Python examples run as written, and its commands name files that exist."""
import json
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


# The README's shell commands that run in seconds, exactly as written, after `source .venv/bin/activate` (what the
# README asks once): `python` and `torchrun` are the environment's. `runs/A` and `runs/B` are made first, as a
# reader would have them (A rotary, so that --rope-scaling applies). Commands that train for minutes, need data
# from the internet or benchmark for hours are left to the hand-run checks.
CHEAP = [
    "torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml",
    "python eval.py runs/A",
    "python eval.py runs/A runs/B --resolutions 16 24 32 48 64",
    "python eval.py runs/A --resolutions 32x48 64x32 --coord-mode both",
    "python eval.py runs/A --resolutions 32 64 --coord-mode extrapolate --rope-scaling yarn",
    "python -m vitpe.viz matrix --pe sincos2d --grid 16 --dim 128",
    "python -m vitpe.viz similarity --pe rope_mixed --grid 16 --query 8 8",
    "python -m vitpe.viz similarity --checkpoint runs/A --grid 16",
    "python -m vitpe.viz attention-distance runs/A runs/B --resolutions 32 64",
]


def readme_commands():
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        out += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    return out


def test_readme_cheap_shell_commands_run_exactly_as_written(tmp_path):
    import os
    import subprocess
    import sys

    commands = readme_commands()
    missing = [c for c in CHEAP if c not in commands]
    assert not missing, f"README no longer has {missing}: update CHEAP"
    root = Path(__file__).resolve().parents[1]
    for name in ("train.py", "eval.py", "configs"):
        (tmp_path / name).symlink_to(root / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}

    def run(cmd):
        r = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        return r.stdout

    run("python train.py --config configs/tiny.yaml --name A --pe sincos2d+rope_axial")
    run("python train.py --config configs/tiny.yaml --name B")
    for cmd in CHEAP:
        run(cmd)
    labels = {r["label"] for p in (tmp_path / "runs" / "A").glob("eval-*/results.json") for r in json.loads(p.read_text())}
    assert "sincos2d+rope_axial (extrapolate) [rope yarn]" in labels and len(list((tmp_path / "runs").iterdir())) == 3  # A, B, torchrun's
