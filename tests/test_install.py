"""vitpe as a user installs it: the wheel (not a clone) in a fresh environment, its ``vitpe`` command run from an empty
folder, and the shipped configs by name."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

from vitpe.cli import COMMANDS, main
from vitpe.config import ConfigError, config_path, load_config, shipped_configs


def test_every_package_of_vitpe_is_in_the_wheel_list():
    """pyproject.toml names its packages (it maps configs/ into the wheel): a new sub-package left off would be missing
    from every install and from no clone."""
    listed = re.search(r'^packages = \[(.*?)\]', (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S).group(1)
    listed = set(re.findall(r'"([\w.]+)"', listed))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vitpe").rglob("__init__.py")}
    assert listed == found | {"vitpe.configs"}


def test_a_shipped_config_is_read_by_name_and_by_its_clone_path_from_any_folder(tmp_path, monkeypatch):
    assert config_path("tiny") == shipped_configs() / "tiny.yaml"
    monkeypatch.chdir(tmp_path)  # no configs/ here: the clone's path names the shipped file
    assert config_path("configs/tiny.yaml") == shipped_configs() / "tiny.yaml"
    assert load_config("tiny") == load_config(str(shipped_configs() / "tiny.yaml"))
    (tmp_path / "tiny").write_text("model: {img_size: 8, patch_size: 4}\n")  # a file that exists is the user's, whatever its name
    assert load_config("tiny").model.img_size == 8
    with pytest.raises(ConfigError, match=r"no shipped config named 'fashon_mnist' \(did you mean 'fashion_mnist'\?\); the shipped ones: .*shapes"):
        config_path("fashon_mnist")
    with pytest.raises(ConfigError, match=r"config file mine/x.yaml not found; .* by name: .*tiny"):
        config_path("mine/x.yaml")


def test_the_vitpe_command_names_its_commands_and_refuses_a_typo(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    assert main(["trian"]) == 2
    assert "error: no command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^shapes +\S", out, flags=re.M) and re.search(r"^fashion_mnist +\S", out, flags=re.M)
    assert main(["train", "--config", "shape"]) == 2  # refused when the config is read, before any data
    assert "did you mean 'shapes'?" in capsys.readouterr().err
    assert not sys.argv[0].startswith("vitpe ")  # the name is the command's while it runs, then this process's again


@pytest.mark.skipif(os.name == "nt", reason="the scratch environment's layout (bin/) is POSIX")
def test_the_wheel_installed_in_a_fresh_environment_runs_every_command_from_an_empty_folder(tmp_path):
    """pip wheel, a new virtual environment that sees only the wheel and vitpe's dependencies (those of this
    environment, by a .pth: no download), then the main job's first steps and one command of each kind, from a
    folder with no clone in it."""
    src = tmp_path / "src"  # the files a wheel is built from, so that the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("vitpe", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")], check=True)
    wheel = next((tmp_path / "dist").glob("vitpe-*.whl"))
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # a .pth dir's own .pth files (this checkout's editable vitpe) are not read
    Path(site, "vitpe_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True)

    work = tmp_path / "work"
    work.mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args: str) -> str:
        r = subprocess.run(list(args), cwd=work, env=clean, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}"
        return r.stdout

    vitpe = str(env / "bin" / "vitpe")
    assert run(str(python), "-c", "import vitpe; print(vitpe.__file__)").strip().startswith(site)  # the wheel's, not the clone's
    out = run(vitpe, "train", "--set", "train.steps=2", "--set", "data.train_size=256", "--set", "data.test_size=64", "--name", "main")
    assert "pe=sincos2d" in out and "evaluate at other resolutions: vitpe eval runs/main" in out  # the main job's config, shipped
    assert (work / "runs" / "main" / "checkpoint.pt").is_file()
    assert "top-1" in run(vitpe, "eval", "runs/main", "--resolutions", "16", "32", "--test-size", "64", "--out", "eval")
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 40, 40)).save(work / "red.png")
    assert run(vitpe, "predict", "red.png", "--run", "runs/main").startswith("red.png: ")
    assert "wrote model.onnx" in run(vitpe, "export", "runs/main", "--onnx", "model.onnx", "--check")
    run(vitpe, "viz", "similarity", "--pe", "rope_mixed", "--grid", "4", "--out", "viz")
    assert any((work / "viz").iterdir())
    assert "tiny" in run(str(python), "-m", "vitpe", "configs")
    assert "pe=" in run(vitpe, "train", "--config", "tiny", "--set", "train.steps=1", "--name", "tiny")
