#!/usr/bin/env python3
"""Where the build's time goes: CPU-seconds per group (library, CLI, tests, the rest) from a
build folder's .ninja_log.

    scripts/build_cost.py [BUILD_DIR]            # default build/
    scripts/build_cost.py BUILD_DIR --top 15     # and the 15 most expensive steps

Each ninja step is one compiler or linker process, single-threaded, so its duration is its CPU
time as long as the build ran with no more jobs than cores (make's default -j $(nproc)). The log
keeps every build ever run in that folder; for each output the latest entry counts, so run it
after a clean build (`rm -rf build && make build`, ccache emptied or disabled with CCACHE_DISABLE=1)
to measure the cold cost, or after any build for the cost of what that build redid.
"""
import argparse
import os
import sys


def group_of(output):
    if output.startswith("CMakeFiles/shoal_objects.dir/cmake_pch"):
        return "library (precompiled header)"
    if output.startswith(("CMakeFiles/shoal", "libshoal")):
        return "library"
    if output.startswith("apps/"):
        return "cli"
    if output.startswith("tests/"):
        return "tests"
    return "rest (bench, examples, fuzz, other)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir", nargs="?", default="build")
    parser.add_argument("--top", type=int, default=0, help="also list the N most expensive steps")
    args = parser.parse_args()
    path = os.path.join(args.build_dir, ".ninja_log")
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"build_cost: cannot read {path}: {e.strerror}; build with Ninja first (make build)")
    latest = {}
    for line in lines:
        if line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 4:
            continue
        start, end, output = int(fields[0]), int(fields[1]), fields[3]
        latest[output] = (end - start) / 1000.0
    groups = {}
    for output, seconds in latest.items():
        count, total = groups.get(group_of(output), (0, 0.0))
        groups[group_of(output)] = (count + 1, total + seconds)
    total = sum(t for _, t in groups.values())
    print(f"{'group':38} {'steps':>6} {'cpu-s':>8} {'share':>6}")
    for name, (count, seconds) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:38} {count:6d} {seconds:8.0f} {100 * seconds / max(total, 1e-9):5.1f}%")
    print(f"{'total':38} {len(latest):6d} {total:8.0f}")
    if args.top:
        print()
        for output, seconds in sorted(latest.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{seconds:8.1f}  {output}")


if __name__ == "__main__":
    main()
