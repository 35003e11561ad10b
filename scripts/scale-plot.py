#!/usr/bin/env python3
"""Draws what railover costs and keeps against the number of comms, from the JSON
reports of `railover bench --failover --comms C --json` (one file per run; several runs
at one C are drawn as their range). Four panels against C (log scale): setup time, the
slowest moved comm's first message on its new path after detection, what the slowest
comm kept beside (N-1)/N, and the CPU of the open, idle comms.

usage: scripts/scale-plot.py OUT.svg REPORT.json...
No dependencies beyond the standard library.
"""
import json
import math
import sys
from collections import defaultdict

W, H = 900, 620
PANEL_W, PANEL_H = 360, 200
ORIGINS = [(80, 60), (520, 60), (80, 360), (520, 360)]


def load(paths):
    runs = defaultdict(list)
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        runs[r["comms"]].append(r)
    return dict(sorted(runs.items()))


def series(runs, get):
    """(C, lowest, highest) for each C whose runs all have the figure."""
    out = []
    for c, rs in runs.items():
        vals = [v for v in (get(r) for r in rs) if v is not None]
        if vals:
            out.append((c, min(vals), max(vals)))
    return out


def panel(svg, origin, title, unit, pts, ref=None, log_y=False):
    x0, y0 = origin
    svg.append(f'<text x="{x0}" y="{y0 - 18}" font-size="14" font-weight="bold">{title}</text>')
    svg.append(f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#999"/>')
    if not pts:
        svg.append(f'<text x="{x0 + 10}" y="{y0 + 20}" font-size="12">no data</text>')
        return
    cs = [p[0] for p in pts]
    lo_c, hi_c = math.log2(min(cs)), math.log2(max(cs))
    span_c = max(hi_c - lo_c, 1.0)
    ys = [p[1] for p in pts] + [p[2] for p in pts] + ([ref] if ref is not None else [])
    top = max(ys) * 1.15 or 1.0
    bottom = 0.0
    if log_y:
        bottom = math.log10(max(min(v for v in ys if v > 0) / 2, 1e-3))
        top = math.log10(max(ys) * 2)

    def fy(v):
        if log_y:
            v = math.log10(max(v, 1e-3))
        return y0 + PANEL_H - (v - bottom) / (top - bottom) * PANEL_H

    def fx(c):
        return x0 + 30 + (math.log2(c) - lo_c) / span_c * (PANEL_W - 60)

    for c in cs:
        svg.append(f'<text x="{fx(c):.1f}" y="{y0 + PANEL_H + 16}" font-size="11" text-anchor="middle">{c}</text>')
    for frac in (0.0, 0.5, 1.0):
        v = bottom + frac * (top - bottom)
        label = 10 ** v if log_y else v
        svg.append(f'<text x="{x0 - 6}" y="{fy(label) + 4:.1f}" font-size="11" text-anchor="end">{label:.3g}</text>')
    svg.append(f'<text x="{x0 + PANEL_W / 2}" y="{y0 + PANEL_H + 32}" font-size="11" text-anchor="middle">comms (C), {unit}</text>')
    if ref is not None:
        svg.append(f'<line x1="{x0}" x2="{x0 + PANEL_W}" y1="{fy(ref):.1f}" y2="{fy(ref):.1f}" stroke="#2a2" stroke-dasharray="4 3"/>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{fx(c):.1f},{fy((lo + hi) / 2):.1f}" for i, (c, lo, hi) in enumerate(pts))
    svg.append(f'<path d="{path}" fill="none" stroke="#36c" stroke-width="2"/>')
    for c, lo, hi in pts:
        svg.append(f'<line x1="{fx(c):.1f}" x2="{fx(c):.1f}" y1="{fy(lo):.1f}" y2="{fy(hi):.1f}" stroke="#36c" stroke-width="6" stroke-linecap="round"/>')


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs = load(sys.argv[2:])
    first = next(iter(runs.values()))[0]
    ideal = first["ideal"]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" font-size="15" text-anchor="middle">railover bench --failover: {first["rails"]} rails x {first["rate_mbit"]} Mbit/s, rail 0 cut (range of runs per C)</text>']
    panel(svg, ORIGINS[0], "setup: go to every comm connected", "ms (log)",
          series(runs, lambda r: r["setup_ms"]), log_y=True)
    panel(svg, ORIGINS[1], "slowest moved comm's first message, after detection", "ms",
          series(runs, lambda r: (r.get("resume_ms") or [None, None])[1]), ref=1000.0)
    panel(svg, ORIGINS[2], "kept by the slowest comm (dashed: (N-1)/N)", "share",
          series(runs, lambda r: r["kept"]["slowest"]), ref=ideal)
    panel(svg, ORIGINS[3], "CPU with every comm open and idle (max of both peers)", "% of a core",
          series(runs, lambda r: max((x for x in r.get("idle_cpu_pct", []) if x is not None), default=None)))
    svg.append("</svg>")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
