"""Datasets: shapes geometry and rendering, the real loaders on small files in each format, augmentation."""
import gzip
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitpe.cli import train as train_cmd
from vitpe.data import SHAPES_CLASSES, DataError, load_dataset, render_shapes, shapes_params
from vitpe.data import datasets as D
from vitpe.data.augment import BatchAugment


# ---- shapes ----------------------------------------------------------------------------------------
def test_shapes_is_deterministic_and_sliceable():
    a, b = shapes_params(20, seed=3), shapes_params(10, seed=3, start=5)
    for k in a:
        assert torch.equal(a[k][5:15], b[k])
    assert not torch.equal(shapes_params(20, seed=4)["centre"], a["centre"])
    assert torch.equal(render_shapes(a, 32), render_shapes(shapes_params(20, seed=3), 32))


def test_shapes_render_the_same_picture_at_every_resolution():
    p = shapes_params(64, seed=0)
    small = render_shapes(p, 32).float()
    big = render_shapes(p, 128).float()
    down = F.avg_pool2d(big, 4)  # box-filter the 128px rendering to 32px
    assert (down - small).abs().mean() < 3.0  # out of 255: the same scene, up to edge anti-aliasing
    wide = render_shapes(p, (32, 48))
    assert wide.shape == (64, 3, 32, 48) and wide.dtype == torch.uint8


def test_shapes_classes_and_geometry():
    p = shapes_params(4000, seed=0)
    label, c, r = p["label"], p["centre"], p["radius"]
    assert torch.bincount(label, minlength=10).min() > 300 and len(SHAPES_CLASSES) == 10
    two = label >= 5
    # Every shape lies inside the image.
    inside = ((c[:, 0] - r[:, :1]) >= 0) & ((c[:, 0] + r[:, :1]) <= 1)
    assert inside.all()
    inside2 = ((c[two, 1] - r[two, 1:]) >= 0) & ((c[two, 1] + r[two, 1:]) <= 1)
    assert inside2.all()
    # Pairs are apart by more than a patch (1/8 of the image), so no single patch sees both.
    gap = (c[two, 0] - c[two, 1]).norm(dim=-1) - r[two].sum(1)
    assert gap.min() > 0.125
    # Arrangement classes mean what their names say (first shape is the one named first).
    for cls, axis in [(5, 1), (6, 1), (7, 0), (8, 0)]:
        m = label == cls
        assert (c[m, 0, axis] < c[m, 1, axis]).all()
    assert (p["kind"][label == 5] == torch.tensor([0, 1])).all() and (p["kind"][label == 6] == torch.tensor([1, 0])).all()


def test_pair_play_is_the_room_a_pair_had_along_its_axis():
    from vitpe.data.shapes import EDGE_MARGIN, pair_play
    # A circle and a square of radius 0.1 at 0.3 and 0.7 on one axis: 0.17 free on each side of the pair.
    across, along = torch.tensor([0.5, 0.5]), torch.tensor([0.3, 0.7])
    params = {"centre": torch.stack([torch.stack([along, across], -1), torch.stack([across, along], -1),
                                     torch.tensor([[0.5, 0.5], [-10.0, -10.0]])]),
              "radius": torch.full((3, 2), 0.1), "kind": torch.tensor([[0, 1], [0, 1], [0, -1]])}
    play = pair_play(params)
    assert torch.allclose(play[:2], torch.tensor(2 * (0.3 - 0.1 - EDGE_MARGIN), dtype=play.dtype)) and play[2].isnan()
    # On the dataset: never negative, and most pairs have under a patch (1/8 of the image) of it: the room a model
    # without position reads the arrangement from (benchmarks/shapes_leak.py).
    p = shapes_params(2000, seed=0)
    play = pair_play(p)
    two = p["kind"][:, 1] >= 0
    assert (play[two] >= 0).all() and play[~two].isnan().all() and 0.5 < (play[two] < 0.125).float().mean() < 1


def test_on_canvas_keeps_the_scene_at_its_pixel_scale():
    from vitpe.data.shapes import on_canvas
    p = shapes_params(40, seed=5)
    scene = render_shapes(p, 32).int()
    for margin in (8, 16):  # pixels of background on every side
        size = 32 + 2 * margin
        canvas = render_shapes(on_canvas(p, 32 / size), size).int()
        # The centre crop is the scene (rounding of the continued texture moves a pixel by a grey level at most) and
        # the border is background: it differs from the scene's edge only by the texture's few grey levels.
        assert (canvas[..., margin:-margin, margin:-margin] - scene).abs().max() <= 1
        border = canvas[..., :margin, :].float().mean((-1, -2)) - scene[..., :1, :].float().mean((-1, -2))
        assert border.abs().max() < 25
    assert (render_shapes(on_canvas(p, 1.0), 32).int() - scene).abs().max() <= 1  # no margin: the scene itself
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        on_canvas(p, 1.5)


def test_shapes_dataset_split_sizes_and_native_rendering():
    ds = load_dataset("shapes", train_size=50, test_size=20)
    x, y = ds.split(True, (32, 32))
    assert x.shape == (50, 3, 32, 32) and x.dtype == torch.uint8 and y.shape == (50,)
    x64, y64 = ds.split(True, (64, 64))
    assert x64.shape == (50, 3, 64, 64) and torch.equal(y, y64)
    assert not ds.flip_ok and ds.renders_natively and ds.num_classes == 10
    # The classes only position tells apart hold the same two shapes.
    assert ds.position_classes == (5, 6, 7, 8)
    kinds = shapes_params(400, seed=0)
    for c in ds.position_classes:
        assert sorted(kinds["kind"][kinds["label"] == c][0].tolist()) == [0, 1]


def test_unknown_dataset():
    with pytest.raises(DataError, match=r"unknown dataset 'fashion_mnst' \(did you mean 'fashion_mnist'\?\)"):
        load_dataset("fashion_mnst")
    with pytest.raises(DataError, match="unknown dataset 'svhn'; choose one of shapes, gratings, fashion_mnist, cifar10, cifar100, imagefolder:PATH"):
        load_dataset("svhn")


# ---- Fashion-MNIST (IDX files) ----------------------------------------------------------------------
def write_idx(folder: Path, n_train=12, n_test=6, gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        blobs = {f"{prefix}-images-idx3-ubyte": struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes(),
                 f"{prefix}-labels-idx1-ubyte": struct.pack(">II", 2049, n) + labels.tobytes()}
        for name, blob in blobs.items():
            if gz:
                with gzip.open(folder / f"{name}.gz", "wb") as f:
                    f.write(blob)
            else:
                (folder / name).write_bytes(blob)
        out[prefix] = (images, labels)
    return out


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_idx_files_through_torchvision(tmp_path, gz):
    truth = write_idx(tmp_path / "src", gz=gz)
    ds = load_dataset("fashion_mnist", str(tmp_path / "src"))
    x, y = ds.split(True)
    assert x.shape == (12, 1, 28, 28) and torch.equal(x[:, 0], torch.from_numpy(truth["train"][0]))
    assert torch.equal(y, torch.from_numpy(truth["train"][1]).long())
    xt, _ = ds.split(False, (32, 32))
    assert xt.shape == (6, 1, 32, 32)
    assert (tmp_path / "src" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_staged_by_two_processes_at_once(tmp_path, monkeypatch, gz):
    # Two study processes started together stage the same files: a second stager that runs to the end while the first
    # is half-way through a file must leave the first a file to finish (it once renamed the first's temporary away).
    truth = write_idx(tmp_path / "src", gz=gz)
    copy, nested = shutil.copyfileobj, []

    def copy_with_a_rival(fin, fout, *a):
        if not nested:
            nested.append(True)
            D._stage_fashion_mnist(tmp_path / "src")  # the other process, all four files, in the middle of our first
        copy(fin, fout, *a)

    monkeypatch.setattr(D.shutil, "copyfileobj", copy_with_a_rival)
    x, _ = load_dataset("fashion_mnist", str(tmp_path / "src")).split(True)
    assert nested and torch.equal(x[:, 0], torch.from_numpy(truth["train"][0]))
    assert sorted(p.name for p in (tmp_path / "src" / "FashionMNIST" / "raw").iterdir()) == sorted(D._FMNIST_FILES)  # no temporaries left


def test_fashion_mnist_missing_says_the_three_ways(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    monkeypatch.setattr(D, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    monkeypatch.setattr(tvd.FashionMNIST, "download", lambda self: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(DataError, match=r"\(1\) --data-dir DIR .* \(2\) apt-get install dataset-fashion-mnist .* \(3\) run once with internet"):
        load_dataset("fashion_mnist", str(tmp_path / "empty"))


def test_fashion_mnist_corrupt_file(tmp_path):
    write_idx(tmp_path / "src")
    (tmp_path / "src" / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DataError, match="is corrupt"):
        load_dataset("fashion_mnist", str(tmp_path / "src"))


@pytest.mark.skipif(not D.DEBIAN_FASHION_MNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")
def test_real_fashion_mnist_from_debian(tmp_path):
    ds = load_dataset("fashion_mnist", str(tmp_path))
    (x, y), (xt, yt) = ds.split(True), ds.split(False)
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert torch.bincount(y).tolist() == [6000] * 10 and torch.bincount(yt).tolist() == [1000] * 10


# ---- CIFAR (CIFAR's own pickle format) -------------------------------------------------------------
def write_cifar(root: Path, hundred: bool, n=10):
    rng = np.random.default_rng(1)
    if hundred:
        folder, files, key, meta = root / "cifar-100-python", ["train", "test"], "fine_labels", ("meta", "fine_label_names", 100)
    else:
        folder, files = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        key, meta = "labels", ("batches.meta", "label_names", 10)
    folder.mkdir(parents=True)
    truth = {}
    for f in files:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, meta[2], n).tolist()
        with open(folder / f, "wb") as fh:
            pickle.dump({"data": data, key: labels, "batch_label": f}, fh)
        truth[f] = (data, labels)
    with open(folder / meta[0], "wb") as fh:
        pickle.dump({meta[1]: [f"class{i}" for i in range(meta[2])]}, fh)
    return folder, truth


@pytest.mark.parametrize("name, hundred", [("cifar10", False), ("cifar100", True)])
def test_cifar_loads_files_in_cifar_format(tmp_path, name, hundred):
    folder, truth = write_cifar(tmp_path, hundred)
    ds = load_dataset(name, str(tmp_path))
    (x, _), (xt, yt) = ds.split(True), ds.split(False)
    n_train = 10 if hundred else 50
    assert x.shape == (n_train, 3, 32, 32) and xt.shape == (10, 3, 32, 32)
    test_file = "test" if hundred else "test_batch"
    assert torch.equal(xt, torch.from_numpy(truth[test_file][0]).view(10, 3, 32, 32))
    assert yt.tolist() == truth[test_file][1]
    assert ds.num_classes == (100 if hundred else 10) and ds.classes[3] == "class3"


def test_cifar_corrupt_and_missing(tmp_path):
    folder, _ = write_cifar(tmp_path, hundred=False)
    (folder / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="corrupt or not in CIFAR format"):
        load_dataset("cifar10", str(tmp_path))
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="not found in .* put the extracted 'cifar-10-batches-py' folder under --data-dir"):
        load_dataset("cifar10", str(tmp_path))


# ---- imagefolder -----------------------------------------------------------------------------------
def write_images(folder: Path, classes=("cat", "dog"), per_class=6, size=(20, 30), first=0):
    """``per_class`` different images per class (image j has a white row j + first), none the same as another."""
    for i, c in enumerate(classes):
        (folder / c).mkdir(parents=True)
        for j in range(first, first + per_class):
            arr = np.full((*size, 3), 40 + 150 * i, dtype=np.uint8)
            arr[j % size[0], : size[1] - j // size[0]] = 255
            Image.fromarray(arr).save(folder / c / f"{j}.png")


def test_imagefolder_with_and_without_split(tmp_path):
    write_images(tmp_path / "a" / "train")
    write_images(tmp_path / "a" / "val", per_class=2, first=6)
    ds = load_dataset(f"imagefolder:{tmp_path / 'a'}", image_size=(16, 16))
    (x, y), (xt, _) = ds.split(True), ds.split(False)
    assert x.shape == (12, 3, 16, 16) and xt.shape == (4, 3, 16, 16) and ds.classes == ("cat", "dog")
    assert y.tolist() == [0] * 6 + [1] * 6 and abs(x[y == 1].float().mean().item() - 190) < 15
    write_images(tmp_path / "b", per_class=10)
    ds = load_dataset(f"imagefolder:{tmp_path / 'b'}", image_size=(16, 16))
    assert len(ds.split(True)[1]) == 18 and len(ds.split(False)[1]) == 2


def test_imagefolder_bad_input(tmp_path):
    with pytest.raises(DataError, match="is not a directory"):
        load_dataset(f"imagefolder:{tmp_path / 'nope'}")
    write_images(tmp_path / "c")
    (tmp_path / "c" / "cat" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="cannot read image .*broken.png"):
        load_dataset(f"imagefolder:{tmp_path / 'c'}")


def test_train_on_imagefolder(tmp_path):
    write_images(tmp_path / "imgs", per_class=20)
    rc = train_cmd.main(["--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), "--data", f"imagefolder:{tmp_path / 'imgs'}",
                            "--set", "train.batch_size=8", "--epochs", "1", "--out-dir", str(tmp_path / "runs"), "--name", "img"])
    assert rc == 0 and (tmp_path / "runs" / "img" / "checkpoint.pt").is_file()


# ---- augmentation ----------------------------------------------------------------------------------
def test_crop_translates_and_flip_respects_the_dataset():
    torch.manual_seed(0)
    x = torch.arange(2 * 1 * 8 * 8, dtype=torch.uint8).view(2, 1, 8, 8)
    crop = BatchAugment("crop", pad_fraction=0.25)(x)
    assert crop.shape == x.shape and crop.dtype == torch.uint8
    # A translated view: the centre 4x4 of the original appears intact somewhere in the crop.
    for i in range(2):
        centre = x[i, 0, 2:6, 2:6]
        found = any(torch.equal(crop[i, 0, r : r + 4, c : c + 4], centre) for r in range(5) for c in range(5))
        assert found
    no_flip = BatchAugment("crop_flip", flip=False, pad_fraction=0.0)
    assert torch.equal(no_flip(x), x)
    torch.manual_seed(1)
    flips = BatchAugment("crop_flip", pad_fraction=0.0)(x.repeat(32, 1, 1, 1))
    flipped = sum(torch.equal(f, x[i % 2].flip(-1)) for i, f in enumerate(flips))
    assert 0 < flipped < 64
    torch.manual_seed(1)
    mirror_only = BatchAugment("flip")(x.repeat(32, 1, 1, 1))  # no translation: each image is itself or its mirror
    assert all(torch.equal(f, x[i % 2]) or torch.equal(f, x[i % 2].flip(-1)) for i, f in enumerate(mirror_only))
    assert sum(torch.equal(f, x[i % 2].flip(-1)) for i, f in enumerate(mirror_only)) == flipped  # the same draws as crop_flip


@pytest.mark.parametrize("kind", ["trivial", "randaugment"])
@pytest.mark.parametrize("chans", [1, 3])
def test_policy_augmentations_run_on_batches(kind, chans):
    x = torch.randint(0, 256, (64, chans, 32, 32), dtype=torch.uint8)
    torch.manual_seed(0)
    a = BatchAugment(kind)(x)
    torch.manual_seed(0)
    b = BatchAugment(kind)(x)
    assert a.shape == x.shape and a.dtype == torch.uint8 and torch.equal(a, b) and not torch.equal(a, x)


def test_imagefolder_keeps_each_images_aspect_ratio_for_mixed_size_batches(tmp_path):
    from vitpe.data.mixed import draw_sizes, mixed_batch, native_sizes

    write_images(tmp_path / "w", per_class=3, size=(20, 40))  # wide: w/h = 2
    write_images(tmp_path / "t" / "cat", classes=("a",), per_class=3, size=(45, 15))  # tall: w/h = 1/3
    ds = load_dataset(f"imagefolder:{tmp_path / 'w'}", image_size=(16, 16))
    aspects = ds.aspects(True)
    assert aspects is not None and torch.allclose(aspects, torch.full_like(aspects, 2.0), atol=0.1)
    sizes = native_sizes(aspects, 16, 4)
    assert set(sizes) == {(12, 24)}  # the area of 16x16 at aspect 2, in whole patches
    x = ds.images_at(True, torch.tensor([0, 1]), (12, 24))
    assert x.shape == (2, 3, 12, 24) and x.dtype == torch.uint8
    torch.manual_seed(0)
    drawn = draw_sizes(50, [8, 16, 24], 4, aspects[:1].expand(50))
    assert all(w > h for h, w in drawn) and len(set(drawn)) == 3  # every scale, always the image's own shape
    packed = mixed_batch(ds, True, torch.arange(4), sizes[:4], 4, 64)
    assert packed.num_images == 4 and packed.num_tokens == 4 * 18
    assert load_dataset("shapes", train_size=8, test_size=8).aspects(True) is None


def test_shapes_render_subsets_at_any_size_and_aspect():
    ds = load_dataset("shapes", train_size=16, test_size=8)
    full = ds.split(True, (24, 40))[0]
    assert torch.equal(ds.images_at(True, torch.tensor([3, 7]), (24, 40)), full[[3, 7]])


def test_test_time_views_are_the_image_its_mirror_and_its_one_pixel_shifts():
    from vitpe.data.augment import TTA_MODES, tta_views

    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).reshape(2, 3, 5, 6)
    assert [len(tta_views(x, m)) for m in TTA_MODES] == [1, 2, 5, 6]
    plain, mirror = tta_views(x, "flip")
    assert plain is x and torch.equal(mirror, x.flip(-1))
    up, down, left, right = tta_views(x, "shift")[1:]
    # Each view is the image moved by one pixel: inside, view[i] = x[i + d]; at the edge reflect padding fills in.
    assert torch.equal(up[..., 1:, :], x[..., :-1, :]) and torch.equal(down[..., :-1, :], x[..., 1:, :])
    assert torch.equal(left[..., :, 1:], x[..., :, :-1]) and torch.equal(right[..., :, :-1], x[..., :, 1:])
    assert all(v.shape == x.shape for v in tta_views(x, "flip_shift"))
    with pytest.raises(ValueError, match="unknown test-time augmentation 'rotate'; choose one of none, flip, shift, flip_shift"):
        tta_views(x, "rotate")


def test_evaluate_with_test_time_views_averages_the_probabilities():
    import vitpe
    from vitpe.data.augment import normalize, tta_views
    from vitpe.evaluation import evaluate

    torch.manual_seed(0)
    model = vitpe.VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=4, embed_dim=16, depth=1, num_heads=2).eval()
    images, labels = torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8), torch.randint(0, 4, (40,))
    got = evaluate(model, images, labels, (0.5,), (0.25,), batch_size=16, tta="flip_shift")
    with torch.no_grad():
        probs = sum(model(v).softmax(-1) for v in tta_views(normalize(images, (0.5,), (0.25,)), "flip_shift")) / 6
    assert got["top1"] == pytest.approx((probs.argmax(1) == labels).float().mean().item())
    assert got["loss"] == pytest.approx(F.nll_loss(probs.log(), labels).item(), rel=1e-5)
    plain = evaluate(model, images, labels, (0.5,), (0.25,), batch_size=16)
    assert plain["loss"] != pytest.approx(got["loss"])  # the views changed the predictions


def test_evaluate_gives_each_batch_the_coordinates_grid_of_returns():
    import vitpe
    from vitpe.data.augment import normalize
    from vitpe.evaluation import evaluate

    torch.manual_seed(0)
    model = vitpe.VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=4, embed_dim=16, depth=1, num_heads=2,
                                    pos_embed="sincos2d").eval()
    images, labels = torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8), torch.randint(0, 4, (40,))
    own = model.patch_grid((2, 2), torch.device("cpu"))
    flipped = vitpe.PatchGrid.from_coords(own.coords.flip(0), own.size, own.ref)  # the tokens' positions reversed
    calls = []

    def grid_of(m, x):
        calls.append(x.shape[0])
        return flipped

    got = evaluate(model, images, labels, (0.5,), (0.25,), batch_size=16, grid_of=grid_of)
    assert calls == [16, 16, 8]  # once per batch, on the batch the model sees
    with torch.no_grad():
        logits = model(normalize(images, (0.5,), (0.25,)), grid=flipped)
    assert got["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert got["loss"] != pytest.approx(evaluate(model, images, labels, (0.5,), (0.25,), batch_size=16)["loss"])


def test_the_resize_route_shrinks_by_exact_area_so_a_larger_rendering_comes_back_as_the_smaller_one():
    """eval.py's resize baseline: an exact area average (a box filter) when shrinking. Rows of its weights sum to 1; a
    2x shrink is a 2x2 mean; and the 64-px gratings rendering shrunk to 32 px is the 32-px rendering, far closer than
    bilinear-antialiased resizing brings it (which would make the baseline lose accuracy it should keep)."""
    import torch.nn.functional as F

    from vitpe.data.datasets import area_weights, resize_images, shrink_to

    for n_in, n_out in ((64, 32), (48, 32), (7, 3)):
        w = area_weights(n_in, n_out)
        assert w.shape == (n_out, n_in) and torch.allclose(w.sum(1), torch.ones(n_out))
    x = torch.randint(0, 256, (2, 3, 16, 12), dtype=torch.uint8)
    assert torch.equal(shrink_to(x, (8, 6)), F.avg_pool2d(x.float(), 2).round().to(torch.uint8))
    assert torch.equal(shrink_to(x, (32, 24)), resize_images(x, (32, 24)))  # growing: bilinear
    mixed = shrink_to(x, (8, 24))  # rows averaged by area, columns stretched
    assert torch.equal(mixed, resize_images(shrink_to(x, (8, 12)), (8, 24)))
    ds = load_dataset("gratings", train_size=4, test_size=64)
    small, _ = ds.split(False, (32, 32))
    large, _ = ds.split(False, (64, 64))
    area = (shrink_to(large, (32, 32)).float() - small.float()).abs().mean()
    bilinear = (resize_images(large, (32, 32)).float() - small.float()).abs().mean()
    assert area < 1.0 and area < bilinear / 3
