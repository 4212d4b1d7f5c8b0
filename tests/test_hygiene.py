"""The repository stays small and readable: no generated weight in git, no record over 1 MB, a README that reads in
minutes, guide pages that each answer one question. Measured on the files git tracks."""
import shutil
import subprocess

import pytest
from conftest import ROOT

MB = 1_000_000
MAX_FILE = 1 * MB  # a study's record is one compact CSV/JSONL under this
MAX_DOCS = 6 * MB
MAX_README = 15_000
MAX_PAGE = 25_000  # each docs page answers one question
CHECKPOINTS = (".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".onnx")


def tracked():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked here")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()]


def test_no_tracked_file_over_1_mb_and_no_checkpoint():
    files = tracked()
    big = [f"{p.relative_to(ROOT)} ({p.stat().st_size / MB:.1f} MB)" for p in files if p.stat().st_size > MAX_FILE]
    assert not big, f"tracked files over 1 MB (keep records compact, checkpoints outside the repository): {big}"
    weights = [str(p.relative_to(ROOT)) for p in files if p.name.endswith(CHECKPOINTS)]
    assert not weights, f"checkpoints tracked by git (park them outside the repository): {weights}"


def test_readme_and_docs_stay_small():
    files = tracked()
    readme = (ROOT / "README.md").stat().st_size
    assert readme <= MAX_README, f"README.md is {readme:,} bytes: at most {MAX_README:,} (move detail to a docs page)"
    docs = sum(p.stat().st_size for p in files if p.is_relative_to(ROOT / "docs"))
    assert docs <= MAX_DOCS, f"docs/ holds {docs / MB:.1f} MB: at most {MAX_DOCS / MB:.0f} MB"
    # a generated table is read as a page too: past the limit its cells belong in the study's CSV
    pages = {str(p.relative_to(ROOT)): p.stat().st_size for p in files if p.is_relative_to(ROOT / "docs") and p.suffix == ".md"}
    long = {name: size for name, size in pages.items() if size > MAX_PAGE}
    assert not long, f"docs pages over {MAX_PAGE:,} bytes (one question a page, answer first; a table's cells in its CSV): {long}"


def test_generated_files_are_ignored():
    """What training, evaluation and the studies write never shows up as something to commit."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["runs/main/checkpoint.pt", "model.safetensors", "weights.pth", "runs/x/eval-20261203-120000/results.json",
             "docs/resolution_transfer/runs/shapes-none-seed0-e24/checkpoint.pt", "parked/run/checkpoint.pt", "x.ckpt"]
    result = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    ignored = set(result.stdout.split())
    assert ignored == set(paths), f"not ignored by .gitignore: {sorted(set(paths) - ignored)}"


def test_a_panel_draws_at_most_six_lines_and_bands_the_rest():
    """Figures a reader can read: nine series become the six named first as lines, the other three one grey band."""
    from vitpe.viz import pyplot
    from vitpe.viz.plots import MAX_LINES, draw_series

    plt = pyplot()
    fig, ax = plt.subplots()
    series = {f"s{i}": [(1.0, 50.0 + i), (2.0, 40.0 + i)] for i in range(9)}
    drawn = draw_series(ax, series, keep=["s8", "s7"], colours={"s8": "C5"})
    assert list(drawn) == ["s8", "s7", "s0", "s1", "s2", "s3"] and len(ax.lines) == MAX_LINES == 6
    assert drawn["s8"] == "C5" and len(set(drawn.values())) == 6  # a fixed colour is not given out twice
    assert len(ax.collections) == 1  # the band of s4, s5, s6
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == 44.0 and band[:, 1].max() == 56.0
    assert ax.get_legend_handles_labels()[1][0] == "3 others (range)"
    plt.close(fig)
