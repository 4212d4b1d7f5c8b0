"""Content scale augmentation: RandomResizedCrop's boxes, cropped and resized once, or rendered at the new scale."""
import pytest
import torch
from conftest import ROOT

from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError
from vitpe.data import load_dataset
from vitpe.data.augment import crop_boxes, crop_resize
from vitpe.data.shapes import render_shapes, shapes_params, zoomed

TINY = str(ROOT / "configs" / "tiny.yaml")


def test_boxes_cover_the_asked_share_of_the_image_and_stay_inside_it():
    torch.manual_seed(0)
    b = crop_boxes(4000, (0.25, 0.64), (0.5, 2.0))
    x0, y0, w, h = b.unbind(-1)
    assert (x0 >= 0).all() and (y0 >= 0).all() and (x0 + w <= 1 + 1e-6).all() and (y0 + h <= 1 + 1e-6).all()
    area, ratio = w * h, w / h
    assert area.min() > 0.2 and area.max() <= 0.64 + 1e-6 and 0.5 - 1e-5 <= ratio.min() and ratio.max() <= 2.0 + 1e-5
    assert abs(area.median().item() - 0.445) < 0.03  # uniform in area (a clamped box only where it would leave the image)
    square = crop_boxes(100, (0.1, 1.0), square=True)
    assert torch.equal(square[:, 2], square[:, 3])


def test_a_crop_is_the_box_enlarged_and_a_rendered_zoom_is_the_larger_rendering():
    image = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8) * 4  # a ramp, to see where pixels come from
    whole = crop_resize(image, torch.tensor([[0.0, 0.0, 1.0, 1.0]]), (8, 8))
    assert torch.equal(whole, image)  # the whole image, at its size: unchanged
    quarter = crop_resize(image, torch.tensor([[0.5, 0.5, 0.5, 0.5]]), (4, 4))
    assert torch.equal(quarter, image[..., 4:, 4:])  # a box at the same pixel scale: its pixels
    params = shapes_params(6, seed=2)
    big = render_shapes(params, 64)
    zoom = render_shapes(zoomed(params, torch.tensor([[0.25, 0.25, 0.5, 0.5]] * 6)), 32)
    assert torch.equal(zoom, big[..., 16:48, 16:48])  # rendered at twice the scale: no resampling at all
    ds = load_dataset("shapes", None, 64, 32, (32, 32))
    boxes = torch.tensor([[0.25, 0.25, 0.5, 0.5]] * 3)
    assert torch.equal(ds.images_at(True, torch.arange(3), (32, 32), boxes), ds.images_at(True, torch.arange(3), (64, 64))[..., 16:48, 16:48])


@pytest.mark.parametrize("extra", [[], ["--set", "train.max_tokens=64", "--set", "train.resolutions=[8, 16]"]])
def test_training_with_content_scale_augmentation(tmp_path, monkeypatch, extra):
    """Every training batch is drawn through boxes (with per-image coordinate augmentation, and packed)."""
    from vitpe.data.datasets import ImageDataset

    seen, images_at = [], ImageDataset.images_at
    monkeypatch.setattr(ImageDataset, "images_at", lambda self, *a, **k: seen.append(a[3] if len(a) > 3 else None) or images_at(self, *a, **k))
    args = ["--config", TINY, "--out-dir", str(tmp_path), "--name", "r", "--epochs", "1", "--set", "data.crop_scale=[0.3, 1.0]",
            "--set", "model.coord_aug={shift: 1.0, rescale: 1.5}", *extra]
    assert train_cmd.main(args) == 0
    boxes = [b for b in seen if b is not None]
    assert boxes and len(boxes) == len(seen) and all(((b[:, 2] * b[:, 3]) >= 0.3 - 1e-6).all() for b in boxes)


@pytest.mark.parametrize("key, value, message", [
    ("data.crop_scale", "[0.0, 1.0]", r"data.crop_scale=\[0.0, 1.0\] must be \[min, max\] with 0 < min <= max <= 1"),
    ("data.crop_scale", "[0.8, 0.2]", "must be"), ("data.crop_scale", "[0.2, 1.5]", "fractions of the image's area"),
    ("data.crop_ratio", "[2.0, 1.0]", r"data.crop_ratio=\[2.0, 1.0\] must be \[min, max\] with 0 < min <= max: width / height"),
])
def test_content_scale_augmentation_out_of_range_is_one_line(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--set", f"{key}={value}"])


def test_gratings_render_each_pixel_as_the_average_of_the_scene():
    """A gratings pixel is the scene's mean over its area: rendering at 8x and averaging 8x8 blocks gives the 1x
    rendering (to a few grey levels: the sinc model is exact for the grating, the edge's ramp is one pixel wide), and
    at 1x the finest grating has lost most of its contrast where the 2x rendering keeps it."""
    from vitpe.data.gratings import CYCLES, GRATINGS_CLASSES, gratings_params, render_gratings, zoomed_gratings

    params = gratings_params(40, seed=4)
    fine = render_gratings(params, 256).float()
    coarse = render_gratings(params, 32).float()
    averaged = torch.nn.functional.avg_pool2d(fine, 8)
    inner = (slice(None), slice(None), slice(2, -2), slice(2, -2))
    assert (averaged - coarse)[inner].abs().mean() < 2.0
    finest = params["cycles"] == CYCLES[-1]

    def contrast(size: int) -> torch.Tensor:  # the grating's spread inside the object (its inner 70%), per sample
        x = render_gratings(params, size).float().mean(1)
        centres = (torch.arange(size) + 0.5) / size
        d = ((centres[None, None, :] - params["centre"][:, None, None, :1].squeeze(-1)) ** 2
             + (centres[None, :, None] - params["centre"][:, None, None, 1:].squeeze(-1)) ** 2).sqrt()
        inside = d < 0.7 * params["radius"][:, None, None]
        return torch.stack([x[i][inside[i]].std() for i in range(len(x))])

    assert finest.any() and (contrast(32)[finest] < 0.6 * contrast(64)[finest]).all()
    big = render_gratings(params, 64)
    zoom = render_gratings(zoomed_gratings(params, torch.tensor([[0.25, 0.25, 0.5, 0.5]] * 40)), 32)
    assert torch.equal(zoom, big[..., 16:48, 16:48])  # content scale augmentation renders, it does not resample
    ds = load_dataset("gratings", None, 500, 100, (32, 32))
    x, y = ds.split(True)
    assert x.shape == (500, 3, 32, 32) and ds.classes == GRATINGS_CLASSES and ds.flip_ok and ds.renders_natively
    assert torch.bincount(y, minlength=10).min() > 25  # every class drawn
    assert torch.equal(ds.split(True)[0][:5], load_dataset("gratings", None, 5, 100, (32, 32)).split(True)[0])  # any prefix, the same
