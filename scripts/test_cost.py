#!/usr/bin/env python3
"""What each CTest test costs: wall seconds, CPU seconds and the cores it keeps busy on average,
next to the PROCESSORS it declares. CTest schedules by PROCESSORS (`ctest -j N` runs tests whose
PROCESSORS sum to at most N), so a test that declares 2 but mostly waits (time-outs, daemons
starting, a peer's deadline) keeps the other core idle; this finds them.

    scripts/test_cost.py [BUILD_DIR] [-R REGEX] [--json FILE] [--cost-data FILE]

Runs the tests one at a time, each as CTest would (its command, working directory and
environment), and measures it with wait4(): the CPU time of the test's process and of every
descendant it waited for. Processes that leave the test's process tree (daemons such as
slurmd or munged, and what they start) are not counted. Prints a table sorted by wall time and
the totals; `--json` writes the rows; `--cost-data` writes them in CTest's cost-data format
(tests/ctest_cost_data.txt is made this way: a fresh build tree starts with it, so CTest starts
the longest tests first).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time


def ctest_tests(build):
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True,
                         capture_output=True, text=True).stdout
    for t in json.loads(out)["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        if "command" not in t:
            continue
        yield t["name"], t["command"], props


def run_one(command, props, build):
    env = dict(os.environ)
    for kv in props.get("ENVIRONMENT", []):
        k, _, v = kv.partition("=")
        env[k] = v
    cwd = props.get("WORKING_DIRECTORY", build)
    timeout = float(props.get("TIMEOUT", 1500))
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    status = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            break
        if time.monotonic() - start > timeout:
            os.killpg(proc.pid, 9)
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", nargs="?", default="build")
    ap.add_argument("-R", dest="regex", default=None, help="only tests whose name matches")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--cost-data", default=None,
                    help="write the wall times in CTest's CTestCostData.txt format to this file")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    if not os.path.isfile(os.path.join(build, "CTestTestfile.cmake")):
        sys.exit(f"test_cost: {build} is not a configured build tree (cmake -S . -B {args.build})")
    rows = []
    for name, command, props in ctest_tests(build):
        if args.regex and not re.search(args.regex, name):
            continue
        wall, cpu, rc = run_one(command, props, build)
        declared = int(props.get("PROCESSORS", 1))
        skip = props.get("SKIP_RETURN_CODE")
        state = "pass" if rc == 0 else ("skip" if skip is not None and rc == skip else f"rc={rc}")
        rows.append({"name": name, "wall": wall, "cpu": cpu, "cores": cpu / wall if wall else 0,
                     "processors": declared, "state": state})
        print(f"{name:40s} {wall:7.1f} s wall {cpu:7.1f} s cpu {cpu / max(wall, 1e-9):5.2f} cores "
              f"PROCESSORS {declared} {state}", flush=True)
    rows.sort(key=lambda r: -r["wall"])
    print("\nby wall time:")
    for r in rows:
        print(f"  {r['name']:40s} {r['wall']:7.1f} {r['cpu']:7.1f} {r['cores']:5.2f} "
              f"P{r['processors']} {r['state']}")
    wall = sum(r["wall"] for r in rows)
    cpu = sum(r["cpu"] for r in rows)
    print(f"total: {len(rows)} tests, {wall:.0f} s wall one at a time, {cpu:.0f} CPU-seconds "
          f"({cpu / max(wall, 1e-9):.2f} cores on average)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.cost_data:
        with open(args.cost_data, "w") as f:
            for r in sorted(rows, key=lambda r: r["name"]):
                f.write(f"{r['name']} 1 {r['wall']:.2f}\n")
            f.write("---\n")
    return 0 if all(r["state"] in ("pass", "skip") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
