"""From a w4 sweep JSON, print shell exports QUARL_W4_SMALL / QUARL_W4_MID naming the single
swept config with the best geomean time over the 7B shapes (M <= 16 together; M = 64), when
it beats the default by more than 2%; else nothing (the default stays)."""
import json
import math
import re
import sys

rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kind"] == "w4" and r["us"] == r["us"]]
FIELDS = ("kernel", "bn", "num_warps", "num_stages", "waves", "cpi", "words")
for var, ms in (("QUARL_W4_SMALL", (1, 16)), ("QUARL_W4_MID", (64,))):
    sel = [r for r in rows if r["M"] in ms]
    keys = {(r["M"], r["layer"]) for r in sel}
    geo = {}
    for cfg in {r["cfg"] for r in sel}:
        ts = {(r["M"], r["layer"]): r["us"] for r in sel if r["cfg"] == cfg}
        if set(ts) == keys:
            geo[cfg] = math.exp(sum(map(math.log, ts.values())) / len(ts))
    if "default" not in geo:
        continue
    best = min(geo, key=geo.get)
    print(f"# {var}: default {geo['default']:.2f}us geomean, best {geo[best]:.2f}us {best}", file=sys.stderr)
    if best != "default" and geo[best] < 0.98 * geo["default"]:
        d = {k: v.strip("'") for k, v in re.findall(r"(\w+)=('?[\w.-]+'?)", best)}
        print(f"export {var}=" + ",".join(f"{f}={d[f]}" for f in FIELDS))
