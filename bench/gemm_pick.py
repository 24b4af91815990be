"""Reads a sweep JSON and prints the int4 small-M kernel ("swap", "swap16" or "swapb") that is faster
on geomean over the 7B shapes at M <= 16 (used by bench/gpu_run.sh to A/B in one call)."""
import json
import math
import sys

rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kind"] == "w4" and r["M"] <= 16 and r["us"] == r["us"]]
best: dict[tuple, float] = {}
for r in rows:
    kern = next((k for k in ("swap16", "swapb", "swap") if f"'{k}'" in r["cfg"]), None)
    if kern:
        key = (kern, r["M"], r["N"], r["K"])
        best[key] = min(best.get(key, 1e9), r["us"])
geo = {}
for kern in ("swap", "swap16", "swapb"):
    v = [t for (k, *_), t in best.items() if k == kern]
    geo[kern] = math.exp(sum(map(math.log, v)) / len(v)) if v else 1e9
print(min(geo, key=geo.get))
print(geo, file=sys.stderr)
