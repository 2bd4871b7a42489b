"""Ratios, bounds and goals over measured rows, and the printed table.

Ratios are to the baseline row of the same model in the same invocation (``step_ms_median /
baseline step_ms_median``), so the baseline's own ratio is exactly 1.0. On CUDA the lower bound
of a streaming row is ``max(baseline compute ms, H2D bytes per step / pinned H2D bandwidth)``.
Goals are targets to compare against, not guarantees: printed beside the figures, never asserted.
"""

from __future__ import annotations

from typing import Any

from stagehand.config.memory import MB

GB = 2**30
SEED_SPILL_SAVING_BYTES = 2.5 * GB  # activation-stagehand.md: 19.4 GB -> 16.9 GB


def add_ratios(rows: list[dict[str, Any]], hw: dict[str, Any]) -> None:
    """Fill ``ratio_to_baseline``, ``bound_ms`` and ``ratio_to_bound`` in place.

    The bound is the fastest the row could be given the bytes it moves per step:
    - CUDA (``hw["h2d_gbps"]``, pinned H2D measured): copies overlap compute, so
      ``max(baseline, H2D bytes / bandwidth)``;
    - CPU (``hw["memcpy_gbps"]``, ``hw["file_read_gbps"]``, ``probes.host_bandwidth``): copies are
      synchronous, so ``baseline + bytes copied / memcpy + bytes read / read bandwidth`` (issue
      20's "bound = baseline + bytes moved per step / measured bandwidth"). A load moves its
      bytes twice, as on a GPU: into a pool slab (read from the file, or copied from the host
      masters: H2D minus file bytes) and from the slab to the device buffer (H2D); spills and
      write-backs add their D2H bytes.
    """
    h2d_gbps = hw.get("h2d_gbps")
    memcpy_gbps, read_gbps = hw.get("memcpy_gbps"), hw.get("file_read_gbps")
    base = next((r for r in rows if r["name"] == "baseline" and r["status"] == "ok"), None)
    for row in rows:
        row.setdefault("ratio_to_baseline", None)
        row.setdefault("bound_ms", None)
        row.setdefault("ratio_to_bound", None)
        row.setdefault("ratio_rounds", None)
        row.setdefault("ratio_spread", None)
        if row["status"] != "ok" or base is None:
            continue
        if row is base:
            row["ratio_to_baseline"] = 1.0  # by definition, not a float division
        else:
            row["ratio_to_baseline"] = row["step_ms_median"] / base["step_ms_median"]
            rounds = round_ratios(row.get("run_medians"), base.get("run_medians"))
            if rounds:
                row["ratio_rounds"] = rounds
                row["ratio_spread"] = [min(rounds), max(rounds)]
        h2d = row.get("h2d_bytes_per_step")
        if h2d is None or row["group"] == "baseline":
            continue
        if h2d_gbps:
            transfer_ms = h2d / (h2d_gbps * 1e9) * 1e3
            row["bound_ms"] = max(base["step_ms_median"], transfer_ms)
        elif memcpy_gbps and read_gbps:
            read = row.get("file_read_bytes_per_step") or 0.0
            copied = 2 * h2d - read + (row.get("d2h_bytes_per_step") or 0.0)
            row["bound_ms"] = (
                base["step_ms_median"]
                + (copied / (memcpy_gbps * 1e9) + read / (read_gbps * 1e9)) * 1e3
            )
        else:
            continue
        row["ratio_to_bound"] = row["step_ms_median"] / row["bound_ms"]


def round_ratios(runs: list[float] | None, baseline_runs: list[float] | None) -> list[float]:
    """Each round's ratio to the baseline: run ``i``'s median step over the mean of the
    baseline runs just before and after it (``cli._run_rows`` runs the baseline first in every
    round and once more at the end), so a machine that drifts during a round biases both sides
    alike. Empty when either side has no runs.
    """
    if not runs or not baseline_runs:
        return []
    out = []
    for i, ms in enumerate(runs):
        around = baseline_runs[i : i + 2] or baseline_runs[-1:]
        out.append(ms / (sum(around) / len(around)))
    return out


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    row = next((r for r in rows if r["name"] == name), None)
    return row if row is not None and row["status"] == "ok" else None


def _goal(name: str, target: str, measured: str | None, met: bool | None, note: str = "") -> dict:
    return {"name": name, "target": target, "measured": measured, "met": met, "note": note}


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals with what this invocation measured (``met`` None: not measured)."""
    rows, cuda = result["rows"], result["device"]["type"] == "cuda"
    out = []
    large = result.get("large_rows") or []
    stream, base = _row(large, "stream_file"), _row(large, "baseline")
    model_bytes = (result.get("large_model") or {}).get("param_bytes", 0)
    if stream and base and model_bytes:
        growth = stream["rss_growth_bytes"] / model_bytes
        met = growth < 0.40 and stream["ratio_to_baseline"] <= 1.25
        measured = (
            f"RSS growth {growth:.0%} of {model_bytes / GB:.2f} GB, "
            f"{stream['ratio_to_baseline']:.2f}x baseline"
        )
        rss0 = stream["rss_after_imports_bytes"]
        parts = [f"setup (load) peak +{(stream['rss_setup_peak_bytes'] - rss0) / model_bytes:.0%}"]
        if stream.get("rss_train_peak_bytes") is not None:
            parts.append(
                f"training-steps peak +{(stream['rss_train_peak_bytes'] - rss0) / model_bytes:.0%}"
            )
        note = "whole-process peak; " + ", ".join(parts) + " of model bytes"
        out.append(
            _goal(
                "file-backed streaming RSS", "growth < 40% of model, <= 1.25x", measured, met, note
            )
        )
    else:
        reason = "no large-model rows (run without --quick, or with --large)"
        if large:
            reason = (
                "large-model rows incomplete: "
                + "; ".join(
                    f"{r['name']} {r['status']} {r.get('reason') or ''}".strip()
                    for r in large
                    if r["status"] != "ok"
                )
                or "stream_file row not run"
            )
        out.append(
            _goal(
                "file-backed streaming RSS", "growth < 40% of model, <= 1.25x", None, None, reason
            )
        )
    us = (result.get("transition") or {}).get("us_per_transition")
    out.append(
        _goal(
            "block transition overhead",
            "<= 150 us per load + evict",
            None if us is None else f"{us:.0f} us",
            None if us is None else us <= 150,
            "32 file-backed blocks of 20 small tensors, forward under the runtime minus without it "
            "(backend/workbench/bench/probes.py)",
        )
    )
    keep = (_row(rows, "spill_keep") or {}).get("keep_path", {})
    us, alone = keep.get("us_per_tensor"), keep.get("activation_packer_us_per_tensor")
    note = "spill_keep row did not run" if us is None else "through autograd, both packers"
    if alone is not None:
        note += f"; activation packer alone {alone:.2f} us"
    out.append(
        _goal(
            "KEEP-path cost",
            "<= 2 us per saved tensor",
            None if us is None else f"{us:.2f} us",
            None if us is None else us <= 2.0,
            note,
        )
    )
    if not cuda:
        for row_name, target in (("stream_module", 1.10), ("stream_file", 1.15)):
            ratio = (_row(rows, row_name) or {}).get("ratio_to_bound")
            out.append(
                _goal(
                    f"{row_name} vs copy bound (CPU)",
                    f"<= {target:.2f}x bound",
                    None if ratio is None else f"{ratio:.2f}x",
                    None if ratio is None else ratio <= target,
                    "bound = baseline + bytes copied / memcpy GB/s + bytes read / page-cache GB/s",
                )
            )
        scale = [r for r in result.get("scale_rows") or [] if r["status"] == "ok"]
        widest = max((r["blocks"] for r in scale), default=None)
        sixteen = next(
            (r for r in scale if r["blocks"] == widest and r["name"] == "stream_file"),
            None,
        )
        ratio = (sixteen or {}).get("ratio_to_baseline")
        out.append(
            _goal(
                f"scale row, {widest} blocks file-backed",
                "<= 1.3x baseline",
                None if ratio is None else f"{ratio:.2f}x{_spread(sixteen)}",
                None if ratio is None else ratio <= 1.3,
            )
        )
        for name, target in (
            ("activation spill saving", ">= 2.5 GB at < 4% overhead"),
            ("vs diffusers group offloading", "faster at <= peak VRAM"),
        ):
            out.append(_goal(name, target, None, None, "unmeasured: needs CUDA (H100/H200)"))
        return out
    sf = _row(rows, "stream_file")
    ratio = (sf or {}).get("ratio_to_bound")
    out.append(
        _goal(
            "streaming vs bandwidth bound",
            "<= 1.10x bound",
            None if ratio is None else f"{ratio:.2f}x",
            None if ratio is None else ratio <= 1.10,
        )
    )
    sp = _row(rows, "spill_predictive")
    if sf and sp:
        saving = sf["vram_peak_bytes"] - sp["vram_peak_bytes"]
        overhead = sp["step_ms_median"] / sf["step_ms_median"] - 1
        out.append(
            _goal(
                "activation spill saving",
                ">= 2.5 GB at < 4% overhead",
                f"{saving / GB:.2f} GB at {overhead:+.1%}",
                saving >= SEED_SPILL_SAVING_BYTES and overhead < 0.04,
            )
        )
    else:
        out.append(
            _goal(
                "activation spill saving",
                ">= 2.5 GB at < 4% overhead",
                None,
                None,
                "stream_file or spill_predictive did not run",
            )
        )
    peers = [
        r for r in (_row(rows, "peer_group_offload"), _row(rows, "peer_group_offload_stream")) if r
    ]
    if sf and peers:
        peer = min(peers, key=lambda r: r["step_ms_median"])
        met = (
            sf["step_ms_median"] < peer["step_ms_median"]
            and sf["vram_peak_bytes"] <= peer["vram_peak_bytes"]
        )
        out.append(
            _goal(
                "vs diffusers group offloading",
                "faster at <= peak VRAM",
                f"{sf['step_ms_median']:.0f} ms / {sf['vram_peak_bytes'] / MB:.0f} MB vs "
                f"{peer['step_ms_median']:.0f} ms / {peer['vram_peak_bytes'] / MB:.0f} MB",
                met,
            )
        )
    else:
        out.append(
            _goal(
                "vs diffusers group offloading",
                "faster at <= peak VRAM",
                None,
                None,
                "stream_file or a group-offload row did not run",
            )
        )
    return out


def _mb(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value / MB:.{digits}f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = (
    "config",
    "step ms",
    "x base",
    "rounds",
    "VRAM pk MB",
    "src",
    "RSS pk MB",
    "RSS +MB",
    "H2D MB/st",
    "D2H MB/st",
    "stall ms",
    "x bound",
)


def _spread(row: dict[str, Any] | None) -> str:
    """`` (rounds 1.64-1.73)`` when the row ran more than one round, else empty."""
    spread = (row or {}).get("ratio_spread")
    if not spread or len((row or {}).get("ratio_rounds") or []) < 2:
        return ""
    return f" (rounds {spread[0]:.2f}-{spread[1]:.2f})"


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    spread = row.get("ratio_spread")
    return (
        _num(row["step_ms_median"], ".1f"),
        _num(row["ratio_to_baseline"], ".2f"),
        f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
        _mb(row.get("vram_peak_bytes"), 2),
        row.get("vram_source", "-"),
        _mb(row["rss_peak_bytes"], 0),
        _mb(row["rss_growth_bytes"], 0),
        _mb(row.get("h2d_bytes_per_step"), 2),
        _mb(row.get("d2h_bytes_per_step"), 2),
        _num(row.get("stall_ms_per_step"), ".1f"),
        _num(row.get("ratio_to_bound"), ".2f"),
    )


def table(rows: list[dict[str, Any]], first: str = "config") -> str:
    """Fixed-width text table; rows that did not run show ``n/a (reason)`` or ``error``."""
    header = (first, *HEADER[1:])
    lines = []
    widths = [
        max(30, max((len(_label(r)) for r in rows), default=0)),
        8,
        6,
        9,
        10,
        7,
        9,
        7,
        9,
        9,
        8,
        7,
    ]
    lines.append(
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    )
    for row in rows:
        label = _label(row).ljust(widths[0])
        if row["status"] != "ok":
            reason = row.get("reason") or ""
            word = "n/a" if row["status"] == "n/a" else row["status"]
            lines.append(f"{label}  {word} ({reason})")
            continue
        cells = _cells(row)
        line = label + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths[1:], strict=True))
        if row.get("notes"):
            line += "  [" + "; ".join(row["notes"]) + "]"
        lines.append(line)
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    return (
        f"{row['blocks']:>2} blk  {row['label']}" if row.get("section") == "scale" else row["label"]
    )


def goals_text(items: list[dict[str, Any]]) -> str:
    lines = ["goals (reported, not asserted):"]
    for g in items:
        verdict = {True: "MET", False: "NOT MET", None: "unmeasured"}[g["met"]]
        measured = g["measured"] or "-"
        note = f"  ({g['note']})" if g["note"] else ""
        lines.append(f"  {g['name']:<32} target {g['target']:<30} {measured:<40} {verdict}{note}")
    return "\n".join(lines)


def timeline_text(rows: list[dict[str, Any]], peak_gbps: float | None) -> str:
    """CUDA rows' device timeline (``probes.device_timeline``): H2D GB/s achieved against the
    measured pinned-copy peak, the share of copy time hidden behind compute, host syncs per
    step."""
    peak = f"{peak_gbps:.1f}" if peak_gbps else "?"
    lines = [
        f"device timeline (2 profiled steps per row; pinned H2D peak {peak} GB/s):",
        f"{'config':<40} {'H2D GB/s':>9} {'copy ms/st':>10} {'hidden':>7} {'syncs/st':>9}",
    ]
    for row in rows:
        timeline = row.get("device_timeline")
        if row["status"] != "ok" or not timeline:
            continue
        hidden = timeline["h2d_hidden_fraction"]
        lines.append(
            f"{_label(row):<40} {_num(row.get('h2d_achieved_gbps'), '.1f'):>9} "
            f"{timeline['h2d_copy_ms_per_step']:>10.2f} "
            f"{'-' if hidden is None else f'{hidden:.0%}':>7} "
            f"{timeline['host_syncs_per_step']:>9.1f}"
        )
    return "\n".join(lines)
