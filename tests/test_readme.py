"""The manual's Python examples (README.md and the docs/ pages) run as written, its commands name files that exist, and
the "which PE" tables are the study's record."""
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, load_benchmark

README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT), i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


@pytest.mark.parametrize("where,i,block", BLOCKS, ids=[f"{w}#{i}" for w, i, _ in BLOCKS])
def test_manual_python_block_runs(where, i, block, capsys):
    exec(compile(block, f"{where} block {i}", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    for expected in re.findall(r"print\(.*\)  +# (.*)", block):  # "# result" comments are checked
        assert expected in printed


def test_readme_names_two_setup_commands_and_existing_configs():
    assert "bash scripts/setup.sh && .venv/bin/python train.py" in README
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in README
    for page in PAGES:
        for cfg in set(re.findall(r"configs/\w+\.yaml", page.read_text())):
            assert (ROOT / cfg).is_file(), (page.name, cfg)
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


# The README's shell commands that run in seconds, exactly as written, after `source .venv/bin/activate` (what the
# README asks once): `python` and `torchrun` are the environment's. `runs/A` and `runs/B` are made first, as a
# reader would have them (A rotary, so that --rope-scaling applies). Commands that train for minutes, need data
# from the internet or benchmark for hours are left to the hand-run checks.
CHEAP = [
    "torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml",
    "python eval.py runs/A",
    "python eval.py runs/A runs/B --resolutions 16 24 32 48 64",
    "python eval.py runs/A --resolutions 32x48 64x32 --coord-mode both",
    "python eval.py runs/A --resolutions 32 48 64 --route all",
    "python eval.py runs/A --resolutions 32 64 --coord-mode extrapolate --rope-scaling yarn",
    "python eval.py runs/A --resolutions 16x64 64x16 --coord-mode extend --rope-scaling yarn",
    "python -m vitpe.viz matrix --pe sincos2d --grid 16 --dim 128",
    "python -m vitpe.viz similarity --pe rope_mixed --grid 16 --query 8 8",
    "python -m vitpe.viz similarity --checkpoint runs/A --grid 16",
    "python -m vitpe.viz attention-distance runs/A runs/B --resolutions 32 64",
    "python -m vitpe.export runs/A --onnx runs/A/model.onnx --hf runs/A/hf --check",
]


def readme_commands():
    """Every command of the manual's bash blocks, README and docs/ pages alike."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            out += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    return out


def test_readme_cheap_shell_commands_run_exactly_as_written(tmp_path):
    import os
    import subprocess
    import sys

    commands = readme_commands()
    missing = [c for c in CHEAP if c not in commands]
    assert not missing, f"the manual no longer has {missing}: update CHEAP"
    for name in ("train.py", "eval.py", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
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
    assert {"sincos2d+rope_axial (extrapolate) [scaling yarn]", "sincos2d+rope_axial (extend) [scaling yarn]"} <= labels
    assert len(list((tmp_path / "runs").iterdir())) == 3  # A, B, torchrun's


def test_which_pe_table_is_the_study_record():
    """Every accuracy in the "Which PE should I use" tables (docs/which_pe.md) is its row's cell in the committed study
    record (docs/resolution_transfer/results.csv with runs.jsonl, `shapes`), rounded as the report rounds: a typed-in number that drifts
    from the record, or a ± that the seeds do not back, fails here."""
    rt = load_benchmark("resolution_transfer")
    group = rt.cells(rt.load_results(ROOT / "docs" / "resolution_transfer"))

    def change(values):  # a change in points as the README writes it: the mean alone for one seed
        m, sd = rt.mean_sd(values)
        return f"{m:+.1f}" if len(values) == 1 else f"{m:+.1f} ± {sd:.1f}"

    section = (ROOT / "docs" / "which_pe.md").read_text()
    # Two tables: the rows trained at several sizes (their header says so), then those trained at 32 px only.
    tables = [block.splitlines() for block in re.findall(r"^\|.*?(?=\n\n|\Z)", section, flags=re.S | re.M)]
    tables = [t for t in tables if t[0].startswith("| PE")]  # the routes table is routes/table.md's (test_page_numbers.py)
    multires = [t for t in tables if "trained at 16-64 px" in t[0]]
    assert len(tables) == 2 and len(multires) == 1, [t[0] for t in tables]

    def check_row(line, several_sizes):
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, epochs, one, two, four, patch = cells[:6]
        pe = re.match(r"`(\w+)`", name).group(1)
        row = pe + (":multires" if several_sizes else ":aug" if "`coord_aug`" in name else "")
        first = group[("shapes", row, "interpolate", "1x")]
        seeds = re.search(r"\((\d+) seeds?\)", name)
        assert len(first) == (int(seeds.group(1)) if seeds else 3), (row, len(first))
        assert epochs == ", ".join(str(e) for e in sorted({r["epochs"] for r in first})), (row, epochs)
        assert one.strip("*%") == rt.fmt(first), (row, one)
        assert one.endswith("*") == (not all(r["converged"] for r in first)), (row, one, "a * marks a seed not converged")
        # "-7.0 ± 4.8 (extrapolate: -31.8 ± 23.8; YaRN: -12.7 ± 5.6)" at 2x; at 4x a bare "(-64.8 ± 8.3; ...)" in
        # the same order
        labels = ["interpolate"] + [{"extrapolate": "extrapolate", "YaRN": "extrapolate+yarn"}[k]
                                    for k in re.findall(r"(extrapolate|YaRN):", two)]
        for column, cell in (("2x", two), ("4x", four)):
            numbers = re.findall(r"[+-]\d+\.\d(?: ± \d+\.\d)?", cell)
            assert len(numbers) == len(labels), (row, column, cell)
            for label, number in zip(labels, numbers):
                assert number == change(rt.drops(group, "shapes", row, label, column)), (row, column, label, number)
        assert patch == rt.points(rt.drop(group, "shapes", row, "patch", "2x")), (row, patch)
        if several_sizes:
            assert cells[6] == "{} of {}".format(*rt.target_seeds(group, "shapes", row)), (row, cells[6])

    checked = 0
    for table in tables:
        for line in table[2:]:
            check_row(line, several_sizes=table is multires[0])
            checked += 1
    assert checked >= 36  # every family in both tables


def test_resolution_transfer_report_tables_are_the_record():
    """The report's two tables (docs/resolution_transfer.md) are what `--report` makes of the committed record, line
    for line: a number typed into the report that the record does not back fails here."""
    rt = load_benchmark("resolution_transfer")
    rows = rt.load_results(ROOT / "docs" / "resolution_transfer")
    report = (ROOT / "docs" / "resolution_transfer.md").read_text()
    for data in rt.DATASETS:
        table = rt.summary_table(rows, data)
        assert len(table) == 2 + len({r["pe"] for r in rows if r["data"] == data}) >= 18, data
        assert "\n".join(table) in report, data


def test_field_transfer_report_is_the_record(tmp_path):
    """docs/field_transfer.md shows the table `--report` makes of the committed record, and the probe's table of
    where each class goes, as `scale_probe.py` writes it from its committed result: a typed-in number fails here."""
    ft, probe = load_benchmark("field_transfer"), load_benchmark("scale_probe")
    out = ROOT / "docs" / "field_transfer"
    page = (ROOT / "docs" / "field_transfer.md").read_text()
    table = (out / "table.md").read_text()
    ft.report(ft.load_results(out), tmp_path)
    assert (tmp_path / "table.md").read_text() == table, "docs/field_transfer/table.md is stale: run benchmarks/field_transfer.py --report"
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) >= 2 + 14 and all(line in page for line in rows)
    results = json.loads((out / "scale_probe.json").read_text())
    shown = [line for line in probe.markdown(results).splitlines() if line.startswith("| ") and "cycles" in line]
    assert shown and sum(line in page for line in shown) >= 8


def test_the_main_jobs_printed_lines_are_its_measured_reference():
    """The README's main-job output is seed 0 of the recorded measurement (vitpe/reference_runs.json, the entry of
    configs/shapes.yaml's recipe): its top-1, and the comparison without a PE that every run of the recipe prints."""
    from vitpe.config import load_config
    from vitpe.training import reference_results

    ref = reference_results(load_config(str(ROOT / "configs" / "shapes.yaml")))
    assert ref is not None, "configs/shapes.yaml changed since vitpe/reference_runs.json was measured: run benchmarks/accuracy.py --suite main"
    pe, none = ref["results"]["sincos2d"], ref["results"]["none"]
    seed0 = pe["top1"][pe["seeds"].index(0)]
    assert f"done in {round(pe['train_wall_s'][pe['seeds'].index(0)])}s: test top-1 {seed0:.4f}" in README
    mean_none = 100 * sum(none["top1"]) / len(none["top1"])
    assert f"the same recipe reached {mean_none:.1f}%" in README
    assert f"sincos2d adds {100 * seed0 - mean_none:+.1f} points" in README


def test_the_timm_pages_coverage_is_the_record():
    """docs/timm.md's coverage paragraph, and the README's count, are what benchmarks/timm_coverage.py makes of its
    committed record (measured with the timm the page names; a newer timm may list more models: re-run it)."""
    cov = load_benchmark("timm_coverage")
    rows = cov.read_record()
    assert rows and all(r["status"] in ("converted", "differs", "refused") for r in rows.values())
    page = (ROOT / "docs" / "timm.md").read_text()
    for line in cov.summary(rows).splitlines()[:2]:
        assert line in page, line
    converted = sum(r["status"] == "converted" for r in rows.values())
    assert f"{converted} of {len(rows)}" in README


def test_finetune_page_is_the_record(tmp_path):
    """docs/finetune.md shows the tables `benchmarks/finetune_study.py --report` makes of the committed record
    (docs/finetune/results.csv), line for line, and every mean ± sd its text states is a cell of them."""
    study = load_benchmark("finetune_study")
    out = ROOT / "docs" / "finetune"
    record = tmp_path / "results.csv"  # the report is regenerated from a copy, never in place
    record.write_text((out / "results.csv").read_text())
    assert study.report(record) == (out / "table.md").read_text(), "docs/finetune/table.md is stale: run benchmarks/finetune_study.py --report"
    page = (ROOT / "docs" / "finetune.md").read_text()
    rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) >= 10 and all(line in page for line in rows)
    assert study.with_tables(page, (out / "table.md").read_text()) == page, "docs/finetune.md's tables are stale: run --report"
    text = "\n".join(line for line in page.splitlines() if not line.startswith("| "))
    cells = set(re.findall(r"\d+\.\d ± \d+\.\d", "\n".join(rows)))
    stated = re.findall(r"\d+\.\d ± \d+\.\d", text)
    assert stated and all(s in cells for s in stated), [s for s in stated if s not in cells]


def test_the_resolution_transfer_page_is_the_record(tmp_path):
    """docs/resolution_transfer/'s summary, table and run list are what `benchmarks/resolution_transfer.py --report`
    makes of the committed record, and the page shows the summary's tables line for line (its prose:
    test_page_numbers.py)."""
    study = load_benchmark("resolution_transfer")
    docs = ROOT / "docs" / "resolution_transfer"
    for name in ("results.csv", "runs.jsonl", "attention.csv"):  # the report is regenerated from a copy, never in place
        (tmp_path / name).write_text((docs / name).read_text())
    study.report(study.load_results(tmp_path), tmp_path)
    for name in ("summary.md", "table.md", "trained.md", "cells.csv"):
        assert (tmp_path / name).read_text() == (docs / name).read_text(), f"{name} is stale: run benchmarks/resolution_transfer.py --report"
    from test_page_numbers import NUMBER, cells

    page = (ROOT / "docs" / "resolution_transfer.md").read_text()
    summary = (docs / "summary.md").read_text()
    tables = [block.splitlines() for block in re.findall(r"^\| .*(?:\n\| .*)*", summary, flags=re.M)]
    family_rows = [line for table in tables if "2x: patch route" in table[0] for line in table]  # the extrapolated ones: linked
    assert len(family_rows) >= 30 and [line for line in family_rows if line not in page] == []
    # the page's own table (the answer first) quotes cells of the generated ones
    known = cells([docs / name for name in ("summary.md", "table.md")])
    quoted = [n for line in page.splitlines() if line.startswith("| ") and line not in summary for n in NUMBER.findall(re.sub(r"`[^`]*`", "", line))]
    assert len(quoted) >= 8 and [n for n in quoted if n.lstrip("+-") not in known and n not in known] == []


def test_the_routes_pages_are_the_record(tmp_path):
    """docs/routes/table.md is what `benchmarks/routes.py --report` makes of the committed record, and docs/which_pe.md
    and docs/evaluation.md show its tables line for line (their prose: test_page_numbers.py)."""
    study = load_benchmark("routes")
    record = tmp_path / "results.csv"  # the report is regenerated from a copy, never in place
    record.write_text((ROOT / "docs" / "routes" / "results.csv").read_text())
    table = (ROOT / "docs" / "routes" / "table.md").read_text()
    assert study.report(record) == table, "docs/routes/table.md is stale: run benchmarks/routes.py --report"
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) >= 8
    for page in ("which_pe.md", "evaluation.md"):
        text = (ROOT / "docs" / page).read_text()
        assert all(line in text for line in rows), page
    seeds = {r["seed"] for r in study.load_results(record)}
    assert seeds == {0, 1, 2}  # every claim is over three seeds


def test_the_route_planners_output_on_the_pages_is_the_record():
    """docs/routes/planner.md is what `benchmarks/route_planner.py --report` makes of the committed record (each plan's
    command, its answer and table regenerated from the plan it saved), and the README and docs/evaluation.md show its
    output line for line, beside the command that measured it."""
    study = load_benchmark("route_planner")
    record = json.loads((ROOT / "docs" / "routes" / "planner.json").read_text())
    page = (ROOT / "docs" / "routes" / "planner.md").read_text()
    assert study.report(record) == page, "docs/routes/planner.md is stale: run benchmarks/route_planner.py --report"
    blocks = re.findall(r"```\n(\$ python eval.py \S+ --plan .*?)```", page, flags=re.S)
    assert len(blocks) == len(record["plans"]) >= 3
    for name in ("README.md", "docs/evaluation.md"):
        shown = re.findall(r"```\n(\$ python eval.py \S+ --plan .*?)```", (ROOT / name).read_text(), flags=re.S)
        assert shown, f"{name} shows no planner output"
        for block in shown:
            lines = [line for line in block.splitlines() if line.strip() and line.strip() != "..."]
            source = next((b for b in blocks if b.splitlines()[0] == lines[0]), None)
            assert source is not None, f"{name}: {lines[0]} is not a command the record measured"
            assert all(line in source.splitlines() for line in lines), f"{name} shows lines the record does not hold"
    main = next(r for r in record["plans"] if r["arm"] == "main")
    assert len(main["plan"]["sizes"]) == 3 and "--finetune-min" not in main["command"]


def test_a_fine_tune_command_printed_beside_a_number_is_the_arm_that_measured_it(tmp_path):
    """Where a page gives a fine-tune's accuracy at a new size, the `python train.py --init RUN ...` it prints resolves to
    the config of the study arm that measured it (the routes study's ft64, the fine-tuning study's ft64keep), the seed
    aside: not configs/finetune.yaml's 600 steps, which the arms never ran."""
    import shlex

    from vitpe.cli import train as train_cmd
    from vitpe.training import resolve_config

    source = tmp_path / "runs" / "shapes-one-seed0"  # the arms' source run, as the studies name it
    assert train_cmd.main(["--config", "tiny", "--out-dir", str(source.parent), "--name", source.name]) == 0
    printed = set()
    for page in ("which_pe.md", "evaluation.md", "finetune.md"):
        text = re.sub(r"\s*\n\s*", " ", (ROOT / "docs" / page).read_text())
        printed |= {c for c in re.findall(r"`(python train\.py --init RUN [^`]*)`", text) if "train.resolutions=[64]" in c}
    assert len(printed) == 1, printed  # one command, the same on every page

    def config(overrides):
        cfg = resolve_config(None, [o for o in overrides if not o.startswith("train.seed=")]).to_dict()
        return {**cfg, "name": None, "out_dir": None}

    args = train_cmd.parse_args(shlex.split(printed.pop())[2:])
    page = config([o.replace("init.source=RUN", f"init.source={source}") for o in train_cmd.cli_overrides(args)])
    for study, arm in (("routes", "ft64"), ("finetune_study", "ft64keep")):
        assert config(load_benchmark(study).arm_args("shapes", arm, 0, tmp_path).overrides) == page, study
