"""The benchmark's output: progress lines on stderr while it runs, then in the output directory
results.json (everything measured), report.md (the tables) and, where matplotlib imports, plots of
the kernel rows. Without matplotlib the report says so in one line; a run never fails at its end
for want of a plotting library."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PASS_LABEL = {"forward": "fwd", "backward": "fwd+bwd"}
PLOTS = ("time_vs_length.png", "memory_vs_length.png")


def write_text(path: Path, text: str) -> None:
    """path's new text, written beside it and moved into place: a run stopped while writing (a
    report is rewritten after every section) leaves the last complete file, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def case_summary(r: dict) -> str:
    """One progress line for a case result."""
    parts = []
    for name, p in r.get("passes", {}).items():
        if "median_s" in p:
            parts.append(f"{PASS_LABEL[name]} {p['median_s'] * 1e3:.1f} ms, {mib(p.get('peak_extra_bytes'))} MiB")
        else:
            parts.append(f"{PASS_LABEL[name]}: {p.get('error') or p.get('unsupported')}")
    return "; ".join(parts) or r.get("unavailable") or r.get("error", "")


def _first_line_of(path: str, prefix: str):
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def machine_info(device: str, threads: int | None) -> dict:
    import torch

    from .. import __version__

    mem = _first_line_of("/proc/meminfo", "MemTotal")
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "platform": platform.platform(), "python": platform.python_version(),
        "cpu": _first_line_of("/proc/cpuinfo", "model name") or platform.processor(),
        "cpu_count": os.cpu_count(), "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "torch": torch.__version__, "torch_threads": threads or torch.get_num_threads(), "device": device,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "hf_dilated": __version__,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        repo = Path(__file__).resolve().parents[2]
        info["git_commit"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def _header(report: dict) -> list[str]:
    s, m = report["settings"], report["machine"]
    load = m.get("load_average_at_start")
    return [
        f"# hf-dilated benchmark: {report['command']}\n",
        f"- date (UTC): {m['date_utc']}; profile: `{s['profile']}`",
        f"- machine: {m['cpu']} ({m['cpu_count']} logical cores"
        + (f", {m['memory_bytes'] / 2**30:.1f} GiB" if m.get("memory_bytes") else "") + f"), {m['platform']}"
        + (f"; GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- torch {m['torch']}, threads {m['torch_threads']}, device `{m['device']}`, dtypes {', '.join(s['dtypes'])}; "
        f"hf_dilated {m['hf_dilated']} ({m.get('git_commit') or 'no git'})"
        + (f"; load average at start {load[0]:.2f}" if load else ""),
        "- timings are comparable only within one run on an otherwise idle machine.",
        "",
    ]


def write_plots(report: dict, out: Path) -> list[str]:
    """Time and memory against length of the kernel rows, one panel per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["kernels"]["rows"] if "median_s" in r]
    palette = plt.get_cmap("tab10")
    color = {v: palette(i % 10) for i, v in enumerate(report["settings"]["variants"])}  # same in every panel
    dash = {"float32": "-", "bfloat16": "--", "float16": ":"}
    for (key, ylabel, scale), fname in zip((("median_s", "time (ms)", 1e3),
                                            ("peak_extra_bytes", "peak extra memory (MiB)", 2**-20)), PLOTS):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, pass_name in zip(axes, ("forward", "backward")):
            series = {}
            for r in rows:
                if r["pass"] == pass_name and r[key] > 0:
                    series.setdefault((r["variant"], r["dtype"]), []).append((r["n"], r[key] * scale))
            for (variant, dtype), pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color[variant],
                        linestyle=dash[dtype], label=f"{variant} ({dtype})")
            ax.set_xscale("log", base=2)
            ax.set(yscale="log", xlabel="sequence length N", ylabel=ylabel, title=PASS_LABEL[pass_name])
            ax.grid(True, which="both", alpha=0.3)
            if series:
                ax.legend(fontsize=7)
        fig.suptitle(f"hf-dilated bench: {ylabel} vs length ({report['machine']['device']}, "
                     f"torch {report['machine']['torch']})")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    return list(PLOTS)


def _plots_or_note(report: dict, out: Path) -> tuple[list[str], str | None]:
    """(plot files written, note for the report when none could be)."""
    if "kernels" not in report:
        return [], None
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return [], f"No plots: matplotlib is not installed ({e}); `pip install matplotlib` adds them."
    return write_plots(report, out), None


def write_report(report: dict, out: Path, sections: list[tuple[str, object]],
                 plots: bool = True) -> tuple[str, list[Path]]:
    """Writes results.json, report.md and (with `plots`) the plots; `sections` lists (report key,
    markdown function) in report order. Returns the markdown and the files written."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.json", json.dumps(report, indent=1, default=str))
    plots, note = _plots_or_note(report, out) if plots else ([], None)
    lines = _header(report)
    for key, markdown in sections:
        if key in report:
            lines += markdown(report[key], report["settings"])
    if note:
        lines.append(note)
    elif plots:
        lines.append("Plots: " + ", ".join(plots))
    text = "\n".join(lines).rstrip() + "\n"
    write_text(out / "report.md", text)
    return text, [out / "report.md", out / "results.json"] + [out / p for p in plots]
