"""``workbench plan PRESET [--device cpu|rtx3090|rtx4090|rtx5090|h100|h100-pcie] [--json OUT]
[--no-quant-error]``.

Prints the plan's table (fits or not and the knob that makes it fit, peak VRAM of the trace
step and the steady state, the steady band, host bytes, step time with its breakdown, H2D bytes
and block loads per steady step with where they come from, resident and streamed blocks, the
bound ``max(compute, bytes / H2D)``, and with SquareQ on the quantization error of the model's
weights, ``workbench.plan.quant_error``) and writes
the whole plan, VRAM curve included, as JSON with ``--json``. Exit status 0 when it fits, 1 when
it does not, 2 for a bad input (the message names the field).

The command lives in the backend because it reads the server's calibrations (``workbench.store``);
the plan and its table are the runtime's (``plan``, ``workbench.plan.table``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from workbench.contract.plan_inputs import TEXT_LEN, override_problem
from workbench.services.calibration import calibration_for, recovery_for
from workbench.store import DatabaseDamaged, Store
from workbench.worker.preset import load_preset


def open_data_store(data_dir: str | None) -> Store | None:
    """The server's database under ``data_dir`` (``$STAGEHAND_WORKBENCH_DATA`` or ``./data``),
    whose finished runs calibrate a plan and whose recoveries cap its limits; None when there is
    none, or when it is damaged (named on stderr: the plan is the one modelled)."""
    from pathlib import Path

    folder = Path(data_dir or os.environ.get("STAGEHAND_WORKBENCH_DATA") or "./data")
    if not (folder / "workbench.db").is_file():
        return None
    try:
        return Store(folder / "workbench.db")
    except DatabaseDamaged as exc:  # the plan as modelled, saying why it has no calibration
        print(f"workbench plan: no calibration applied: {exc}", file=sys.stderr)
        return None


def calibrated(plan: dict[str, Any], device: str, data: dict, data_dir: str | None) -> dict:
    """``plan`` with the calibration of ``device`` and the preset's family in the server's
    database under ``data_dir`` (``workbench.services.calibration.calibration_for``) applied
    (``workbench.plan.feedback``), if there is one."""
    from workbench.plan.feedback import (  # lazy: `workbench plan --help` without torch
        apply,
        family_of,
    )

    store = open_data_store(data_dir)
    if store is None:
        return plan
    try:
        found = calibration_for(store, device, family_of(data))
    finally:
        store.close()
    return apply(plan, found) if found else plan


def learnt(data: dict, device: str, data_dir: str | None) -> tuple[dict, dict | None]:
    """The preset ``data`` with its limits capped at the lowest a past run of ``device`` and its
    family went on with after running out of memory (``POST /api/plan`` does the same:
    ``workbench.plan.recovery``), and the plan's ``recovery`` entry (None when no run recovered)."""
    from workbench.plan.feedback import family_of  # lazy: `workbench plan --help` without torch
    from workbench.plan.recovery import cap_limits, recovery_of  # lazy: as workbench.plan.feedback

    store = open_data_store(data_dir)
    if store is None:
        return data, None
    try:
        found = recovery_for(store, device, family_of(data))
    finally:
        store.close()
    if not found:
        return data, None
    capped_data, capped = cap_limits(data, found)
    return capped_data, recovery_of(found, capped)


def bounded(name: str):
    """An argparse ``type`` for the override ``name`` of ``workbench.contract.plan_inputs.OVERRIDES``:
    a finite number within its bounds, else argparse's error naming the flag (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        problem = override_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}; got {text!r}")
        return value

    return parse


def text_tokens(text: str) -> int:
    """An argparse ``type`` for ``--text-len``: whole tokens within ``TEXT_LEN``."""

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    low, high = TEXT_LEN
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"expected {low} to {high} tokens (data.max_caption_tokens' bounds); got {text!r}"
        )
    return value


def main(argv: list[str] | None = None) -> int:
    from workbench.plan.inventory import (  # lazy: `workbench plan --help` without torch
        PlanInputError,
    )
    from workbench.plan.plan import plan_preset  # lazy: `workbench plan --help` without torch
    from workbench.plan.profiles import (  # lazy: `workbench plan --help` without torch
        PROFILES,
        profile,
    )
    from workbench.plan.table import table  # lazy: `workbench plan --help` without torch

    p = argparse.ArgumentParser(prog="workbench plan", description=__doc__.split("\n\n")[1])
    p.add_argument("preset", help="a built-in preset name or a preset JSON file")
    p.add_argument(
        "--device",
        default="cpu",
        help=f"cpu (this machine's stored profile), {', '.join(PROFILES)}",
    )
    p.add_argument("--vram-gb", type=bounded("vram_gb"), help="override the profile's VRAM (GiB)")
    p.add_argument("--tflops", type=bounded("tflops"), help="override the profile's TFLOPs")
    p.add_argument(
        "--h2d-gbps", type=bounded("h2d_gbps"), help="override the profile's pinned H2D GB/s"
    )
    p.add_argument(
        "--disk-gbps",
        type=bounded("disk_gbps"),
        help="file reads come from storage at this GB/s (default: the page cache, read at the "
        "profile's read_gbps; blocks with a host-cache image copy from it)",
    )
    p.add_argument(
        "--efficiency", type=bounded("efficiency"), help="share of peak TFLOPs reached (0.01-1)"
    )
    p.add_argument(
        "--text-len", type=text_tokens, help="text tokens (default data.max_caption_tokens)"
    )
    p.add_argument("--json", help="write the plan as JSON here")
    p.add_argument(
        "--data-dir",
        help="the server's data folder, whose finished runs calibrate the plan (default "
        "$STAGEHAND_WORKBENCH_DATA or ./data; none there: uncalibrated)",
    )
    p.add_argument("--no-calibration", action="store_true", help="the plan as modelled")
    p.add_argument(
        "--no-quant-error",
        action="store_true",
        help="with SquareQ on, do not measure the quantization error (default: read it from "
        "SquareQ's cache, else quantize the checkpoint into that cache once, as the run's set-up "
        "would, which the run then reuses; minutes for a 12B model)",
    )
    args = p.parse_args(argv)
    try:
        name, data = load_preset(args.preset)
        vram = int(args.vram_gb * 2**30) if args.vram_gb else None
        dev = profile(
            args.device,
            vram_bytes=vram,
            tflops=args.tflops,
            h2d_gbps=args.h2d_gbps,
            disk_gbps=args.disk_gbps,
        )
        recovery = None
        if not args.no_calibration:
            data, recovery = learnt(data, args.device, args.data_dir)
        plan = plan_preset(
            data,
            dev,
            name=name,
            text_len=args.text_len,
            efficiency=args.efficiency,
            quant_error="off" if args.no_quant_error else "compute",
        ).to_dict()
        if recovery is not None:
            plan["recovery"] = recovery
            print(f"workbench plan: {recovery['note']}", file=sys.stderr)
        if not args.no_calibration:
            plan = calibrated(plan, args.device, data, args.data_dir)
    except (PlanInputError, OSError, ValueError) as exc:
        print(f"workbench plan: {exc}", file=sys.stderr)
        return 2
    print(table(plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1)
    return 0 if plan["fits"] else 1
