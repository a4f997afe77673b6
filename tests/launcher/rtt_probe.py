#!/usr/bin/env python3
"""Round-trip time over TCP between two hosts, to check what a network (or a delay) adds.

    rtt_probe.py serve PORT            # answers each byte with a byte, one client, then exits
    rtt_probe.py probe HOST PORT N     # prints the median of N one-byte round trips, in µs
"""
import socket
import statistics
import sys
import time


def serve(port):
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while (byte := conn.recv(1)):
                conn.sendall(byte)


def probe(host, port, n):
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                sys.exit("rtt_probe: the server closed the connection")
            times.append((time.perf_counter() - start) * 1e6)
    print(f"{statistics.median(times):.0f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["probe"] and len(sys.argv) == 5:
        probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
