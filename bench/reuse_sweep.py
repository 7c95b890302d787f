"""Does `reuse`'s cross-layer term (``cross_weight``) or its discount of later uses (``gamma``) close more of
the LRU-Belady gap than the defaults (0, 0)? Held-out DeepSeek-V2-Lite prompts (800-998), `reuse`
learning online (what a live store runs), global scope, at the points issue 11's goals name.

Usage: python bench/reuse_sweep.py [--trace ../shared/traces/deepseek-v2-lite-train.npz]
Writes bench/results/reuse_sweep.md.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
SHARED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "traces")

POINTS = (("0.2", 1), ("0.2", 8), ("0.1", 8))
SETTINGS = ((0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (0.0, 0.5), (0.5, 0.5))


def main():
    from cache_policy.replay import ReplayConfig, replay_batch
    from cache_policy.traces import load_trace
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=os.path.join(SHARED, "deepseek-v2-lite-train.npz"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "reuse_sweep.md"))
    a = ap.parse_args()
    tr = load_trace(a.trace)
    test = tr.subset(range(800, tr.num_sequences))
    t0, rows = time.time(), []
    for cap, b in POINTS:
        for cw, g in SETTINGS:
            r = replay_batch(test, ReplayConfig(policy="reuse", scope="global", device_capacity=cap,
                                                reuse_cross_weight=cw, reuse_gamma=g), b)
            rows.append((cap, b, cw, g, r["hit_rate"]["device"], r["projected_tokens_per_s"]))
            print(f"capacity {cap} batch {b} cross_weight {cw} gamma {g}: hit {rows[-1][4]:.3f}, "
                  f"{rows[-1][5]:.1f} tok/s", flush=True)
    with open(a.out, "w") as f:
        f.write("# reuse: cross-layer term and discount\n\n"
                f"Command: `python bench/reuse_sweep.py` ({(time.time() - t0) / 60:.1f} min on a shared 2-core machine). "
                f"Trace: {os.path.basename(a.trace)}, held-out prompts 800-{tr.num_sequences - 1}, `reuse` learning "
                "online, global scope, h200 profile (projected tokens/s).\n\n"
                "| capacity | batch | cross_weight | gamma | device hit rate | tok/s |\n|---|---|---|---|---|---|\n")
        for cap, b, cw, g, h, tps in rows:
            f.write(f"| {float(cap):.0%} | {b} | {cw} | {g} | {h:.3f} | {tps:.1f} |\n")
        f.write("\nPer point, the defaults (cross_weight 0, gamma 0) against the best setting:\n\n")
        for cap, b in POINTS:
            pts = [r for r in rows if r[0] == cap and r[1] == b]
            default = next(r for r in pts if r[2] == 0.0 and r[3] == 0.0)
            best = max(pts, key=lambda r: r[4])
            f.write(f"- {float(cap):.0%} / batch {b}: default {default[4]:.3f}, best {best[4]:.3f} (cross_weight {best[2]}, "
                    f"gamma {best[3]}): the default is {best[4] - default[4]:+.3f} from the best\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
