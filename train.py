#!/usr/bin/env python
"""Train a ViT classifier with any positional encoding.

    python train.py                                        # shapes, the built-in dataset, ~4 min on 2 CPU cores
    python train.py --config configs/fashion_mnist.yaml --set model.pos_embed=rope_mixed
    python train.py --resume runs/shapes-sincos2d-20261121-120000
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml     # gloo on CPU, NCCL on GPUs

Every run gets its own directory (never overwritten) holding config.yaml, checkpoint.pt (written
atomically each epoch, and on Ctrl-C) and metrics.jsonl / metrics.csv.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vitpe import VisionTransformer
from vitpe.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint, load_model_state, save_checkpoint
from vitpe.config import Config, ConfigError, apply_overrides, config_from_dict, load_config, save_config, train_resolutions
from vitpe.data import DataError, load_dataset, resize_images
from vitpe.data.augment import BatchAugment, normalize
from vitpe.engine import amp_dtype, autocast, evaluate, resolve_device, seed_step

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "shapes.yaml"


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says what to do."""


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1])})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.pos_embed=rope_mixed --set train.epochs=5")
    p.add_argument("--data", help="shortcut for --set data.name=NAME")
    p.add_argument("--data-dir", help="shortcut for --set data.data_dir=DIR")
    p.add_argument("--pe", help="shortcut for --set model.pos_embed=NAME")
    p.add_argument("--epochs", type=int, help="shortcut for --set train.epochs=N")
    p.add_argument("--name", help="run directory name under out_dir (must not exist yet)")
    p.add_argument("--out-dir", help="where run directories go (default: runs)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run exactly where it stopped")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config or str(DEFAULT_CONFIG))
    shortcuts = [("data.name", args.data), ("data.data_dir", args.data_dir), ("model.pos_embed", args.pe),
                 ("train.epochs", args.epochs), ("name", args.name), ("out_dir", args.out_dir)]
    overrides = [f"{k}={v}" for k, v in shortcuts if v is not None] + args.overrides
    return apply_overrides(cfg, overrides)


def safe_name(name: str) -> str:
    """A run name usable as a directory name ('+', ':' and '/' become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def new_run_dir(cfg: Config, writer: bool = True) -> Path:
    """The new run's directory; the process that writes it (rank 0) refuses one that exists."""
    name = cfg.name or f"{cfg.data.name}-{cfg.model.pos_embed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Path(cfg.out_dir) / safe_name(name)
    if writer and run.exists():
        raise ConfigError(f"run directory {run} already exists; continue it with --resume {run}, or pick another --name")
    return run


def write_metrics(run: Path, rows: List[dict]) -> None:
    """Rewrite metrics.jsonl and metrics.csv from all epochs so far (small, and exact after a resume)."""
    tmp = run / ".metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, run / "metrics.jsonl")
    flat = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]  # per-class lists: JSONL only
    with open(run / ".metrics.csv.tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    os.replace(run / ".metrics.csv.tmp", run / "metrics.csv")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    log = print if rank == 0 else (lambda *a, **k: None)

    # ---- config and run directory ------------------------------------------------------------
    if args.resume:
        if args.config or args.overrides or any(getattr(args, k) for k in ("data", "data_dir", "pe", "epochs", "name", "out_dir")):
            raise ConfigError("a resumed run continues with its saved config; start a new run to change settings")
        state = load_checkpoint(args.resume)
        cfg = config_from_dict(state["config"])
        run = Path(args.resume) if Path(args.resume).is_dir() else Path(args.resume).parent
    else:
        state, cfg = None, resolve_config(args)
        run = new_run_dir(cfg, writer=rank == 0)  # other ranks never write, and rank 0 may have made it already

    device = resolve_device(cfg.train.device)
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by the {world} processes")
    if (cfg.data.mixup > 0 or cfg.data.cutmix > 0) and (cfg.train.batch_size // world) % 2:
        raise ConfigError(f"mixup/cutmix pair images within a batch: train.batch_size per process ({cfg.train.batch_size // world}) must be even")
    dtype = amp_dtype(cfg.train.amp, device)

    # ---- data ------------------------------------------------------------------------------------
    size = (cfg.model.img_size, cfg.model.img_size)
    ds = load_dataset(cfg.data.name, cfg.data.data_dir, cfg.data.train_size, cfg.data.test_size, size)
    train_x, train_y = ds.split(True, size)
    test_x, test_y = ds.split(False, size)
    # Multi-resolution training: shapes is rendered natively at each size once; other data is resized per batch.
    sizes = train_resolutions(cfg)
    train_at = {s: ds.split(True, (s, s))[0] if ds.renders_natively else train_x for s in sizes}
    augment = BatchAugment(cfg.data.augment, flip=ds.flip_ok)
    steps_per_epoch = len(train_y) // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is larger than the {len(train_y)} training images")
    total_steps = cfg.train.epochs * steps_per_epoch

    # ---- model, optimiser, schedule ----------------------------------------------------------------
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    from timm.utils import ModelEmaV3

    seed_step(cfg.train.seed)
    model_args = dict(vars(cfg.model), num_classes=ds.num_classes, in_chans=ds.in_chans)
    model = VisionTransformer(**model_args).to(device)
    optimizer = create_optimizer_v2(model, "adamw", lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = round(cfg.train.warmup_epochs * steps_per_epoch)
    scheduler = CosineLRScheduler(optimizer, t_initial=max(total_steps - warmup, 1), lr_min=cfg.train.min_lr, warmup_t=warmup,
                                  warmup_lr_init=cfg.train.lr * 1e-3, warmup_prefix=True, t_in_epochs=False)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = ModelEmaV3(model, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
    mixup = None
    if cfg.data.mixup > 0 or cfg.data.cutmix > 0:
        mixup = Mixup(mixup_alpha=cfg.data.mixup, cutmix_alpha=cfg.data.cutmix, label_smoothing=cfg.train.label_smoothing, num_classes=ds.num_classes)
    criterion = SoftTargetCrossEntropy() if mixup else torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)

    epoch, step, rows = 0, 0, []
    if state is not None:
        load_model_state(model, state["model"], str(args.resume))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None:
            load_model_state(ema.module, state["ema"], str(args.resume))
        epoch, step, rows = state["epoch"], state["step"], state["metrics"]
        log(f"resuming {run} at epoch {epoch + 1}, step {step}/{steps_per_epoch}")
    elif rank == 0:
        run.mkdir(parents=True)
        save_config(cfg, run / "config.yaml")
    net = model
    if cfg.train.compile:
        net = torch.compile(net)
    if distributed:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(at_epoch: int, at_step: int) -> None:
        if rank == 0:
            save_checkpoint({
                "config": cfg.to_dict(), "model_args": model_args, "data": ds.describe(), "model": model.state_dict(),
                "ema": ema.module.state_dict() if ema is not None else None, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": at_epoch, "step": at_step,
                "metrics": rows,
            }, run / CHECKPOINT_NAME)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"run {run}: {cfg.data.name} ({len(train_y)} train / {len(test_y)} test, {ds.num_classes} classes), "
        f"ViT {n_params / 1e6:.2f}M params, pe={cfg.model.pos_embed}, {device}{f' x{world}' if distributed else ''}, "
        f"amp={dtype}, {cfg.train.epochs} epochs x {steps_per_epoch} steps"
        + (f", resolutions {sizes}" if len(sizes) > 1 else ""))

    # ---- training ----------------------------------------------------------------------------------
    from tqdm import tqdm

    local_batch = cfg.train.batch_size // world
    started = time.time()
    try:
        while epoch < cfg.train.epochs:
            net.train()
            perm = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(cfg.train.seed * 1009 + epoch))
            t_epoch, t_data, seen, correct, loss_sum = time.time(), 0.0, 0, 0, torch.zeros((), device=device)
            bar = tqdm(total=steps_per_epoch, initial=step, desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
                       disable=rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
            while step < steps_per_epoch:
                t0 = time.time()
                seed_step(cfg.train.seed, epoch, step)  # same on every rank: the global batch is augmented identically
                idx = perm[step * cfg.train.batch_size : (step + 1) * cfg.train.batch_size]
                res = sizes[torch.randint(len(sizes), ()).item()] if len(sizes) > 1 else sizes[0]
                x = train_at[res][idx]
                x = x if x.shape[-1] == res else resize_images(x, (res, res))
                x = augment(x)[rank * local_batch : (rank + 1) * local_batch]
                y = train_y[idx][rank * local_batch : (rank + 1) * local_batch]
                x, y = normalize(x.to(device, non_blocking=True), ds.mean, ds.std), y.to(device, non_blocking=True)
                seed_step(cfg.train.seed, epoch, step, rank)  # per-rank: dropout, drop-path, mixup
                target = y
                if mixup is not None:
                    x, target = mixup(x, y)
                t_data += time.time() - t0
                with autocast(device, dtype):
                    logits = net(x)
                    loss = criterion(logits.float(), target)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if cfg.train.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                step += 1
                scheduler.step_update(epoch * steps_per_epoch + step)
                if ema is not None:
                    ema.update(model)
                loss_sum += loss.detach() * len(y)
                correct += (logits.argmax(1) == y).sum().item()
                seen += len(y)
                if step % 10 == 0 or step == steps_per_epoch:  # a sync every 10 steps, not every step
                    avg = loss_sum.item() / seen
                    if not math.isfinite(avg):
                        raise TrainingError(
                            f"loss became {avg} at epoch {epoch + 1} step {step}; the last good checkpoint is kept in {run}. "
                            f"Lower train.lr, keep train.grad_clip on, or use train.amp=bf16 instead of fp16")
                    bar.set_postfix(loss=f"{avg:.3f}", acc=f"{correct / seen:.3f}", img_s=f"{seen * world / (time.time() - t_epoch):.0f}")
                bar.update(1)
            bar.close()
            elapsed = time.time() - t_epoch
            epoch, step = epoch + 1, 0
            if rank == 0:
                test = evaluate(ema.module if ema is not None else model, test_x, test_y, ds.mean, ds.std,
                                cfg.train.eval_batch_size, device, dtype)
                rows.append({"epoch": epoch, "train_loss": loss_sum.item() / max(seen, 1), "train_acc": correct / max(seen, 1),
                             "test_loss": test["loss"], "test_top1": test["top1"], **({"test_top5": test["top5"]} if "top5" in test else {}),
                             "test_per_class_top1": [round(a, 4) for a in test["per_class_top1"]], "lr": optimizer.param_groups[0]["lr"], "images_per_s": seen * world / elapsed,
                             "data_time_frac": t_data / elapsed, "epoch_s": elapsed, "wall_s": time.time() - started})
                checkpoint(epoch, 0)  # checkpoint first: metrics never run ahead of the weights
                write_metrics(run, rows)
                r = rows[-1]
                log(f"epoch {epoch}/{cfg.train.epochs}: train loss {r['train_loss']:.3f} acc {r['train_acc']:.3f} | "
                    f"test loss {r['test_loss']:.3f} top-1 {r['test_top1']:.4f} | {r['images_per_s']:.0f} img/s, "
                    f"data {100 * r['data_time_frac']:.0f}% of step time, {elapsed:.0f}s")
            if distributed:
                dist.barrier()
            limit = cfg.train.time_limit_min
            if limit is not None and time.time() - started > 60 * limit and epoch < cfg.train.epochs:
                log(f"time limit of {limit} min reached after epoch {epoch}; continue with: python train.py --resume {run}")
                return 0
    except KeyboardInterrupt:
        checkpoint(epoch, step)
        log(f"\ninterrupted at epoch {epoch + 1} step {step}; checkpoint saved. Continue with: python train.py --resume {run}")
        return 130
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()

    if rows:
        log(f"done in {time.time() - started:.0f}s: test top-1 {rows[-1]['test_top1']:.4f}\n"
            f"  run:        {run}\n  checkpoint: {run / CHECKPOINT_NAME}\n  metrics:    {run / 'metrics.csv'} (and metrics.jsonl)\n"
            f"  evaluate at other resolutions: python eval.py {run}")
    return 0


def cli() -> int:
    try:
        return main()
    except (ConfigError, DataError, CheckpointError, TrainingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, ValueError)) else 1


if __name__ == "__main__":
    sys.exit(cli())
