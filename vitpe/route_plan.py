"""Which route takes a trained model to a new size, measured on that model and its held-out data, kept in the run and
used from then on.

    from vitpe.route_plan import plan_routes, save_plan, answer_lines
    plan = plan_routes(model, state, ds, [(64, 64), (48, 96)], device)   # every route the model supports, at each size
    save_plan("runs/A", plan)                                            # runs/A/route_plan.json
    print("\\n".join(answer_lines(plan)))                                 # the route to use at each size, answer first

A model trained at one size meets another by a *route*: new coordinates on a new token grid (``coords``, in each
coordinate mode that gives the model its own coordinates at its own size), FlexiViT's resized patch embedding on the
trained grid (``patch``), or the image resized back to the trained size (``resize``); or a short fine-tune at the new
size (``finetune``, a new run through ``--init``). :func:`plan_routes` measures each on the held-out split: absolute
top-1 with a 95% (Wilson) interval, and what it costs here: images/s at batch 64, the latency of one image, peak
memory. :func:`choose` picks: the best top-1, where routes whose intervals overlap it tie and the cheapest of the tie
wins. The plan is saved in the run (:data:`PLAN_NAME`) with the checkpoint it was measured on and the data's
fingerprint; :func:`planned_route` gives the route ``--route auto`` uses at a size and refuses a plan of another
checkpoint or other data. The command over it is ``vitpe eval RUN --plan SIZES`` (:mod:`vitpe.cli.eval`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .coords import COORD_MODES, PatchGrid
from .data.augment import normalize
from .data.datasets import shrink_to
from .engine import autocast
from .errors import VitpeError
from .evaluation import evaluate_at, patch_fits, route_inputs
from .runs import write_json
from .timm.pretrained import file_sha256

__all__ = ["PLAN_NAME", "PLAN_FORMAT", "ROUTE_KINDS", "Route", "PlanError", "wilson_interval", "candidate_routes",
           "held_out_fingerprint", "checkpoint_identity", "measure_cost", "plan_row", "choose", "plan_routes", "answer_lines", "report_lines",
           "save_plan", "load_plan", "plan_path", "planned_route", "route_for", "weights_of", "size_key", "finetune_command"]

PLAN_NAME = "route_plan.json"  # beside config.yaml in the run folder
PLAN_FORMAT = "vitpe-route-plan-v1"
ROUTE_KINDS = ("coords", "patch", "resize")  # what a model runs itself; "finetune" is a new run
COST_BATCH = 64  # images/s are measured at this batch, the latency with one image
WITHIN = 0.01  # a route within 1 point of the model at its own size keeps its accuracy
STOP_AFTER = 1000  # test images a route is measured on at least before it may be stopped as out of the running


class PlanError(VitpeError, ValueError):
    """A route plan that cannot be made or used: no held-out data, a size no route reaches, a file edited by hand, a plan
    of another checkpoint or of other data."""


@dataclass(frozen=True)
class Route:
    """How a model meets a size: ``kind`` one of :data:`ROUTE_KINDS`, and the coordinate mode the model runs in (for the
    coordinate route the one measured; the others keep the trained grid, so the model's own)."""

    kind: str
    coord_mode: str

    def __post_init__(self) -> None:
        if self.kind not in ROUTE_KINDS:
            raise PlanError(f"route {self.kind!r} is not one of {', '.join(ROUTE_KINDS)}")
        if self.coord_mode not in COORD_MODES:
            raise PlanError(f"coordinate mode {self.coord_mode!r} is not one of {', '.join(COORD_MODES)}")

    @property
    def name(self) -> str:
        """``coords:MODE``, ``patch`` or ``resize``: the plan file's spelling and the report's."""
        return f"coords:{self.coord_mode}" if self.kind == "coords" else self.kind

    def describe(self, train_size: Tuple[int, int]) -> str:
        """In words, for the answer line."""
        if self.kind == "coords":
            return f"coordinates ({self.coord_mode})"
        return "patch" if self.kind == "patch" else f"resize to {size_key(train_size)}"

    @classmethod
    def parse(cls, text: str, own_mode: str) -> "Route":
        kind, _, mode = str(text).partition(":")
        return cls(kind, mode or own_mode)


def size_key(size: Tuple[int, int]) -> str:
    """``"64"`` for a square size, ``"48x96"`` otherwise: the plan's key and every table's label."""
    h, w = size
    return str(h) if h == w else f"{h}x{w}"


def wilson_interval(hits: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """The Wilson score interval of a proportion ``hits / n`` (95% for ``z`` 1.96): the range top-1 on ``n`` test images
    pins down, which stays inside [0, 1] and is not empty at 0% or 100% (Wilson 1927)."""
    if n <= 0:
        raise PlanError("an interval needs at least one test image")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def candidate_routes(model: nn.Module, size: Tuple[int, int]) -> List[Route]:
    """Every route ``model`` supports at ``size``: the coordinate route in each mode that gives the model its own
    coordinates at its own size (so it is the trained model there) and different coordinates at ``size`` from every
    mode already taken (a family that reads no coordinates: its own mode alone), the patch route where the trained grid
    fits, and resizing. At the model's own size every route is the model itself: its own mode alone."""
    own = model.coord_mode
    if tuple(size) == tuple(model.img_size):
        return [Route("coords", own)]
    modes = [own]
    if getattr(model.pos_embed, "reads_coords", True):
        ref, grid = model.ref_grid, model.grid_size(size)
        trained = PatchGrid.create(ref, ref, own).coords
        seen = [PatchGrid.create(grid, ref, own).coords]
        for mode in COORD_MODES:
            if mode == own or not torch.equal(PatchGrid.create(ref, ref, mode).coords, trained):
                continue
            coords = PatchGrid.create(grid, ref, mode).coords
            if not any(torch.equal(coords, c) for c in seen):
                modes.append(mode)
                seen.append(coords)
    routes = [Route("coords", m) for m in modes]
    if patch_fits(model, *size):
        routes.append(Route("patch", own))
    return routes + [Route("resize", own)]


def held_out_fingerprint(ds: Any) -> str:
    """SHA-256 of the held-out split a plan is measured on: the dataset's name, classes and labels, and its images (the
    pixels of a split held in memory; the files' bytes of a streamed folder or of tar shards), so that a plan is never
    used on other data."""
    images, labels = ds.split(False)
    h = hashlib.sha256()
    h.update(json.dumps([ds.name, list(ds.classes), len(labels)]).encode())
    h.update(labels.to(torch.int64).numpy().tobytes())
    files = getattr(images, "paths", None) or getattr(images, "files", None)
    if isinstance(images, Tensor):
        h.update(images.contiguous().numpy().tobytes())
    elif files:
        for path in files:
            h.update(bytes.fromhex(file_sha256(path)))
    else:
        raise PlanError(f"{ds.name}'s test split cannot be fingerprinted ({type(images).__name__})")
    return h.hexdigest()


def weights_of(state: Dict[str, Any], ema: bool = True) -> str:
    """Which weights of checkpoint ``state`` a command uses: ``"ema"`` where it kept an EMA and ``ema`` asks for it, else
    ``"raw"`` (what a plan records and what eval's rows call them)."""
    return "ema" if ema and state.get("ema") is not None else "raw"


def checkpoint_identity(state: Dict[str, Any], weights: str) -> Dict[str, Any]:
    """What a plan was measured on: the checkpoint's checksum, its epoch and step, and which weights (ema or raw)."""
    return {"checksum": state.get("checksum"), "epoch": state.get("epoch"), "step": state.get("step"), "weights": weights}


def _resident_bytes(field: str) -> Optional[int]:
    """``VmRSS`` or ``VmHWM`` of this process in bytes (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the process's peak resident memory (Linux's ``clear_refs`` 5); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes(run: Callable[[], None]) -> Optional[int]:
    """Peak resident memory above the start while ``run()`` runs, on Linux with glibc (None elsewhere). glibc keeps
    freed memory resident for reuse, so a second batch would seem to cost nothing: ``malloc_trim(0)`` first hands the
    free pages back, so that the batch's own allocations are what the peak shows."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        trim = None
    if trim is None or _resident_bytes("VmRSS") is None:
        run()
        return None
    trim(0)
    before = _resident_bytes("VmRSS")
    if before is None or not _reset_peak():
        run()
        return None
    run()
    peak = _resident_bytes("VmHWM")
    return None if peak is None else max(peak - before, 0)


@torch.no_grad()
def measure_cost(model: nn.Module, route: Route, size: Tuple[int, int], device: torch.device,
                 dtype: Optional[torch.dtype] = None, batch: int = COST_BATCH, seconds: float = 0.5) -> Dict[str, Optional[float]]:
    """What ``route`` costs at ``size`` here: images/s at ``batch`` images (the resize done in the timing, as a user's
    pipeline does it; the median batch of at least 5, repeated for about ``seconds``), the median latency of one image (ms), and the peak memory
    above what was in use before a batch (MB; the device's allocator on CUDA, the process's resident memory on Linux,
    None elsewhere). Random pixels: the cost does not depend on what the images show."""
    patch, resize = route_inputs(model, route.kind, size)
    kwargs = {} if patch is None else {"patch_size": patch}
    was, mode = model.training, model.coord_mode
    model.eval()
    model.coord_mode = route.coord_mode
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, model.in_chans, *size), generator=g, dtype=torch.uint8)
    stats = ([0.5] * model.in_chans, [0.25] * model.in_chans)

    def run(x: Tensor) -> None:
        x = normalize((x if resize is None else shrink_to(x, resize)).to(device), *stats)
        with autocast(device, dtype):
            model(x, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        run(images[:1])
        run(images)  # warm-up: caches, kernels
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            run(images)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            peak = _cpu_peak_bytes(lambda: run(images))
        t0, batches = time.perf_counter(), []
        while len(batches) < 5 or (time.perf_counter() - t0 < seconds and len(batches) < 50):
            t1 = time.perf_counter()
            run(images)
            batches.append(time.perf_counter() - t1)
        rate = batch / statistics.median(batches)  # the median batch: a hiccup of the machine moves it least
        times = []
        for i in range(7):
            t1 = time.perf_counter()
            run(images[i % batch : i % batch + 1])
            times.append(time.perf_counter() - t1)
    finally:
        model.coord_mode = mode
        model.train(was)
    return {"images_per_s": round(rate, 1), "latency_ms": round(1000 * statistics.median(times), 2),
            "peak_mb": None if peak is None else round(peak / 2**20, 1)}


def choose(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The route to use among measured ``rows`` (each with ``route``, ``top1``, ``low``, ``high``, ``tokens``,
    ``images_per_s`` and, for a fine-tune, ``minutes``): the best top-1; routes whose 95% intervals overlap the best's
    tie with it, and the cheapest of the tie wins: no training before a fine-tune, then the fewest tokens per image (the
    work grows with them, and a count does not flip with the machine's load as a timing can), then no resize step, then
    the most images/s measured. Returns the chosen row's route and the routes it tied with."""
    if not rows:
        raise PlanError("no route was measured")
    best = max(rows, key=lambda r: r["top1"])
    tied = [r for r in rows if r["high"] >= best["low"] and r["low"] <= best["high"]]
    pick = min(tied, key=lambda r: (r.get("minutes") is not None, r["tokens"], r["route"] == "resize", -r["images_per_s"], -r["top1"]))
    return {"route": pick["route"], "best": best["route"], "tied": [r["route"] for r in tied if r is not pick]}


def plan_row(route: str, result: Dict[str, Any], cost: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
    hits = round(result["top1"] * result["n"])
    low, high = wilson_interval(hits, result["n"])
    return {"route": route, "top1": round(result["top1"], 5), "low": round(low, 5), "high": round(high, 5), "n": result["n"],
            "tokens": result["tokens_per_image"], **cost, **extra}


def plan_routes(model: nn.Module, state: Dict[str, Any], ds: Any, sizes: Sequence[Tuple[int, int]], device: torch.device,
                dtype: Optional[torch.dtype] = None, weights: str = "ema", batch_size: Union[int, Dict] = COST_BATCH,
                finetune: Optional[Callable[[Tuple[int, int]], Optional[Dict[str, Any]]]] = None,
                on_row: Callable[[str, Dict[str, Any]], None] = lambda size, row: None, desc: str = "",
                stop_after: int = STOP_AFTER) -> Dict[str, Any]:
    """Measure every route of ``model`` (from checkpoint ``state``, its ``weights``) at each of ``sizes`` on ``ds``'s
    held-out split, and choose (:func:`choose`). ``finetune(size)``: a fine-tune's row at a size (``minutes``,
    ``command``, ``run``, and its measures), or None where it does not apply. ``on_row(size_key, row)`` is called as each
    route finishes. The routes that keep the trained grid are measured first; a route measured after them is stopped
    once it has seen ``stop_after`` images and its interval lies wholly below the best one's so far (it can neither win
    nor tie): its row is marked ``stopped`` and its top-1 is of the images it saw. Returns the plan: the data and
    checkpoint it was measured on, the model at its own size, and per size every route's row and the choice
    (``choice``: among all; ``use``: among the routes this model runs itself, what ``--route auto`` takes)."""
    labels = ds.split(False)[1]
    if len(labels) == 0:
        raise PlanError(f"{ds.name} has no held-out images to measure routes on; name a validation split (--data)")
    sizes = list(dict.fromkeys(tuple(s) for s in sizes))
    own_size = tuple(model.img_size)
    own = Route("coords", model.coord_mode)
    # the routes that keep the trained grid first: a route whose interval falls below the best one's is then stopped early
    entries = [(own_size, own)] + [(tuple(s), r) for s in sizes if tuple(s) != own_size
                                   for r in sorted(candidate_routes(model, s), key=lambda r: r.kind == "coords")]
    measured: Dict[str, List[Dict[str, Any]]] = {}
    for size, route in entries:
        done = measured.get(size_key(size), [])
        floor = max((r["low"] for r in done), default=None)
        stop = None if floor is None else lambda hits, n, floor=floor: n >= stop_after and wilson_interval(hits, n)[1] < floor
        result = next(evaluate_at(model, ds, [(route.coord_mode, route.kind, size)], device, dtype, batch_size, desc, diagnostics=0,
                                  stop=stop))
        row = plan_row(route.name, result, measure_cost(model, route, size, device, dtype),
                       **({"stopped": True} if result["n"] < len(labels) else {}))
        measured.setdefault(size_key(size), []).append(row)
        on_row(size_key(size), row)
    model.coord_mode = own.coord_mode
    order = {size_key(s): [r.name for r in candidate_routes(model, s)] for s in sizes}
    for key, rows in measured.items():  # shown in the candidates' order
        rows.sort(key=lambda r: order.get(key, []).index(r["route"]) if r["route"] in order.get(key, []) else -1)
    at_own = measured.pop(size_key(own_size))[0]
    out_sizes: Dict[str, Any] = {}
    for size in sizes:
        key = size_key(size)
        if size == own_size:
            rows = [at_own]
        else:
            rows = measured[key]
            extra = finetune(size) if finetune is not None else None
            if extra is not None:
                rows.append(extra)
                on_row(key, extra)
        own_rows = [r for r in rows if r.get("minutes") is None]
        choice, use = choose(rows), choose(own_rows)
        out_sizes[key] = {"size": list(size), "routes": rows, "choice": choice["route"], "tied": choice["tied"],
                          "use": use["route"], "short": max(r["top1"] for r in rows) < at_own["top1"] - WITHIN}
    return {"format": PLAN_FORMAT, "train_size": list(own_size), "coord_mode": own.coord_mode,
            "checkpoint": checkpoint_identity(state, weights), "data": {"name": ds.name, "n": len(labels),
                                                                         "fingerprint": held_out_fingerprint(ds)},
            "own": at_own, "sizes": out_sizes, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "device": _device_name(device)}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or 'CPU'}, {os.cpu_count()} cores"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _rate(x: float) -> str:
    return f"{x:,.0f} img/s"


def answer_lines(plan: Dict[str, Any]) -> List[str]:
    """The answer, first: per size, the route to use and what it gives, then the others' top-1 and speed; where no route
    comes within a point of the model at its own size, that is said."""
    train = tuple(plan["train_size"])
    own = plan["own"]
    lines = []
    for key, entry in plan["sizes"].items():
        rows = {r["route"]: r for r in entry["routes"]}
        pick = rows[entry["choice"]]
        head = f"at {key} px: {_name(entry['choice'], plan)}, {_pct(pick['top1'])} ({100 * pick['low']:.1f}-{100 * pick['high']:.1f})"
        head += f", {_rate(pick['images_per_s'])}" + (f" after a {pick['minutes']:.1f}-minute fine-tune" if pick.get("minutes") is not None else "")
        if entry["tied"]:
            head += f" (tied with {', '.join(_name(r, plan) for r in entry['tied'])}: the cheaper wins)"
        others = [f"{_name(r['route'], plan)} {_pct(r['top1'])}, {_rate(r['images_per_s'])}" for r in entry["routes"] if r["route"] != entry["choice"]]
        lines.append(head + ("; " + "; ".join(others) if others else ""))
        if entry["choice"] != entry["use"]:
            lines.append(f"  this model itself: {_name(entry['use'], plan)} ({_pct(rows[entry['use']]['top1'])}), which --route auto uses "
                         f"here; the fine-tuned run is {rows[entry['choice']]['run']}")
        if entry["short"]:
            lines.append(f"  no route at {key} px comes within 1 point of the model at its own size {size_key(train)} "
                         f"({_pct(own['top1'])}): expect to lose {100 * (own['top1'] - pick['top1']):.1f} points")
    return lines


def _name(route: str, plan: Dict[str, Any]) -> str:
    if route == "finetune":
        return "fine-tune"
    return Route.parse(route, plan["coord_mode"]).describe(tuple(plan["train_size"]))


def report_lines(plan: Dict[str, Any]) -> List[str]:
    """Every route's numbers as a table: top-1 with its 95% interval, images/s at batch 64, one image's latency, peak
    memory, and a fine-tune's minutes."""
    own = plan["own"]
    head = (f"{'size':<8}{'route':<26}{'top-1 (95% interval)':>25}{'img/s (batch 64)':>18}{'latency 1 img':>15}{'peak memory':>13}"
            f"{'training':>10}")
    lines = [head]

    def line(key: str, r: Dict[str, Any], mark: str) -> str:
        memory = "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f} MB"
        minutes = "-" if r.get("minutes") is None else f"{r['minutes']:.1f} min"
        top = f"{100 * r['top1']:.2f} ({100 * r['low']:.1f}-{100 * r['high']:.1f})" + ("+" if r.get("stopped") else " ")
        return (f"{key:<8}{(_name(r['route'], plan) + mark)[:25]:<26}{top:>25}{r['images_per_s']:>18,.0f}{r['latency_ms']:>12.2f} ms"
                f"{memory:>13}{minutes:>10}")

    lines.append(line(size_key(plan["train_size"]), own, " (own size)"))
    for key, entry in plan["sizes"].items():
        for r in entry["routes"]:
            lines.append(line(key, r, " *" if r["route"] == entry["choice"] else ""))
    lines.append(f"* chosen; measured on {plan['data']['n']:,} held-out images of {plan['data']['name']}, {plan['device']}, {plan['measured']}")
    stopped = [r for entry in plan["sizes"].values() for r in entry["routes"] if r.get("stopped")]
    if stopped:
        seen = sorted({r["n"] for r in stopped})
        count = f"{seen[0]:,}" if len(seen) == 1 else f"{seen[0]:,} to {seen[-1]:,}"
        lines.append(f"+ stopped after {count} images: its interval lay below the best route's, so it could not tie")
    return lines


def save_plan(run: Union[str, Path], plan: Dict[str, Any]) -> Path:
    """Write ``plan`` to ``RUN/route_plan.json`` atomically. A plan there of the same checkpoint, weights and data keeps
    the sizes this one did not measure; any other is replaced."""
    path = plan_path(run)
    try:
        old = load_plan(run)
    except PlanError:
        old = None
    if old is not None and old["checkpoint"] == plan["checkpoint"] and old["data"] == plan["data"]:
        plan = {**plan, "sizes": {**{k: v for k, v in old["sizes"].items() if k not in plan["sizes"]}, **plan["sizes"]}}
    write_json(plan, path)
    return path


def _check_plan(plan: Any, path: Path) -> Dict[str, Any]:
    """``plan`` as read from ``path``, checked field by field: a file edited by hand into something that is not a plan
    is one line naming what is wrong."""
    bad = lambda what: PlanError(f"{path} is not a route plan vitpe wrote ({what}); measure again: vitpe eval RUN --plan SIZES")  # noqa: E731
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise bad(f"no '{PLAN_FORMAT}' marker")
    for key, kind in (("train_size", list), ("coord_mode", str), ("checkpoint", dict), ("data", dict), ("sizes", dict), ("own", dict)):
        if not isinstance(plan.get(key), kind):
            raise bad(f"'{key}' missing or not a {kind.__name__}")
    for key, entry in plan["sizes"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("routes"), list) or not isinstance(entry.get("size"), list):
            raise bad(f"size {key!r} has no routes")
        names = [r.get("route") for r in entry["routes"] if isinstance(r, dict)]
        for field in ("choice", "use"):
            if entry.get(field) not in names:
                raise bad(f"at {key} its {field} {entry.get(field)!r} is not one of the routes measured ({', '.join(map(str, names))})")
        try:
            Route.parse(entry["use"], plan["coord_mode"])
        except PlanError as e:
            raise bad(f"at {key}: {e}") from None
        if size_key(tuple(entry["size"])) != key:
            raise bad(f"size {key!r} records the size {entry['size']}")
    return plan


def load_plan(run: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The plan saved in ``run`` (a run folder or its checkpoint), checked; None where there is none."""
    path = plan_path(run)
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"{path} is not a route plan vitpe wrote (not JSON: {e}); measure again: vitpe eval RUN --plan SIZES") from None
    return _check_plan(plan, path)


def planned_route(run: Union[str, Path], state: Dict[str, Any], size: Tuple[int, int], weights: str,
                  fingerprint: Optional[Callable[[], str]] = None) -> Optional[Route]:
    """The route ``--route auto`` takes at ``size`` for the checkpoint ``state`` (its ``weights``): the plan's, where the
    run has a plan for that size; None where it has none. A plan of another checkpoint (the run trained on since), of
    other weights, or (``fingerprint()`` given: the held-out data evaluated now) of other data is refused in one line."""
    plan = load_plan(run)
    if plan is None or size_key(tuple(size)) not in plan["sizes"]:
        return None
    path = plan_path(run)
    redo = f"measure again (vitpe eval {run} --plan {size_key(tuple(size))}) or choose a route (--route coords, patch or resize)"
    then, now = plan["checkpoint"], checkpoint_identity(state, weights)
    if then.get("weights") != weights:
        raise PlanError(f"{path} was measured on the {then.get('weights')} weights, not the {weights} ones asked for; {redo}")
    if then.get("checksum") != now["checksum"]:
        raise PlanError(f"{path} was measured on another checkpoint (epoch {then.get('epoch')}, step {then.get('step')}; this one: "
                        f"epoch {now['epoch']}, step {now['step']}); {redo}")
    if fingerprint is not None and plan["data"].get("fingerprint") != fingerprint():
        raise PlanError(f"{path} was measured on other held-out data ({plan['data'].get('name')}, {plan['data'].get('n')} images); {redo}")
    return Route.parse(plan["sizes"][size_key(tuple(size))]["use"], plan["coord_mode"])


def route_for(run: Union[str, Path], model: nn.Module, state: Optional[Dict[str, Any]], size: Tuple[int, int], asked: str,
              ema: bool = True) -> Tuple[Route, Optional[str]]:
    """The route to take ``model`` (of checkpoint ``state``; None for an exported folder, which has no plan) to ``size``,
    and a note saying where it came from: the route ``asked`` for (``coords``, ``coords:MODE``, ``patch``, ``resize``);
    for ``auto``, the run's plan at that size (:func:`planned_route`, which refuses a plan of another checkpoint), else
    new coordinates in the model's own mode. At the model's own size every route is the model itself."""
    own = Route("coords", model.coord_mode)
    if tuple(size) == tuple(model.img_size):
        return own, None
    if asked != "auto":
        return Route.parse(asked, model.coord_mode), None
    if state is None:
        return own, None
    route = planned_route(run, state, size, weights_of(state, ema))
    if route is None:
        return own, None
    return route, f"at {size_key(tuple(size))} the run's plan chose {route.name} ({plan_path(run)})"


def plan_path(run: Union[str, Path]) -> Path:
    """Where the plan of ``run`` (a run folder or its checkpoint) is kept: beside its config.yaml."""
    run = Path(run)
    return (run if run.is_dir() else run.parent) / PLAN_NAME


def finetune_command(run: Union[str, Path], size: Tuple[int, int], minutes: float, out_dir: Union[str, Path],
                     name: str) -> Tuple[List[str], str]:
    """The planner's fine-tune at a square ``size``: ``train``'s overrides and the ``train.py`` command that runs the same:
    the run as the source, the one size, a time budget of ``minutes`` in place of configs/finetune.yaml's steps (its
    recipe otherwise)."""
    sets = [f"train.resolutions=[{size[0]}]", "train.steps=null", "train.warmup_steps=null", "train.warmup_epochs=0.1",
            f"train.budget_min={minutes:g}"]
    overrides = [f"init.source={run}", *sets, f"out_dir={out_dir}", f"name={name}"]
    command = " ".join(["python train.py --init", shlex.quote(str(run)), *(f"--set {shlex.quote(s)}" for s in sets),
                        "--out-dir", shlex.quote(str(out_dir)), "--name", shlex.quote(name)])
    return overrides, command
