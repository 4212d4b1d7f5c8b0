"""Starting from a model you have (train.py --init, vitpe.init_from): new sizes, new classes, another PE, timm weights,
frozen parts, layer decay, provenance and bad sources."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitpe
from vitpe import training
from vitpe.checkpoint import load_checkpoint, model_from_checkpoint
from vitpe.cli import train as train_cmd
from vitpe.finetune import InitError, freeze, read_source

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def small(**kw):
    args = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=5)
    return vitpe.VisionTransformer(**{**args, **kw}).eval()


def randomised(model):
    """Every parameter away from its initialisation (zero tokens, zero biases), so that a lost weight shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert train_cmd.main(["--config", TINY, "--out-dir", str(out), "--name", "src", "--set", "train.ema_decay=0.9"]) == 0
    return out / "src"


@pytest.mark.parametrize("pe", ["learned", "rel_bias", "factorized", "learned+rel_bias", "rope_mixed", "fire"])
def test_a_new_size_starts_where_the_source_was_at_that_size(tmp_path, pe):
    """A fine-tune at twice the size starts from the function the source computes there (interpolate mode): tables
    laid on the grid are resampled to the new reference grid, coordinate functions read the new grid's coordinates."""
    src = randomised(small(pos_embed=pe))
    folder = vitpe.save_pretrained(src, tmp_path / "src")
    model = vitpe.init_from(str(folder), num_classes=5, img_size=32).eval()
    assert model.ref_grid == (8, 8)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        if pe in ("rope_mixed", "fire"):  # coordinate families: the same parameters, read on the new grid's coordinates
            for (k, a), b in zip(src.pos_embed.state_dict().items(), model.pos_embed.state_dict().values()):
                assert torch.equal(a, b), k
        else:
            torch.testing.assert_close(model(x), src(x), atol=1e-5, rtol=1e-5)


def test_a_new_patch_size_resizes_the_kernel_and_the_table(tmp_path):
    src = randomised(small(pos_embed="learned"))
    model = vitpe.init_from(str(vitpe.save_pretrained(src, tmp_path / "s")), num_classes=5, patch_size=8, img_size=32).eval()
    assert model.patch_embed.weight.shape[-1] == 8 and model.ref_grid == (4, 4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # FlexiViT's resize: the source at patch 8 (its own route) is what the new model computes
        torch.testing.assert_close(model(x), src(x, patch_size=8), atol=1e-4, rtol=1e-4)


def test_the_head_is_kept_for_the_same_classes_reordered_and_new_for_others(source_run):
    lines = []
    classes = load_checkpoint(source_run)["data"]["classes"]
    kept = vitpe.init_from(str(source_run), classes=classes, log=lines.append)
    assert any(line.startswith("head: kept, the same 10 classes") for line in lines)
    src = model_from_checkpoint(source_run)[0]  # EMA weights, the ones the run measured
    assert torch.equal(kept.head.weight, src.head.weight)
    lines.clear()
    flipped = vitpe.init_from(str(source_run), classes=classes[::-1], log=lines.append)
    assert torch.equal(flipped.head.weight, src.head.weight.flip(0)) and any("reordered" in line for line in lines)
    lines.clear()
    new = vitpe.init_from(str(source_run), classes=["a", "b", "c"], log=lines.append)
    assert new.head.weight.shape[0] == 3 and any(line.startswith("head: new for 3 classes") for line in lines)
    assert torch.equal(new.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)  # the backbone is the source's
    assert new.init_source["sha256"] == read_source(str(source_run)).provenance["sha256"]


def test_another_pe_family_starts_fresh_and_says_so(source_run):
    lines = []
    model = vitpe.init_from(str(source_run), num_classes=10, pos_embed="rope_mixed", log=lines.append)
    assert model.pos_embed.name == "rope_mixed"
    assert any(line.startswith("pe sincos2d -> rope_mixed") for line in lines)


def test_freeze_backbone_leaves_every_other_parameter_bit_equal_after_training(source_run, tmp_path):
    """A linear probe through train.py: no gradient, weight decay or EMA drift outside the head."""
    before = model_from_checkpoint(source_run)[0].state_dict()
    assert train_cmd.main(["--init", str(source_run), "--out-dir", str(tmp_path), "--name", "probe", "--set", "train.freeze=backbone",
                              "--set", "train.steps=16", "--set", "train.ema_decay=0.5", "--set", "train.batch_size=32"]) == 0
    state = load_checkpoint(tmp_path / "probe")
    for weights in (state["model"], state["ema"]):
        changed = [k for k in before if not torch.equal(before[k], weights[k])]
        assert changed and all(k.startswith("head.") for k in changed), changed
    assert state["config"]["init"]["source"] == str(source_run) and len(state["config"]["init"]["sha256"]) == 64
    assert (tmp_path / "probe" / "config.yaml").read_text().count(state["config"]["init"]["sha256"]) == 1
    # a fine-tuned run is a run like any other: it rebuilds from its checkpoint and ships
    vitpe.save_pretrained(model_from_checkpoint(tmp_path / "probe")[0], tmp_path / "hf")


def test_an_interrupted_fine_tune_resumes_bit_exactly_and_the_source_is_only_read(source_run, tmp_path):
    import hashlib
    import os
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    digest = hashlib.sha256((source_run / "checkpoint.pt").read_bytes()).hexdigest()
    recipe = ["--init", str(source_run), "--out-dir", str(tmp_path), "--set", "train.freeze=1", "--set", "train.layer_decay=0.6",
              "--set", "model.img_size=24", "--set", "train.steps=12", "--set", "train.batch_size=32", "--pe", "learned+rope_mixed"]
    assert train_cmd.main([*recipe, "--name", "whole"]) == 0
    calls = {"n": 0}

    def hook(optimizer, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)

    handle = register_optimizer_step_post_hook(hook)
    try:
        assert train_cmd.main([*recipe, "--name", "cut"]) == 128 + signal.SIGINT
    finally:
        handle.remove()
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    a, b = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "cut")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert hashlib.sha256((source_run / "checkpoint.pt").read_bytes()).hexdigest() == digest


def test_freeze_n_and_layer_decay_use_timms_groups():
    from timm.optim import create_optimizer_v2

    model = small(depth=3)
    frozen = freeze(model, 2)
    assert "patch_embed.weight" in frozen and "blocks.1.attn.qkv.weight" in frozen and "blocks.2.attn.qkv.weight" not in frozen
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {names[id(p)]: g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    assert not set(frozen) & set(scales)  # frozen parameters are not in the optimizer at all
    # BEiT's rule as timm applies it to timm's own ViTs: block i of L = 3 (and the final norm, with the last block) at
    # decay^(L - i), the embeddings at decay^(L + 1), the head at 1
    assert scales["head.weight"] == 1.0 and scales["norm.weight"] == scales["blocks.2.attn.qkv.weight"] == 0.5
    assert scales["blocks.2.attn.qkv.weight"] == 0.5
    with pytest.raises(ValueError, match="train.freeze=4 must be none, backbone"):
        freeze(model, 4)


def test_the_model_arguments_come_from_the_source(source_run, tmp_path, capsys):
    with pytest.raises(InitError, match="model.embed_dim=64 contradicts .*whose embed_dim is 32"):
        train_cmd.main(["--init", str(source_run), "--out-dir", str(tmp_path), "--set", "model.embed_dim=64"])
    # the config file's model keys give way (tiny.yaml says img_size 16, depth 2 too; finetune.yaml says nothing)
    cfg, source, lines = training.resolve_run(str(ROOT / "configs" / "shapes.yaml"), [f"init.source={source_run}", "model.img_size=24",
                                                                                      "model.drop_path_rate=0.2"])
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.img_size, cfg.model.drop_path_rate) == (32, 2, 24, 0.2)
    assert any("give way" in line for line in lines) and cfg.data.name == "shapes"
    assert not list(tmp_path.iterdir())


def bad(tmp_path, *args):
    r = subprocess.run([sys.executable, "train.py", "--out-dir", str(tmp_path / "runs"), *args], cwd=ROOT, capture_output=True, text=True,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
    return lines[0]


def test_bad_sources_are_one_line_exit_2_and_leave_no_run(tmp_path):
    assert "no such file or folder" in bad(tmp_path, "--init", str(tmp_path / "nope"))
    assert "did you mean 'vit_tiny_patch16_224'" in bad(tmp_path, "--init", "timm:vit_tiny_patch16_22")
    text = tmp_path / "notes.pth"
    text.write_text("not weights")
    assert "is not a weights file" in bad(tmp_path, "--init", "timm:vit_tiny_patch16_224", "--init-weights", str(text))
    assert "nothing is downloaded at run time here" in bad(tmp_path, "--init", "timm:vit_tiny_patch16_224")
    folder = vitpe.save_pretrained(small(), tmp_path / "f")
    (folder / "config.json").write_text((folder / "config.json").read_text().replace('"sincos2d"', '"sincos3d"'))
    assert "unknown positional encoding 'sincos3d'" in bad(tmp_path, "--init", str(folder))
    assert "holds weights without an architecture" in bad(tmp_path, "--init", str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def vit_tiny_file(tmp_path_factory):
    import timm
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("timm") / "vit_tiny.safetensors"
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in randomised(timm.create_model("vit_tiny_patch16_224", pretrained=False)).state_dict().items()}, str(path))
    return path


def test_mismatched_timm_weights_name_the_tensors(tmp_path, vit_tiny_file):
    line = bad(tmp_path, "--init", "timm:vit_small_patch16_224", "--init-weights", str(vit_tiny_file))
    assert "do not fit timm's vit_small_patch16_224 (other shapes: cls_token (1, 1, 192) vs (1, 1, 384)" in line


@pytest.mark.parametrize("size", [224, 160])
def test_a_timm_model_from_a_file_equals_timms_own_at_its_size_and_a_new_one(vit_tiny_file, size):
    import timm

    ours = vitpe.init_from("timm:vit_tiny_patch16_224", weights=str(vit_tiny_file), num_classes=1000, img_size=size).eval()
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=size,
                               pretrained_cfg_overlay=dict(file=str(vit_tiny_file))).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        a = ours.forward_head(ours.forward_features(x), pre_logits=True)
        b = theirs.forward_head(theirs.forward_features(x), pre_logits=True)
    assert (a - b).abs().max() < 1e-3


def test_train_py_fine_tunes_a_timm_model_on_a_folder(tmp_path, vit_tiny_file):
    """--init timm:NAME --init-weights FILE through train.py: timm's architecture at a new size, a new head for the
    folder's classes, the weights' sha256 recorded."""
    from PIL import Image

    for split, n in (("train", 16), ("test", 8)):
        for i in range(n):
            (tmp_path / "folder" / split / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            Image.fromarray((torch.rand(40, 40, 3) * 255).to(torch.uint8).numpy()).save(tmp_path / "folder" / split / f"c{i % 2}" / f"{i}.png")
    assert train_cmd.main(["--init", "timm:vit_tiny_patch16_224", "--init-weights", str(vit_tiny_file), "--data",
                              f"imagefolder:{tmp_path / 'folder'}", "--set", "model.img_size=32", "--epochs", "1", "--set", "train.batch_size=8",
                              "--out-dir", str(tmp_path / "runs"), "--name", "t"]) == 0
    state = load_checkpoint(tmp_path / "runs" / "t")
    cfg = state["config"]
    assert (cfg["model"]["embed_dim"], cfg["model"]["depth"], cfg["model"]["img_size"], cfg["model"]["patch_size"]) == (192, 12, 32, 16)
    assert cfg["init"]["sha256"] == __import__("hashlib").sha256(vit_tiny_file.read_bytes()).hexdigest()
    assert state["model"]["head.weight"].shape == (2, 192) and state["data"]["classes"] == ["c0", "c1"]


def test_a_timm_model_keeps_its_own_square_size_when_none_is_given(tmp_path, vit_tiny_file):
    """The README's fine-tune command gives no model.img_size: timm's (224, 224) becomes the run's 224."""
    from vitpe.training import resolve_run

    cfg, source, _ = resolve_run(None, ["init.source=timm:vit_tiny_patch16_224", f"init.weights={vit_tiny_file}", f"out_dir={tmp_path}"])
    assert cfg.model.img_size == 224 and cfg.model.patch_size == 16 and source is not None
