"""The first requests of each call's fresh server, joined with its raw served timeline (not kept here: the
archive that came back held it as results/timeline_raw_new.tgz): when each request reached the small model
after it was sent, when it was first handed off, and the steps of the first 80 ms. Output: first_requests.txt.

    python first_requests.py RAW_TIMELINE_DIR call1/served_new_first.json [call1/served_new_c8.json]
"""

import json
import statistics
import sys

from tokenrouter.engine.timeline import read_events

events = read_events(sys.argv[1])
arrived = {}
handed = {}
for e in events:
    if e["kind"] == "arrive" and e.get("source") is None:
        arrived.setdefault(e["request_id"], e["t"])
    if e["kind"] == "handoff" and e["source"] == "small":
        handed.setdefault(e["request_id"], e["t"])
first = json.load(open(sys.argv[2]))["results"][0]["per_request"]
t0 = min(r["start_monotonic"] for r in first)
print("request (by start): TTFT ms, reached the small model after ms, first handed to the large after ms")
for r in sorted(first, key=lambda r: r["start_monotonic"]):
    h = handed.get(r["request_id"])
    print(f"  {r['ttft_ms']:6.1f}  {1000 * (arrived[r['request_id']] - r['start_monotonic']):6.1f}  "
          f"{'-' if h is None else format(1000 * (h - r['start_monotonic']), '.1f')}")
print("steps in the first 80 ms (ms from the first request's start):")
for e in events:
    if e["kind"] == "step" and t0 <= e["start"] <= t0 + 0.08:
        print(f"  {e['model']:5s} start {1000 * (e['start'] - t0):6.2f} launched {1000 * (e['launched'] - t0):6.2f} "
              f"end {1000 * (e['end'] - t0):6.2f}  rows {e['batch']} tokens {e['tokens']}")
if len(sys.argv) > 3:
    runs = json.load(open(sys.argv[3]))["results"]
    lags = [1000 * (arrived[r["request_id"]] - r["start_monotonic"]) for run in runs for r in run["per_request"]
            if r["request_id"] in arrived]
    print(f"warmed-up C=8 runs: reached the small model after a median of {statistics.median(lags):.1f} ms "
          f"({len(lags)} requests)")
