"""The library's structure: its modules import one another without a circle, the study side (benchmarks/) is never
imported by it, and the core names no family (a family's knowledge lives in its family file)."""
import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest
import torch
from conftest import ROOT

import vitpe

PACKAGE = ROOT / "vitpe"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_door(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``: what a module does when it is run as the program (``python -m vitpe.predict``), a
    copy of it apart from the imported one, so its imports are no arrows of the import graph."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def without_doors(tree: ast.AST) -> ast.AST:
    tree.body = [n for n in tree.body if not is_door(n)]
    return tree


def imports(path: Path, modules: Set[str]) -> Set[str]:
    """The vitpe modules ``path`` imports anywhere in it (functions included; its ``__main__`` door not): ``from .x
    import y`` names module ``x.y`` where that is a module, else ``x``."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(without_doors(ast.parse(path.read_text()))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules and n != here}
    return out


def graph() -> Dict[str, Set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_library():
    edges = graph()
    assert len(edges) > 30 and "vitpe.pos_embed.base" in edges["vitpe.pos_embed.registry"]  # the reader finds imports
    assert cycles(edges) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail


def test_the_library_never_imports_the_study_side():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        assert not [n for n in names if n.split(".")[0] in ("benchmarks", "studykit", "tests", "conftest")], path


# The floors of the package, lowest first: a module imports only modules on its own floor or below (the same floor
# without a circle), so that the core never depends on a wing and no library module on a command. docs/development.md
# draws the same floors; a new module takes the floor of the wing it joins.
FLOORS = [
    ("core", ["vitpe.errors", "vitpe.suggest", "vitpe.layers", "vitpe.coords", "vitpe.patch", "vitpe.packing", "vitpe.pos_embed", "vitpe.vit"]),
    ("data", ["vitpe.data"]),
    ("runtime and records", ["vitpe.engine", "vitpe.config", "vitpe.runs", "vitpe.checkpoint"]),
    ("bridges and pictures", ["vitpe.timm", "vitpe.finetune", "vitpe.viz"]),
    ("loops and the package", ["vitpe.training", "vitpe.evaluation", "vitpe.onnx", "vitpe"]),
    ("commands and their doors", ["vitpe.cli", "vitpe.__main__", "vitpe.viz.__main__", "vitpe.predict", "vitpe.export"]),
]


def floor_of(module: str) -> int:
    """The floor of ``module``: that of the longest prefix listed (``vitpe.viz.__main__`` before ``vitpe.viz``)."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(FLOORS) for p in prefixes if module == p or module.startswith(p + ".")),
               default=None)
    assert best is not None, f"{module} is on no floor: give it one in FLOORS and docs/development.md"
    return best[1]


def test_every_module_imports_only_its_own_floor_or_below():
    edges = graph()
    assert floor_of("vitpe.viz.__main__") == 5 and floor_of("vitpe.viz.sweep") == 3 and floor_of("vitpe.pos_embed.rotary") == 0
    upward = [f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})"
              for m, deps in sorted(edges.items()) for d in sorted(deps) if floor_of(d) > floor_of(m)]
    assert upward == []
    # the check sees the arrows it must: vitpe viz reads a run's data through the evaluation module, which the
    # pictures' floor could not import
    assert "vitpe.evaluation" in edges["vitpe.cli.viz"] and floor_of("vitpe.evaluation") > floor_of("vitpe.viz.plots")


def test_commands_share_one_size_parser_and_one_error_convention():
    """Every command is a module of vitpe/cli with ``main`` (raises, for tests and callers) and ``cli`` (one line and an
    exit code, through run_cli); no command parses a size itself, and nothing outside the wing builds a command line."""
    import importlib

    from vitpe.cli import COMMANDS
    from vitpe.cli.common import parse_size

    for name, (module, function, _) in COMMANDS.items():
        if name == "configs":
            continue
        mod = importlib.import_module(module)
        assert module.startswith("vitpe.cli.") and function == "cli" and callable(mod.main), module
        assert "return run_cli(main, argv)" in (ROOT / (module.replace(".", "/") + ".py")).read_text(), module
    for path in (PACKAGE / "cli").glob("*.py"):
        assert path.name == "common.py" or 'partition("x")' not in path.read_text(), path
    for path in PACKAGE.rglob("*.py"):
        assert path.parts[-2] == "cli" or "ArgumentParser(" not in path.read_text(), f"{path}: a command line belongs in vitpe/cli"
    assert parse_size("48") == (48, 48) and parse_size("32x48") == (32, 48)


def attribute_uses(tree: ast.AST, alias: str) -> Set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == alias}


def test_benchmarks_and_tests_take_the_library_from_the_library():
    """The studies import no command module; a test imports from a command only what that command exports (its
    ``__all__``: ``main``, ``cli``, its parser), everything else from the library; nobody edits ``sys.path``."""
    import importlib

    commands = {f"vitpe.cli.{p.stem}" for p in (PACKAGE / "cli").glob("*.py") if p.stem not in ("__init__", "common")}
    found = 0
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").glob("*.py")]:
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("insert", "append")
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "path" and getattr(n.value.value, "id", "") == "sys"], \
            f"{path.name} edits sys.path"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("vitpe.cli"):
                continue
            assert path.parent.name == "tests", f"{path.name} imports the command wing ({node.module}): use the library's names"
            for a in node.names:
                module = f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in commands else node.module
                if module not in commands:
                    continue
                exported = set(importlib.import_module(module).__all__)
                used = attribute_uses(tree, a.asname or a.name) if module != node.module else {a.name}
                assert used <= exported, f"{path.name} takes {sorted(used - exported)} from the command {module}: take it from the library"
                found += 1
    assert found > 10  # the tests of the commands were seen


def test_no_module_takes_another_modules_private_name():
    """A name shared between vitpe's modules is public where it lives (timm's bridges once shared a private ``_unwrap``)."""
    for path in PACKAGE.rglob("*.py"):
        private = [a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                   for a in n.names if a.name.startswith("_") and (n.level or (n.module or "").startswith("vitpe"))]
        assert private == [], f"{path}: {private} are another module's own; make them public where they are shared"


CORE = ["vit.py", "evaluation.py", "training.py", "config.py", "engine.py", "pos_embed/registry.py", "pos_embed/base.py", "cli/train.py",
        "cli/eval.py"]


def test_the_core_names_no_family():
    """No family's name or class in the modules every family passes through: they read what the families declare
    instead. A family named by an English word ('none' is also 'off' in many options; 'learned', 'string', 'fire') is
    looked for in quotes only."""
    from vitpe.pos_embed import registry

    words = {"none", "learned", "string", "fire", "fourier"} & set(vitpe.list_pos_embeds())
    names = [n for n in vitpe.list_pos_embeds() if n not in words]
    classes = sorted({cls.__name__ for cls in registry._REGISTRY.values()} | {"MatrixRotary", "RotaryPosEmbed"})
    quoted = re.compile(r"""["'`](%s)["'`.]""" % "|".join(sorted(words - {"none"})))
    named = re.compile(r"\b(%s)\b" % "|".join(names + classes))
    assert named.findall("a vit with rope_mixed or LookHere") == ["rope_mixed", "LookHere"]  # the check can fail
    for rel in CORE:
        text = (PACKAGE / rel).read_text()
        assert not quoted.findall(text) and not named.findall(text), (rel, quoted.findall(text), named.findall(text))


def test_families_declare_what_they_are():
    info = {n: vitpe.pos_embed_info(n) for n in vitpe.list_pos_embeds()}
    assert {n for n, i in info.items() if not i["reads_coords"]} == {"none", "peg"}
    assert {n for n, i in info.items() if i["per_image_cost"]} == {"liere", "comrope"}
    assert all("scaling" in i["test_options"] for i in info.values() if i["rotary"])
    assert {n for n, i in info.items() if "p_rope" in i["test_options"]} == {"rope_axial", "rope_mixed", "rope_golden", "string"}
    assert info["lookhere"]["test_options"] and info["lookhere"]["biased"] and not info["lookhere"]["rotary"]
    assert "lookhere.slope" in vitpe.pe_test_options()  # every registered family's, for eval.py's flags and help
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=3,
                                    pos_embed="learned+lookhere+rope_axial")
    assert list(vitpe.pe_test_options(model)) == ["lookhere.slope", "rope_axial.scaling", "rope_axial.p_rope",
                                                  "rope_axial.yarn_alpha", "rope_axial.yarn_beta"]
    assert vitpe.set_pe_option(model, "p_rope", "0.5") == ["rope_axial"] and model.pos_embed.parts[2].p_rope == 0.5
    for key, value, message in (("slop", 1, r"takes the test-time option 'slop' \(did you mean 'slope'\?\)"),
                                ("learned.slope", 1, "its options: lookhere.slope"),
                                ("lookhere.slope", "-2", r"lookhere.slope='-2': must be a positive, finite number")):
        with pytest.raises(ValueError, match=message):
            vitpe.set_pe_option(model, key, value)


def test_no_test_time_option_takes_a_value_that_gives_nan_logits():
    """eval.py --pe-option yarn_beta=nan (or inf) once gave NaN logits that scored as a low top-1 without a word: every
    declared numeric option of every family refuses non-finite values, as text or as a number, and YaRN's band must be
    ordered (its ramp divides by yarn_beta - yarn_alpha)."""
    checked = 0
    for name in vitpe.list_pos_embeds():
        model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed=name)
        for key, option in vitpe.pe_test_options(model).items():
            if option.parse is str:
                continue
            for bad in ("nan", "inf", "-inf", float("nan"), float("inf")):
                with pytest.raises(ValueError, match=rf"{key}=.*(finite|fraction in \[0, 1\])"):
                    vitpe.set_pe_option(model, key, bad)
                checked += 1
    assert checked >= 14 * 5  # four rotary families' three numeric options, lookhere's and alibi2d's slopes
    rope = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="rope_axial")
    for key, value in (("yarn_alpha", "40"), ("yarn_beta", "1"), ("yarn_alpha", "-1")):
        with pytest.raises(ValueError, match="0 <= yarn_alpha < yarn_beta"):
            vitpe.set_pe_option(rope, key, value)
    with pytest.raises(ValueError, match="0 <= yarn_alpha < yarn_beta"):  # at build time too (model.pos_embed_kwargs)
        vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                                pos_embed="rope_axial", pos_embed_kwargs={"yarn_beta": float("nan")})


def test_a_new_family_with_a_test_time_option_is_one_class():
    """What a family file holds is enough: registered, it builds, combines with other mechanisms, trains a step, and
    its declared option is set by name (eval.py's --pe-option path) with its caches dropped."""
    from vitpe.cli.eval import parse_pe_options
    from vitpe.pos_embed import PEOption, PosEmbed, register_pos_embed, registry

    class Ramp(PosEmbed):
        acts_on = "attention logits"
        test_options = (PEOption("strength", "strength", float, "the factor of the distance penalty"),)

        def __init__(self, dim, num_heads, ref_grid, depth=1, *, strength: float = 1.0):
            super().__init__(dim, num_heads, ref_grid, depth)
            self.strength = strength

        def bias(self, grid):
            d = (grid.coords[..., :, None, :] - grid.coords[..., None, :, :]).norm(dim=-1)
            return -self.strength * d.unsqueeze(-3).expand(*d.shape[:-2], self.num_heads, *d.shape[-2:])

    register_pos_embed("test_ramp")(Ramp)
    try:
        model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                                        pos_embed="sincos2d+test_ramp+rope_mixed", coord_aug={"shift": 0.5}).eval()
        x = torch.randn(2, 3, 24, 16)
        with torch.no_grad():
            before = model(x)
            assert parse_pe_options(["test_ramp.strength=3"]) == [("test_ramp.strength", "3")]
            assert vitpe.set_pe_option(model, "test_ramp.strength", "3") == ["test_ramp"]
            assert not torch.allclose(model(x), before)  # the combination's cached context was dropped
        model.train()
        model(torch.randn(2, 3, 16, 16)).sum().backward()  # per-image coordinates (coord_aug) and gradients
    finally:
        registry._REGISTRY.pop("test_ramp")


@pytest.mark.parametrize("override", [
    "model.pos_embed=rope_axal", "model.pos_embed=sincos2d+rope_mixd", "model.pos_embed_kwargs={thetta: 10}",
    "model.depth=0", "model.embed_dim=33", "model.pool=mena", "model.mlp_act=gleu", "model.coord_aug={zoom: 1.5}",
    "model.coord_mode=extrapolat", "model.drop_path_rate=1.5", "model.content_keep=0.0", "model.class_token=false",
])
def test_the_model_owns_its_config_checks(override):
    """One set of checks for the model's arguments (vit.check_model_args): a config's model section is refused when the
    config is read, with the model's own line, 'model.' before it."""
    import dataclasses

    import yaml

    from vitpe.config import ConfigError, apply_overrides, load_config

    cfg = load_config("tiny")
    with pytest.raises(ConfigError) as refused:
        apply_overrides(cfg, [override])
    key, _, value = override.partition("=")
    args = {**dataclasses.asdict(cfg.model), key[len("model."):]: yaml.safe_load(value)}  # the same value, given to the model
    with pytest.raises(ValueError) as model_refused:
        vitpe.VisionTransformer(**args, num_classes=10)
    assert str(refused.value) == f"model.{model_refused.value}"
    assert "\n" not in str(refused.value)


def test_a_mistyped_family_is_refused_before_any_data_is_read(tmp_path, capsys):
    """--pe with a typo on a dataset whose files are missing: the family is the error (exit 2, one line, did you mean),
    not the missing data, and no run folder is made."""
    from vitpe.cli.train import cli

    assert cli(["--config", "tiny", "--data", "fashion_mnist", "--data-dir", str(tmp_path / "nothing"), "--pe", "rope_mixd",
                "--out-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.pos_embed='rope_mixd': unknown positional encoding") and "did you mean 'rope_mixed'?" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_every_study_runs_as_a_module_from_the_root():
    """``python -m benchmarks.NAME`` is how a study runs (docs/development.md): each imports its kit as a package, with
    no path of its own, from a fresh interpreter in the repository's root."""
    import subprocess
    import sys

    studies = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
    code = "import importlib\nfor n in %r:\n    importlib.import_module('benchmarks.' + n)\n" % studies
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
