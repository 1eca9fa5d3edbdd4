#!/usr/bin/env python3
"""Lists one step of a job's step traces (--trace_dir of psflow-launch,
psflow-worker and psflow-ps) in time order, across every process.

  scripts/trace-summary.py DIR [--step N] [--merge OUT.json] [--min_ms X]

Reads every DIR/*.json that a psflow process wrote, and prints each span of
step N (default: the first step a worker traced) as a row: its start in ms
from the step's start (the earliest worker's "step" span), its length, the
process, the thread and the details. --merge also writes all the files as
one trace (Perfetto and chrome://tracing open one file at a time).
--min_ms leaves out spans shorter than that."""
import argparse
import glob
import json
import os
import signal
import sys


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quietly, into head
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--merge", default="")
    parser.add_argument("--min_ms", type=float, default=0.0)
    args = parser.parse_args()

    events, names = [], {}
    files = sorted(glob.glob(os.path.join(args.dir, "*.json")))
    for path in files:
        try:
            with open(path) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"trace-summary: {path}: not a trace ({e})")
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") == "process_name":
                names[e.get("pid")] = e.get("args", {}).get("name", str(e.get("pid")))
            events.append(e)
    if not files:
        sys.exit(f"trace-summary: no *.json in {args.dir}")
    if args.merge:
        with open(args.merge, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        print(f"merged {len(files)} files into {args.merge}")

    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted({int(e["args"]["step"]) for e in spans
                    if e.get("name") == "step" and "step" in e.get("args", {})})
    if not steps:
        sys.exit("trace-summary: no worker traced a whole step (is --trace_steps within the job?)")
    step = args.step if args.step is not None else steps[0]
    mine = [e for e in spans if e.get("args", {}).get("step") == str(step)]
    starts = [e["ts"] for e in mine if e.get("name") == "step"]
    if not starts:
        sys.exit(f"trace-summary: no worker traced step {step} (traced: {steps})")
    t0 = min(starts)
    print(f"step {step}: ms from its start (the first worker's), length in ms")
    print(f"{'start':>8} {'length':>8}  {'process':<10} {'thread':>7}  what")
    for e in sorted(mine, key=lambda e: (e["ts"], -e.get("dur", 0))):
        dur = e.get("dur", 0) / 1000.0
        if dur < args.min_ms and e.get("name") != "step":
            continue
        details = ", ".join(f"{k} {v}" for k, v in sorted(e.get("args", {}).items()) if k != "step")
        print(f"{(e['ts'] - t0) / 1000.0:8.3f} {dur:8.3f}  {names.get(e['pid'], e['pid']):<10} "
              f"{e.get('tid', 0):>7}  {e['name']}" + (f" ({details})" if details else ""))


if __name__ == "__main__":
    main()
