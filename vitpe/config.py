"""Typed, validated run configuration: YAML files in ``configs/`` plus ``--set section.key=value`` overrides.

Unknown keys and ill-typed values raise :class:`ConfigError` with one line saying what is wrong and
what is valid. The resolved config is saved in every run directory and inside every checkpoint.
"""
import dataclasses
import importlib.util
import inspect
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml

from .data.augment import AUGMENTS, TTA_MODES
from .engine import AMP_MODES
from .errors import VitpeError
from .suggest import did_you_mean
from .vit import VisionTransformer, check_model_args

__all__ = ["ConfigError", "ModelConfig", "DataConfig", "TrainConfig", "InitConfig", "Config", "load_config", "apply_overrides", "train_resolutions",
           "resolution_stages", "sizes_at", "schedule_text", "size_span", "stage_sizes", "step_cost", "budget_epochs", "batch_at", "steps_in_epoch",
           "steps_before", "shipped_configs", "shipped_config_names", "config_path"]


class ConfigError(VitpeError):
    """A config file or override that cannot be used as given."""

    exit_code = 2


# The model's arguments are described once, by VisionTransformer's signature (its types and its checks,
# vit.check_model_args); a config's model section is that signature less what the dataset sets, with the main job's
# model as its defaults instead of the class's ImageNet-sized ones. A new model argument is configurable at once.
SET_BY_DATA = ("num_classes", "in_chans")
MAIN_JOB_MODEL = {"img_size": 32, "patch_size": 4, "depth": 6, "mlp_ratio": 2.0, "drop_path_rate": 0.1}


def _model_config_class() -> type:
    fields = []
    hints = typing.get_type_hints(VisionTransformer.__init__)
    for name, param in inspect.signature(VisionTransformer.__init__).parameters.items():
        if name == "self" or name in SET_BY_DATA:
            continue
        tp, default = hints[name], MAIN_JOB_MODEL.get(name, param.default)
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is Union and default is None and inner and typing.get_origin(inner[0]) in (dict, Dict):
            fields.append((name, Dict[str, Any], field(default_factory=dict)))  # an empty mapping, never None, in a config
        elif typing.get_origin(tp) is Union and type(None) not in typing.get_args(tp):
            fields.append((name, inner[0], field(default=default)))  # img_size: one int in a config (the class takes (h, w) too)
        else:
            fields.append((name, tp, field(default=f"{default}" if isinstance(default, str) else default)))  # a str enum as text
    cls = dataclasses.make_dataclass(
        "ModelConfig", fields,
        namespace={"__doc__": "The arguments of :class:`vitpe.VisionTransformer` (its signature, less ``num_classes`` and "
                              "``in_chans``, which the dataset sets), with the main job's model as defaults."})
    cls.__module__ = __name__  # vitpe.config.ModelConfig, as a class written here would be (pickle, repr)
    return cls


ModelConfig = _model_config_class()


@dataclass
class DataConfig:
    name: str = "shapes"  # a name of vitpe.data.DATASETS (imagefolder:PATH: your own images; shards:PATH: them as tar shards)
    data_dir: Optional[str] = None  # where datasets live or are downloaded to (default: ./data)
    train_size: Optional[int] = None  # shapes: samples to generate; others: a subset (None: all)
    test_size: Optional[int] = None
    augment: str = "none"  # none | flip | crop | crop_flip | trivial | randaugment
    # Content scale augmentation (RandomResizedCrop, as DeiT and RoPE-ViT train): each training image is a random box
    # covering this fraction of its area, [min, max], enlarged to the training size (None: off). Data rendered at any
    # size (shapes) renders the box at the new scale; others crop and resize once.
    crop_scale: Optional[List[float]] = None
    crop_ratio: List[float] = field(default_factory=lambda: [0.75, 1.3333])  # the box's width / height, [min, max]
    mixup: float = 0.0  # mixup alpha (0: off)
    cutmix: float = 0.0  # cutmix alpha (0: off)
    # An image folder read a batch at a time (true) or held in memory (false); null chooses from the folder's size and
    # the memory available, and the run's first note says which. A resumed run keeps its choice.
    stream: Optional[bool] = None
    # DataLoader processes that decode the next batches while a step runs (null: 2 for data read a batch at a time on a
    # machine of more than 2 cores, else 0: on 2 cores workers take the cores a step needs, and data held in memory is
    # sliced faster in the training process than it is sent from another; docs/data.md).
    workers: Optional[int] = None
    # Data read a batch at a time: keep each training picture decoded, at the size the run's crops need, in a file in
    # the run's folder (deleted when the run stops), so that it is decoded once, not at every use (null: when that size
    # is 128x128 or less, where a decode costs about as much as the step's share of a picture; docs/data.md).
    cache: Optional[bool] = None


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 128  # global batch, split across processes under torchrun
    lr: float = 1e-3  # peak learning rate of AdamW
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    grad_clip: float = 1.0  # max gradient norm (0: off)
    ema_decay: float = 0.0  # model EMA decay (0: off); evaluation then uses the EMA weights
    amp: str = "auto"  # auto (bf16 on CUDA; on a CPU measured in the first seconds of a run: bf16 where faster) | bf16 | fp16 | none
    compile: bool = False  # torch.compile the model
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eval_batch_size: int = 512
    eval_tta: str = "none"  # one more evaluation after the last epoch, averaging over test-time views: none | flip | shift | flip_shift
    resolutions: Optional[List[int]] = None  # multi-resolution training: a size drawn per batch from this set
    resolution_range: Optional[List[int]] = None  # ... or from every multiple of the patch size in [lo, hi]
    # Sizes that change over the run: stages [from, size] or [from, lo, hi], ``from`` the fraction of the epochs at which
    # the stage begins (the first at 0), e.g. [[0, 16, 24], [0.6, 28], [0.9, 32]]: small and cheap first, the size the
    # model will be used at last (FixRes). Each stage draws a size per batch as resolution_range does.
    resolution_schedule: Optional[List[List[float]]] = None
    # What a step of a schedule keeps: its images (train.batch_size at every size) or its patch tokens (as many tokens
    # as train.batch_size images at the schedule's largest size: more images a step at the smaller sizes, fewer steps).
    schedule_batch: str = "images"  # images | tokens
    token_keep: float = 1.0  # keep this fraction of each image's patch tokens while training, a random subset per image (FLIP)
    max_tokens: Optional[int] = None  # pack images of mixed sizes and aspect ratios into rows of this many patch tokens (NaViT)
    time_limit_min: Optional[float] = None  # stop cleanly (with a checkpoint) after this many minutes
    # Fit the run into this many minutes of training steps: train.epochs becomes the most whole epochs that fit at the
    # step rate measured in the run's first steps (recorded in its config.yaml).
    budget_min: Optional[float] = None
    # Train for about this many optimizer steps, whatever the data's size: train.epochs becomes the steps over the steps
    # per epoch, rounded up (a recipe for image folders of any size). train.warmup_steps: its warm-up (default: 5%).
    steps: Optional[int] = None
    warmup_steps: Optional[int] = None
    dist_timeout_s: float = 600.0  # torchrun: a rank that does not answer for this long stops the run with a message
    tensorboard: bool = False  # also write each epoch's metrics as TensorBoard event files in RUN/tensorboard (pip install tensorboard)
    # Fine-tuning (init.source): layer-wise learning-rate decay (BEiT/MAE; timm's optimizer helper): block i of L trains at
    # lr * layer_decay^(L - i), the embeddings at lr * layer_decay^(L + 1), the head at lr (None: off).
    layer_decay: Optional[float] = None
    freeze: str = "none"  # none | backbone (only the head trains: a linear probe) | N (the embeddings and the first N blocks frozen)


@dataclass
class InitConfig:
    """What a run starts from (train.py --init SOURCE): None, a fresh model; else a vitpe run directory or checkpoint, a
    save_pretrained folder (vitpe's or timm's layout) or timm:NAME. The model section is then the source's architecture."""

    source: Optional[str] = None
    weights: Optional[str] = None  # with timm:NAME: its weights (.safetensors, .pth, .bin); without, timm's hub
    sha256: Optional[str] = None  # of the weights file read, recorded when the run starts; a later run from this config checks it


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    init: InitConfig = field(default_factory=InitConfig)
    out_dir: str = "runs"
    name: Optional[str] = None  # run directory name under out_dir (default: data-pe-timestamp)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` as type ``tp`` (ints accepted for floats; ``5e-4``, which YAML 1.1 reads as a string,
    accepted as a number; ints and floats accepted for strings, e.g. a run named 2024), or raise ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:  # a choice: its values' type here, the choice itself in the model's checks (with a did-you-mean)
        return _check_type(value, type(args[0]), where)
    if origin is Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], where)
    if tp is Any:
        return value
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if origin in (list, List, tuple, Tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_check_type(v, args[0], f"{where}[]") for v in value] if args else list(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    if tp is int and isinstance(value, str) and re.fullmatch(r"[-+]?\d+", value.strip()):
        return int(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where} must be {getattr(tp, '__name__', tp)}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: Dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(
            f"unknown config key {where + '.' if where else ''}{unknown[0]}{did_you_mean(unknown[0], names)}; valid keys: {', '.join(names)}"
        )
    kwargs = {}
    for k, v in data.items():
        key = f"{where}.{k}" if where else k
        kwargs[k] = _build(hints[k], v, key) if dataclasses.is_dataclass(hints[k]) else _check_type(v, hints[k], key)
    return cls(**kwargs)


MAX_CONFIG_VALUES = 100_000  # far beyond any real config; YAML aliases can make a few lines stand for billions


def _expanded_size(node: Any, memo: Dict[int, int]) -> int:
    """How many values ``node`` holds once every shared (aliased) part is copied out, as ``dataclasses.asdict`` and
    ``yaml.safe_dump`` would; counted once per distinct object, so an alias bomb is measured without being expanded."""
    if not isinstance(node, (dict, list, tuple)):
        return 1
    key = id(node)
    if key not in memo:
        memo[key] = MAX_CONFIG_VALUES + 1  # a cycle (an alias of an enclosing node) never ends: too large
        children = list(node.values()) + list(node.keys()) if isinstance(node, dict) else list(node)
        total = 1
        for child in children:
            total += _expanded_size(child, memo)
            if total > MAX_CONFIG_VALUES:
                break
        memo[key] = total
    return memo[key]


def config_from_dict(data: Dict[str, Any]) -> Config:
    size = _expanded_size(data, {})
    if size > MAX_CONFIG_VALUES:
        raise ConfigError(f"the config holds more than {MAX_CONFIG_VALUES:,} values once its YAML aliases (&name / *name) are "
                          "expanded; write the values out, without nested aliases")
    cfg = _build(Config, data, "")
    _validate(cfg)
    return cfg


def _validate(cfg: Config) -> None:
    choices = {
        "data.augment": (cfg.data.augment, AUGMENTS),
        "train.amp": (cfg.train.amp, AMP_MODES),
        "train.eval_tta": (cfg.train.eval_tta, TTA_MODES),
        "train.schedule_batch": (cfg.train.schedule_batch, ("images", "tokens")),
    }
    for key, (value, valid) in choices.items():
        if value not in valid:
            raise ConfigError(f"{key}={value!r} is not valid{did_you_mean(value, valid)}; choose one of {', '.join(valid)}")
    if cfg.train.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard=true needs the tensorboard package, which is not installed: pip install tensorboard "
                          "(or pip install -e '.[tensorboard]'), or leave train.tensorboard off")
    if cfg.train.tensorboard is True:
        try:  # installed is not importable (a protobuf or numpy it was not built for): said now, before a run folder exists
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except Exception as e:
            raise ConfigError(f"train.tensorboard=true: the tensorboard package is installed but does not import ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}); reinstall it (pip install -U tensorboard), or leave "
                              "train.tensorboard off") from None
    m, d, t = cfg.model, cfg.data, cfg.train
    try:  # the model's own checks, its family and options included: a typo is refused here, before any data is read
        check_model_args(dataclasses.asdict(m))
    except ValueError as e:
        raise ConfigError(f"model.{e}") from None
    ranges = [  # key, value, lowest, highest, lowest included, highest included
        ("data.train_size", d.train_size, 1, None, True, True), ("data.test_size", d.test_size, 1, None, True, True),
        ("data.mixup", d.mixup, 0, None, True, True), ("data.cutmix", d.cutmix, 0, None, True, True),
        ("data.workers", d.workers, 0, None, True, True),
        ("train.epochs", t.epochs, 1, None, True, True), ("train.batch_size", t.batch_size, 1, None, True, True),
        ("train.lr", t.lr, 0, None, False, True), ("train.min_lr", t.min_lr, 0, None, True, True),
        ("train.weight_decay", t.weight_decay, 0, None, True, True), ("train.warmup_epochs", t.warmup_epochs, 0, None, True, True),
        ("train.label_smoothing", t.label_smoothing, 0, 1, True, False), ("train.grad_clip", t.grad_clip, 0, None, True, True),
        ("train.ema_decay", t.ema_decay, 0, 1, True, False), ("train.eval_batch_size", t.eval_batch_size, 1, None, True, True),
        ("train.time_limit_min", t.time_limit_min, 0, None, False, True), ("train.token_keep", t.token_keep, 0, 1, False, True),
        ("train.budget_min", t.budget_min, 0, None, False, True), ("train.steps", t.steps, 1, None, True, True),
        ("train.warmup_steps", t.warmup_steps, 0, None, True, True),
        ("train.max_tokens", t.max_tokens, 1, None, True, True), ("train.dist_timeout_s", t.dist_timeout_s, 0, None, False, True),
        ("train.layer_decay", t.layer_decay, 0, 1, False, True),
    ]
    for key, value, lo, hi, lo_in, hi_in in ranges:
        if value is None:
            continue
        below = value < lo if lo_in else value <= lo
        above = hi is not None and (value > hi if hi_in else value >= hi)
        if below or above or value != value:  # NaN compares false with everything: out of every range
            span = f"{'[' if lo_in else '('}{lo}, {hi if hi is not None else 'inf'}{']' if hi_in and hi is not None else ')'}"
            raise ConfigError(f"{key}={value} is out of range; it must be in {span}")
    for key, pair, upper in (("data.crop_scale", d.crop_scale, 1.0), ("data.crop_ratio", d.crop_ratio, None)):
        if pair is None:
            continue
        if len(pair) != 2 or not 0 < pair[0] <= pair[1] or (upper is not None and pair[1] > upper) or pair[0] != pair[0]:
            limits = "0 < min <= max <= 1: fractions of the image's area" if upper else "0 < min <= max: width / height"
            raise ConfigError(f"{key}={list(pair)} must be [min, max] with {limits}, e.g. " + ("[0.35, 1.0]" if upper else "[0.75, 1.33]"))
    try:
        frozen_spec(t.freeze, m.depth)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if d.name.startswith("shards:"):
        if d.stream is False:
            raise ConfigError("data.stream=false: tar shards are read in order, a batch at a time, never held in memory; drop data.stream")
        if t.max_tokens is not None:
            raise ConfigError(f"train.max_tokens packs pictures chosen by index and {d.name} is read in order; train on the image folder "
                              "(imagefolder:PATH) to pack, or drop train.max_tokens")
    elif d.cache and not d.name.startswith("imagefolder:"):
        raise ConfigError(f"data.cache=true keeps pictures read from files decoded; {d.name} is held in memory already; drop data.cache")
    elif d.stream and not d.name.startswith("imagefolder:"):
        raise ConfigError(f"data.stream=true reads an image folder a batch at a time; {d.name} is held in memory, as its own "
                          "files are; drop data.stream (data.workers=2 decodes its batches in DataLoader workers)")
    if cfg.init.weights is not None and not (cfg.init.source or "").startswith("timm:"):
        raise ConfigError("init.weights (--init-weights) goes with init.source=timm:NAME; a run or a folder carries its own weights")
    if t.warmup_steps is not None and t.steps is None:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} is the warm-up of a train.steps run and this run counts epochs; "
                          "set train.steps too, or give the warm-up as train.warmup_epochs")
    if t.steps is not None and t.budget_min is not None:
        raise ConfigError(f"train.steps={t.steps} and train.budget_min={t.budget_min:g} both decide the epochs; drop one")
    p = cfg.model.patch_size
    given = [k for k in ("resolutions", "resolution_range", "resolution_schedule") if getattr(cfg.train, k) is not None]
    if len(given) > 1:
        raise ConfigError(f"set one of train.{' and train.'.join(given)}: each says which sizes training draws (a schedule's "
                          "stages take a size or a range each)")
    if t.resolution_schedule is not None:
        _check_schedule(t.resolution_schedule, p)
    if t.schedule_batch == "tokens" and t.resolution_schedule is None:
        raise ConfigError("train.schedule_batch=tokens sizes each stage's batch of a train.resolution_schedule; set one, or drop it")
    if t.schedule_batch == "tokens" and t.steps is not None:
        raise ConfigError(f"train.steps={t.steps} counts steps of one size and train.schedule_batch=tokens changes their size by "
                          "stage: give train.epochs, or keep the batch in images")
    bad = [r for r in (cfg.train.resolutions or []) if r < p or r % p]
    if bad or cfg.train.resolutions == []:
        raise ConfigError(f"train.resolutions must be non-empty multiples of model.patch_size={p}, got {cfg.train.resolutions}")
    rng = cfg.train.resolution_range
    if rng is not None and (len(rng) != 2 or rng[0] > rng[1] or not train_resolutions(cfg)):
        raise ConfigError(f"train.resolution_range must be [lo, hi] containing a multiple of model.patch_size={p}, got {rng}")
    if t.max_tokens is not None:
        largest = max(train_resolutions(cfg))
        need = (largest // p) ** 2
        if t.max_tokens < need:
            raise ConfigError(f"train.max_tokens={t.max_tokens} is smaller than one image: the largest training size {largest}x{largest} "
                              f"has {need} patch tokens; raise train.max_tokens to at least {need} (or train at smaller sizes)")
        if m.content_keep < 1:
            raise ConfigError(f"model.content_keep={m.content_keep:g} selects tokens from whole images; packed training (train.max_tokens) "
                              "brings its own: set model.content_keep=1 or drop train.max_tokens")
        if d.mixup > 0 or d.cutmix > 0:
            raise ConfigError("mixup/cutmix blend images of one size; packed mixed-size training (train.max_tokens) cannot: "
                              "set data.mixup=0 and data.cutmix=0, or drop train.max_tokens")


def frozen_spec(value: str, depth: Optional[int] = None) -> Union[str, int]:
    """``train.freeze``'s value: ``"none"``, ``"backbone"`` or a number of blocks N (0 <= N <= depth); ValueError else."""
    text = str(value).strip()
    if text in ("none", "backbone"):
        return text
    if text.isdigit() and (depth is None or int(text) <= depth):
        return int(text)
    top = f" (this model has {depth} blocks)" if depth is not None else ""
    raise ValueError(f"train.freeze={value!r} must be none, backbone (only the head trains: a linear probe) or a number of blocks N "
                     f"(the embeddings and the first N blocks frozen){top}")


def _check_schedule(stages: List[List[float]], patch: int) -> None:
    example = "e.g. [[0, 16, 24], [0.6, 28], [0.9, 32]]"
    if not stages:
        raise ConfigError(f"train.resolution_schedule must hold at least one stage [from, size] or [from, lo, hi], {example}")
    starts = []
    for stage in stages:
        if len(stage) not in (2, 3) or any(v != int(v) or v < 1 for v in stage[1:]):
            raise ConfigError(f"train.resolution_schedule's stage {stage} must be [from, size] or [from, lo, hi] with whole "
                              f"sizes, {example}")
        if not stage_sizes(stage, patch):
            raise ConfigError(f"train.resolution_schedule's stage {stage} holds no multiple of model.patch_size={patch}")
        starts.append(stage[0])
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= 1:
        raise ConfigError(f"train.resolution_schedule's stages must begin at fractions of the run that rise from 0 and stay "
                          f"below 1, got {starts}; {example}")


def stage_sizes(stage: Sequence[float], patch: int) -> List[int]:
    """The sizes one stage ``[from, size]`` or ``[from, lo, hi]`` draws from: the multiples of ``patch`` in its range."""
    lo, hi = int(stage[1]), int(stage[-1])
    return [r for r in range(max(patch, -(-lo // patch) * patch), hi + 1, patch)]


def resolution_stages(cfg: Config, epochs: Optional[int] = None) -> List[Tuple[int, List[int]]]:
    """``(first epoch, sizes)`` of each stage of ``cfg``'s sizes over its ``train.epochs`` (or ``epochs``; one stage
    unless ``train.resolution_schedule`` is set): a stage begins at the epoch nearest its fraction of the run, and one
    that rounds to no epoch at all is left out."""
    t, p = cfg.train, cfg.model.patch_size
    epochs = t.epochs if epochs is None else epochs
    if not t.resolution_schedule:
        return [(0, train_resolutions(cfg))]
    out: List[Tuple[int, List[int]]] = []
    for stage in t.resolution_schedule:
        first = min(round(stage[0] * epochs), epochs - 1) if epochs > 0 else 0
        if out and first <= out[-1][0]:
            out.pop()  # the earlier stage rounds to no epoch: this one takes its place
        out.append((first, stage_sizes(stage, p)))
    return out


def sizes_at(cfg: Config, epoch: int) -> List[int]:
    """The sizes training draws from in ``epoch`` (0-based)."""
    return [sizes for first, sizes in resolution_stages(cfg) if first <= epoch][-1]


def step_cost(cfg: Config, size: int) -> float:
    """A training step's cost per image at ``size`` px, relative: a block's multiply-adds for the T tokens the model
    keeps, (4 + 2 m) d^2 T for the projections and the MLP (width d, mlp_ratio m) and 2 T^2 d for attention's scores and
    weighted sums, over d: ``(4 + 2 m) d T + 2 T^2``. Fixed costs per step (the optimizer, the data) are left out."""
    m = cfg.model
    tokens = (size // m.patch_size) ** 2 * m.content_keep * cfg.train.token_keep
    return (4 + 2 * m.mlp_ratio) * m.embed_dim * tokens + 2 * tokens**2


def budget_epochs(cfg: Config, images_per_s: float, epoch_images: int, seconds: float, measured_at: Sequence[int]) -> Tuple[int, float]:
    """The most whole epochs (at least one) whose steps fit in ``seconds`` when training draws its sizes from
    ``measured_at`` at ``images_per_s``, and the seconds of steps they take. With a ``train.resolution_schedule`` each
    stage's rate is that one scaled by the cost of its sizes (:func:`step_cost`, the mean over the sizes a stage draws),
    with the stages laid over the epochs being fitted."""
    cost = {s: step_cost(cfg, s) for s in train_resolutions(cfg)}
    first = sum(cost[s] for s in measured_at) / len(measured_at)

    def took(epochs: int) -> float:
        stages = resolution_stages(cfg, epochs)
        ends = [f for f, _ in stages[1:]] + [epochs]
        return sum((end - f) * epoch_images / images_per_s * (sum(cost[s] for s in sizes) / len(sizes)) / first
                   for (f, sizes), end in zip(stages, ends))

    epochs = 1
    while took(epochs + 1) <= seconds and epochs < 100_000:
        epochs += 1
    return epochs, took(epochs)


def batch_at(cfg: Config, epoch: int, world: int = 1) -> int:
    """Images per optimizer step in ``epoch`` (0-based): ``train.batch_size``; with ``train.schedule_batch=tokens`` the
    images whose patch tokens match ``train.batch_size`` images at the schedule's largest size (by the mean tokens of
    the sizes the epoch draws), a whole number per process (an even one where mixup pairs images)."""
    t = cfg.train
    if t.schedule_batch != "tokens":
        return t.batch_size
    sizes, largest = sizes_at(cfg, epoch), max(train_resolutions(cfg))
    unit = world * (2 if cfg.data.mixup > 0 or cfg.data.cutmix > 0 else 1)
    images = t.batch_size * largest**2 / (sum(s * s for s in sizes) / len(sizes))
    return max(unit, int(images) // unit * unit)


def steps_in_epoch(cfg: Config, epoch: int, n_train: int, world: int = 1) -> int:
    """Optimizer steps in ``epoch`` (0-based): the training images over that epoch's batch (:func:`batch_at`); the last
    partial batch is dropped."""
    return n_train // batch_at(cfg, epoch, world)


def steps_before(cfg: Config, epoch: int, n_train: int, world: int = 1) -> int:
    """Optimizer steps in the epochs before ``epoch``: where the learning-rate schedule stands when ``epoch`` begins
    (``epoch = train.epochs`` gives the run's total)."""
    if cfg.train.schedule_batch != "tokens":  # every epoch takes the same steps
        return epoch * steps_in_epoch(cfg, 0, n_train, world)
    return sum(steps_in_epoch(cfg, e, n_train, world) for e in range(epoch))


def size_span(sizes: Sequence[int]) -> str:
    """``"16-24"`` (the smallest and largest of ``sizes``), or ``"32"`` for one size."""
    return f"{min(sizes)}" if len(set(sizes)) == 1 else f"{min(sizes)}-{max(sizes)}"


def schedule_text(cfg: Config) -> Optional[str]:
    """A run's sizes over its epochs, as its records and ``vitpe eval`` state them: ``"16-24 px in epochs 1-5, 28 in 6-9,
    32 in 10"``; None without a schedule."""
    if not cfg.train.resolution_schedule:
        return None
    stages = resolution_stages(cfg)
    ends = [first for first, _ in stages[1:]] + [cfg.train.epochs]
    parts = []
    for k, ((first, sizes), end) in enumerate(zip(stages, ends)):
        size = size_span(sizes)
        epochs = f"{first + 1}" if end == first + 1 else f"{first + 1}-{end}"
        parts.append(f"{size}{' px' if k == 0 else ''} in epoch{'s' if end > first + 1 else ''} {epochs}")
    return ", ".join(parts)


def train_resolutions(cfg: Config) -> List[int]:
    """The input sizes training draws from at some point of the run (just model.img_size unless multi-resolution or a
    schedule is on)."""
    p = cfg.model.patch_size
    if cfg.train.resolution_schedule:
        return sorted({s for stage in cfg.train.resolution_schedule for s in stage_sizes(stage, p)})
    if cfg.train.resolutions:
        return sorted(set(cfg.train.resolutions))
    if cfg.train.resolution_range:
        lo, hi = cfg.train.resolution_range
        return [r for r in range(max(p, -(-lo // p) * p), hi + 1, p)]
    return [cfg.model.img_size]


def shipped_configs() -> Path:
    """The folder of the shipped configs: the repository's ``configs/`` in a clone, its copy ``vitpe/configs`` in an
    installed wheel (pyproject.toml maps the one folder to both places, so the two never drift)."""
    inside = Path(__file__).resolve().parent / "configs"
    return inside if inside.is_dir() else Path(__file__).resolve().parents[1] / "configs"


def shipped_config_names() -> List[str]:
    """The names ``--config`` takes for the shipped configs (``fashion_mnist`` for ``configs/fashion_mnist.yaml``)."""
    return sorted(f.stem for f in shipped_configs().glob("*.yaml"))


def config_path(config: Union[str, Path]) -> Path:
    """The file ``--config`` names: a YAML file that exists, else a shipped config by name (``fashion_mnist``) or by its
    path in a clone (``configs/fashion_mnist.yaml``, which then works from any folder and from an installed wheel)."""
    p = Path(config)
    if p.is_file():
        return p
    names = shipped_config_names()
    bare = p.suffix == "" and len(p.parts) == 1
    if bare or (p.suffix == ".yaml" and p.parent == Path("configs")):
        if p.stem in names:
            return shipped_configs() / f"{p.stem}.yaml"
    if bare:
        raise ConfigError(f"no shipped config named {str(config)!r}{did_you_mean(p.stem, names)}; the shipped ones: {', '.join(names)} "
                          "(or give a YAML file's path)")
    raise ConfigError(f"config file {config} not found{did_you_mean(p.stem, names)}; give a YAML file's path or a shipped config "
                      f"by name: {', '.join(names)}")


def load_config(path: Optional[Union[str, Path]] = None) -> Config:
    """Defaults, overlaid with a YAML file's values (a path, or a shipped config's name: :func:`config_path`)."""
    if path is None:
        return config_from_dict({})
    p = config_path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    return config_from_dict(data)


def apply_overrides(cfg: Config, overrides: List[str]) -> Config:
    """Apply ``section.key=value`` strings (values parsed as YAML: 0.1, true, [1, 2], {a: 1})."""
    data = cfg.to_dict()
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.epochs=12")
        node, parts = data, key.strip().split(".")
        if _field_type(parts) is str:
            value = raw if raw != "" else None  # a name stays as typed: --name 2024, --name yes
        else:
            try:
                value = yaml.safe_load(raw) if raw != "" else None
            except yaml.YAMLError:
                value = raw
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"unknown config key {'.'.join(parts[: i + 1])}{did_you_mean(part, node)}; valid keys: {', '.join(node)}")
            node = node[part]
        if parts[-1] not in node and not (len(parts) > 2 and (parts[-2].endswith("kwargs") or parts[-2] == "coord_aug")):
            raise ConfigError(
                f"unknown config key {key}{did_you_mean(parts[-1], node)}; valid keys: {', '.join('.'.join(parts[:-1] + [k]) for k in node)}"
            )
        node[parts[-1]] = value
    return config_from_dict(data)


def _field_type(parts: List[str]) -> Any:
    """The declared type of config key ``parts`` (e.g. ``["model", "pos_embed"]``), Optional unwrapped; None if unknown."""
    tp: Any = Config
    for part in parts:
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
        if typing.get_origin(tp) is Literal:
            tp = type(typing.get_args(tp)[0])
        if typing.get_origin(tp) is Union:
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = inner[0] if len(inner) == 1 else tp
    return tp


def save_config(cfg: Config, path: Path) -> None:
    """Write ``cfg`` as YAML atomically (a run's config.yaml is rewritten when train.budget_min sets the epochs)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
