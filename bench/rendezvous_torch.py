#!/usr/bin/env python3
"""c10d's rendezvous pattern on PyTorch's own TCPStore, for `shoal bench rendezvous`: N clients
(threads of this process, each its own TCPStore connection to one server) each set their own key,
then wait for every rank's key (what c10d's store-based barrier and init do).

usage: rendezvous_torch.py --ranks N --result FILE
Writes {"ranks", "connect_s", "rendezvous_s"} as JSON to FILE: connect_s from the first client's
start to the last one connected, rendezvous_s from then to the last one through its wait.
"""
import argparse
import json
import resource
import threading
import time
from datetime import timedelta

import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    n = args.ranks
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * n + 256
    if soft < wanted and (hard == resource.RLIM_INFINITY or hard >= wanted):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    timeout = timedelta(seconds=args.timeout)
    server = dist.TCPStore("127.0.0.1", 0, n + 1, True, timeout, wait_for_workers=False)
    port = server.port
    keys = [f"rank/{r}" for r in range(n)]
    stores = [None] * n
    connected = threading.Barrier(n + 1)
    go = threading.Event()
    errors = []

    def rank(r):
        try:
            stores[r] = dist.TCPStore("127.0.0.1", port, n + 1, False, timeout, wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {r} connect: {e}")
        connected.wait()
        go.wait()
        if stores[r] is None:
            return
        try:
            stores[r].set(keys[r], b"1")
            stores[r].wait(keys, timeout)
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    start = time.time()
    for t in threads:
        t.start()
    connected.wait()
    connect_s = time.time() - start
    start = time.time()
    go.set()
    for t in threads:
        t.join()
    rendezvous_s = time.time() - start
    if errors:
        raise SystemExit(f"rendezvous_torch.py: {len(errors)} ranks failed, the first: {errors[0]}")
    with open(args.result, "w") as out:
        json.dump({"ranks": n, "connect_s": connect_s, "rendezvous_s": rendezvous_s}, out)


if __name__ == "__main__":
    main()
