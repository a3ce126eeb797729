#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots the benchmark JSON files of a results folder (bench/run_gpu.sh writes them there).

usage: plot.py [results_dir] [out_dir]   (defaults: bench/results, the results folder)

Every *.json file holding a list of flat records is read. Files are grouped into families by name
(prologue.json and prologue_peer.json -> "prologue"; combine.json and combine_peers.json ->
"combine"). The combine, MLA, communication and scaling families have figures of their own (see
plot_combine, plot_mla, plot_comm, plot_step); for every other family one PNG, <family>.png, shows time per call against the size swept
(T, or the field with most distinct values among context / batch / tokens) on log-log axes and,
where the records carry a bandwidth (gbs / gbps), achieved GB/s with the measured copy bandwidth
drawn as the ceiling. One line per combination of the descriptive fields that vary (impl, config,
cache format, partial dtype, ...); fields determined by another one (cache by config) are left out
of the labels. Families with many lines are split into one PNG per value of a field
(<family>_<field>-<value>.png). Exits 0 with a message if matplotlib is not available.
"""
import collections
import glob
import json
import os
import re
import sys

X_KEYS = ("T", "context", "batch", "tokens", "rows", "num_tokens")
TIME_KEYS = ("median_us", "us", "time_us")
BW_KEYS = ("gbs", "gbps", "key_gbs")
CEILING_KEYS = ("copy_gbs",)
# Measurements and bookkeeping, never part of a line's label.
NOT_LABELS = {
    "bench", "device", "torch", "bytes", "sets", "owned_rows", "calls_per_graph", "copy_gbs",
    "stream_us", "note", "H_local",
}
MAX_LINES = 10


def is_measurement(key):
    return (key in NOT_LABELS or key in TIME_KEYS or key in BW_KEYS or key.startswith("pct")
            or key.startswith("us_") or key.startswith("tflops") or key.endswith("_us")
            or key.endswith("_gbs"))


def family_of(path):
    # step.json, step_np2.json and step.n2.v64.json are one family: the part before the first dot,
    # without a rank-count suffix _np<N>.
    stem = re.sub(r"_np[0-9]+$", "", os.path.basename(path).split(".")[0])
    for suffix in ("_peers", "_peer"):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def load(results):
    families = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot: skipping {path}: {e}")
            continue
        if not isinstance(data, list):
            continue
        for r in data:
            if isinstance(r, dict):
                families[family_of(path)].append(r)
    return families


def ceiling_of(records):
    """Measured copy bandwidth: a copy_ceiling record (impl or kernel) or a copy_gbs field."""
    values = []
    for r in records:
        if "copy_ceiling" in (r.get("impl"), r.get("kernel")):
            values += [r[k] for k in BW_KEYS if isinstance(r.get(k), (int, float))]
        values += [r[k] for k in CEILING_KEYS if isinstance(r.get(k), (int, float))]
    return max(values) if values else None


def fmt(v):
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def label_keys(records, x_key):
    """Descriptive fields that vary, minus those determined by an earlier one."""
    keys = []
    for r in records:
        for k in r:
            if k not in keys and k != x_key and not is_measurement(k):
                keys.append(k)
    varying = [k for k in keys if len({fmt(r.get(k)) for r in records}) > 1]
    kept = []
    for k in varying:
        determined = False
        for j in kept:
            mapping = {}
            if all(mapping.setdefault(fmt(r.get(j)), fmt(r.get(k))) == fmt(r.get(k)) for r in records):
                determined = True
                break
        if not determined:
            kept.append(k)
    return kept


def save(plt, fig, path, dpi=110, note=""):
    """Lays out, writes and closes a figure, and says so."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"plot: wrote {path}{note}")


def draw(plt, title, records, x_key, t_key, bw_key, keys, ceiling, path):
    lines = collections.defaultdict(list)
    for r in records:
        lines[", ".join(f"{k}={fmt(r.get(k))}" for k in keys)].append(r)
    ncols = 2 if bw_key else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5), squeeze=False)
    ax_t = axes[0][0]
    for label, rs in sorted(lines.items()):
        rs = sorted(rs, key=lambda r: r[x_key])
        xs = [r[x_key] for r in rs]
        ax_t.plot(xs, [r[t_key] for r in rs], marker="o", label=label or title)
        if bw_key:
            axes[0][1].plot(xs, [r.get(bw_key, float("nan")) for r in rs], marker="o",
                            label=label or title)
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel(x_key)
    ax_t.set_ylabel(f"{t_key} (per call)")
    ax_t.set_title(f"{title}: time")
    ax_t.grid(True, which="both", alpha=0.3)
    if bw_key:
        ax_b = axes[0][1]
        if ceiling:
            ax_b.axhline(ceiling, color="black", linestyle="--", label=f"copy ceiling {ceiling:.0f} GB/s")
        ax_b.set_xscale("log")
        ax_b.set_xlabel(x_key)
        ax_b.set_ylabel("GB/s")
        ax_b.set_ylim(bottom=0)
        ax_b.set_title(f"{title}: achieved bandwidth")
        ax_b.grid(True, which="both", alpha=0.3)
        ax_b.legend(fontsize=7)
    else:
        ax_t.legend(fontsize=7)
    save(plt, fig, path, dpi=120, note=f" ({len(lines)} lines)")


def plot_combine(plt, records, out_dir):
    """The merge of the received states, one PNG per head count H: per call time over T, one panel
    per group size N; ours (deterministic fp32, fast fp32, fast bf16 partials), the Triton peer in
    fp32 and bf16, and a copy of the same bytes as the fast fp32 merge (copy_same_us: the ceiling
    at that size). Below: the time of each merge as a share of the Triton peer of its partial
    dtype (< 100%: faster)."""
    ours = {"merge_det_fp32": ("det fp32 (ours)", "fp32"), "merge_fast_fp32": ("fast fp32 (ours)", "fp32"),
            "merge_fast_bf16": ("fast bf16 (ours)", "bf16")}
    peers = {("triton", "fp32"): "Triton fp32", ("triton", "bf16"): "Triton bf16"}
    dtype_of = dict(ours.values())  # label -> partial dtype

    def series(rs, h, n):
        out = collections.defaultdict(dict)
        for r in rs:
            if r.get("H") != h or r.get("N") != n or not isinstance(r.get("median_us"), (int, float)):
                continue
            t = r["T"]
            if r.get("kernel") in ours:
                out[ours[r["kernel"]][0]][t] = r["median_us"]
                if r["kernel"] == "merge_fast_fp32" and "copy_same_us" in r:
                    out["copy of the same bytes"][t] = r["copy_same_us"]
            elif (r.get("impl"), r.get("partial")) in peers:
                out[peers[(r["impl"], r["partial"])]][t] = r["median_us"]
        return out

    hs = sorted({r["H"] for r in records if r.get("kernel") in ours})
    ns = sorted({r["N"] for r in records if r.get("kernel") in ours})
    styles = {"det fp32 (ours)": ("tab:blue", "-"), "fast fp32 (ours)": ("tab:green", "-"),
              "fast bf16 (ours)": ("tab:red", "-"), "Triton fp32": ("tab:green", ":"),
              "Triton bf16": ("tab:red", ":"), "copy of the same bytes": ("black", "--")}
    for h in hs:
        fig, axes = plt.subplots(2, len(ns), figsize=(5 * len(ns), 8), squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 2]})
        for j, n in enumerate(ns):
            data = series(records, h, n)
            ax, ax_r = axes[0][j], axes[1][j]
            for name, (color, ls) in styles.items():
                if name not in data:
                    continue
                ts = sorted(data[name])
                ax.plot(ts, [data[name][t] for t in ts], color=color, linestyle=ls, marker="o",
                        markersize=3, label=name)
                peer = f"Triton {dtype_of.get(name, '')}"
                if name.endswith("(ours)") and peer in data:
                    tr = [t for t in ts if t in data[peer]]
                    ax_r.plot(tr, [100.0 * data[name][t] / data[peer][t] for t in tr], color=color,
                              marker="o", markersize=3, label=f"{name} / {peer}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"merge, H = {h}, N = {n}")
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel("us per call (CUDA-graph replays)")
            ax.grid(True, which="both", alpha=0.3)
            ax_r.axhline(100.0, color="black", linewidth=0.8)
            ax_r.set_xscale("log")
            ax_r.set_xlabel("T (tokens)")
            ax_r.set_ylabel("% of the Triton peer's time")
            ax_r.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.legend(fontsize=8)
                ax_r.legend(fontsize=7)
        save(plt, fig, os.path.join(out_dir, f"combine_H-{h}.png"))


def plot_mla(plt, records, out_dir):
    """mla_decode (bench_mla_decode + mla_decode_peer + flashmla_peer): TFLOP/s and GB/s over
    batch, beside the measured matrix rate and copy bandwidth (the peer's "ceilings" record)."""
    ceil = next((r for r in records if r.get("kernel") == "ceilings"), {})
    rows = [r for r in records if r.get("kernel") in ("dense", "sparse")]
    panels = [("dense", 128, 32768, "tflops", "dense, 128 heads, 32K context: TFLOP/s"),
              ("dense", 128, 131072, "tflops", "dense, 128 heads, 128K context: TFLOP/s"),
              ("dense", 16, 32768, "gbs", "dense, 16 heads, 32K context: GB/s"),
              ("sparse", 128, 32768, "tflops", "sparse top-2048, 128 heads: TFLOP/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (kind, heads, ctx, metric, title) in zip(axes, panels):
        names = {"dcpattn": "dcpattn", "pytorch_eager": "PyTorch eager", "flashmla": "FlashMLA"}
        styles = {"dcpattn": "-", "pytorch_eager": "--", "flashmla": ":"}
        colors = {("dcpattn", "bf16"): "tab:blue", ("dcpattn", "fp8"): "tab:orange",
                  ("flashmla", "bf16"): "tab:cyan", ("flashmla", "fp8"): "tab:red",
                  ("pytorch_eager", "bf16"): "tab:gray", ("pytorch_eager", "fp8"): "tab:brown"}
        def sustained(r):
            # The same case timed after a sustained load (bench_common.cuh, sustain), if it was.
            t = r.get("sustained_us")
            if not isinstance(t, (int, float)) or t <= 0:
                return None
            return r["tflops_sustained"] if metric == "tflops" else r[metric] * r["median_us"] / t

        for impl in ("dcpattn", "flashmla", "pytorch_eager"):
            for cache in ("bf16", "fp8"):
                sel = [r for r in rows
                       if r["kernel"] == kind and r["heads"] == heads
                       and int(r["context"]) == ctx and r["cache"] == cache
                       and r.get("peer", "dcpattn") == impl and metric in r]
                pts = sorted((r["batch"], r[metric]) for r in sel)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linestyle=styles[impl], color=colors[(impl, cache)],
                            label=f"{names[impl]} {cache}")
                pts = sorted((r["batch"], sustained(r)) for r in sel if sustained(r) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x", markersize=5,
                            linestyle=styles[impl], linewidth=0.8, alpha=0.7,
                            color=colors[(impl, cache)], label=f"{names[impl]} {cache}, sustained")
        ref = ceil.get("matmul_tflops") if metric == "tflops" else ceil.get("copy_gbs")
        if ref:
            ax.axhline(ref, color="gray", linestyle=":",
                       label="bf16 matmul 8192^3" if metric == "tflops" else "copy bandwidth")
        # The floors of the MLA decode work: 250 TFLOP/s dense and 200 sparse at 128 heads, 70% of
        # the copy bandwidth at 16 heads.
        floor = (0.7 * ref if ref else None) if metric == "gbs" else (250 if kind == "dense" else 200)
        if floor:
            ax.axhline(floor, color="tab:purple", linestyle="-.", linewidth=0.9,
                       label="floor (70% of copy)" if metric == "gbs" else f"floor ({floor})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (rows)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(plt, fig, os.path.join(out_dir, "mla_decode.png"))


def plot_step(plt, records, out_dir):
    """step (bench_step at N = 1, 2, 4, 8): the DCP scaling of a whole decode step. Step time and
    speed-up over N for each (cache, batch, context), fast mode solid and deterministic mode
    dashed, the ideal speed-up N dotted; KV-cache GiB per GPU."""
    rows = [r for r in records if isinstance(r.get("N"), (int, float)) and "step_us" in r]
    if not rows:
        print("plot: step: no records")
        return
    cases = sorted({(r["format"], r["batch"], int(r["length"])) for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for (fmt_, batch, length) in cases:
        label = f"{fmt_} B={batch} L={length // 1024}K"
        for mode, style in (("fast", "-"), ("determ", "--")):
            pts = sorted((r["N"], r["step_us"]) for r in rows
                         if (r["format"], r["batch"], int(r["length"])) == (fmt_, batch, length)
                         and r["mode"] == mode)
            if not pts:
                continue
            line = axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                linestyle=style, label=f"{label} {mode}")[0]
            base = dict(pts).get(1)
            if base:
                axes[1].plot([p[0] for p in pts], [base / p[1] for p in pts], marker="o",
                             linestyle=style, color=line.get_color(), label=f"{label} {mode}")
        kv = sorted({(r["N"], r["kv_gib_per_gpu"]) for r in rows
                     if (r["format"], r["batch"], int(r["length"])) == (fmt_, batch, length)})
        axes[2].plot([p[0] for p in kv], [p[1] for p in kv], marker="o", label=label)
    ns = sorted({r["N"] for r in rows})
    axes[1].plot(ns, ns, color="gray", linestyle=":", label="ideal (N)")
    titles = ("step time (us, CUDA-graph replays)", "speed-up over N = 1", "KV cache per GPU (GiB)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("DCP size N (GPUs)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=6, ncol=2)
    axes[2].legend(fontsize=6)
    save(plt, fig, os.path.join(out_dir, "step.png"))


def plot_comm(plt, records, out_dir):
    """comm (bench_comm at N GPUs): per-call time over T of the query gathers beside NCCL's raw
    all-gather, and of the combines beside the raw all-to-all of the fp32 payload; one column per
    head count, one PNG per N."""
    rows = [r for r in records if isinstance(r.get("T"), (int, float)) and "median_us" in r]
    groups = (("gather", ("gather_direct", "gather_fallback", "nccl_all_gather")),
              ("combine", ("combine_a2a_fp32", "combine_a2a_bf16", "combine_agrs",
                           "nccl_all_to_all")))
    for n in sorted({r["N"] for r in rows}):
        heads = sorted({r["H"] for r in rows if r["N"] == n})
        fig, axes = plt.subplots(2, len(heads), figsize=(5.5 * len(heads), 8), squeeze=False)
        for col, h in enumerate(heads):
            for row, (title, ops) in enumerate(groups):
                ax = axes[row][col]
                for op in ops:
                    pts = sorted((r["T"], r["median_us"]) for r in rows
                                 if r["N"] == n and r["H"] == h and r["op"] == op)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                linestyle=":" if op.startswith("nccl") else "-", label=op)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("T (tokens)")
                ax.set_ylabel("us per call")
                ax.set_title(f"{title}, H = {h}, N = {n}", fontsize=9)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        save(plt, fig, os.path.join(out_dir, f"comm_N-{n}.png"))


# Families drawn by a figure of their own; every other family gets draw()'s generic figure.
OWN_FIGURES = {"mla_decode": plot_mla, "comm": plot_comm, "combine": plot_combine,
               "step": plot_step}


def main():
    results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    out_dir = sys.argv[2] if len(sys.argv) > 2 else results
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot: matplotlib is not available ({e}); no plots drawn")
        return 0
    families = load(results)
    if not families:
        print(f"plot: no JSON results in {results}")
        return 0
    os.makedirs(out_dir, exist_ok=True)
    for family, records in sorted(families.items()):
        if family in OWN_FIGURES:
            OWN_FIGURES[family](plt, records, out_dir)
            continue
        ceiling = ceiling_of(records)
        records = [r for r in records if "copy_ceiling" not in (r.get("impl"), r.get("kernel"))]
        t_key = next((k for k in TIME_KEYS if any(k in r for r in records)), None)
        xs = [k for k in X_KEYS if any(isinstance(r.get(k), (int, float)) for r in records)]
        if not t_key or not xs:
            print(f"plot: {family}: no time or size field, skipped")
            continue
        x_key = "T" if "T" in xs else max(xs, key=lambda k: len({r.get(k) for r in records}))
        records = [r for r in records
                   if isinstance(r.get(x_key), (int, float)) and isinstance(r.get(t_key), (int, float))]
        bw_key = next((k for k in BW_KEYS if any(k in r for r in records)), None)
        keys = label_keys(records, x_key)
        n_lines = len({tuple(fmt(r.get(k)) for k in keys) for r in records})
        facet = None
        if n_lines > MAX_LINES:
            facet = next((k for k in keys if k not in ("impl", "kernel")
                          and 2 <= len({fmt(r.get(k)) for r in records}) <= 8), None)
        if facet is None:
            draw(plt, family, records, x_key, t_key, bw_key, keys, ceiling,
                 os.path.join(out_dir, f"{family}.png"))
            continue
        for value in sorted({fmt(r.get(facet)) for r in records}):
            subset = [r for r in records if fmt(r.get(facet)) == value]
            draw(plt, f"{family} ({facet}={value})", subset, x_key, t_key, bw_key,
                 [k for k in keys if k != facet], ceiling,
                 os.path.join(out_dir, f"{family}_{facet}-{value}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
