"""Per step (k-th forward on each rank), host stamps relative to rank 0's send start (us)."""
import collections, glob, statistics, sys

def load(path):
    ev = collections.defaultdict(list)
    for line in open(path):
        n, t = line.split()
        ev[n].append(int(t))
    return ev

files = {p: load(p) for p in glob.glob(sys.argv[1] + "/p*.txt")}
lead = [e for e in files.values() if e.get("S0") and e.get("C0")]
follow = [e for e in files.values() if e.get("R0")]
for r0 in lead:
    # the TP run's rank 0 (has confirm) ; match to the follower with the same F count
    n = len(r0["F0"])
    for r1 in [min(follow, key=lambda e: abs(e["F0"][0] - r0["F0"][0]))]:
        m = min(n, len(r1["F0"]))
        # the send preceding each forward on rank 0
        def before(ts, t):
            c = [x for x in ts if x <= t]
            return c[-1] if c else None
        rows = []
        for k in range(m):
            f0 = r0["F0"][k]
            s0 = before(r0["S0"], f0); s1 = before(r0["S1"], f0)
            r1f0 = r1["F0"][k]
            rr0 = before(r1["R0"], r1f0); rr1 = before(r1["R1"], r1f0)
            p0 = before(r1["P0"], r1f0); p1 = before(r1["P1"], r1f0)
            t = lambda x: (x - s0) / 1e3
            rows.append(dict(fwd0=(r0["F1"][k]-f0)/1e3, send=t(s1), F0_0=t(f0), F1_0=t(r0["F1"][k]),
                             R0_1=t(rr0), R1_1=t(rr1), P0_1=t(p0), P1_1=t(p1), F0_1=t(r1f0), F1_1=t(r1["F1"][k]),
                             lag=(r1["F1"][k]-r0["F1"][k])/1e3))
        keys = list(rows[0])
        print("k " + " ".join(f"{x:>7}" for x in keys))
        for k, r in enumerate(rows):
            print(f"{k} " + " ".join(f"{r[x]:7.1f}" for x in keys))
        # groups: decode steps have fwd0 < 200us; print medians per run of consecutive ones
        print("medians over steps with rank-0 forward call < 300 us:")
        sel = [r for r in rows if r["fwd0"] < 300] or rows
        print(" ".join(f"{x}={statistics.median(r[x] for r in sel):.1f}" for x in keys))
