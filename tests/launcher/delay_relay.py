#!/usr/bin/env python3
"""Holds every packet routed through a TUN device for a fixed delay, then sends it on: added
latency between network namespaces where the kernel has no netem qdisc.

    delay_relay.py TUN_NAME DELAY_US

Run inside the router namespace, on a TUN device made there (`ip tuntap add dev T mode tun`).
The router's policy routes send every packet that arrives from a node's link into T; what this
writes back into T comes in on T and is routed to its destination as usual. Packets leave in the
order they came, each no earlier than DELAY_US after it arrived. Runs until killed.
"""
import collections
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(fd, delay_s):
    held = collections.deque()  # (due time, packet), in arrival order
    while True:
        # select(), not poll(): its time-out has microseconds, poll()'s milliseconds.
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([fd], [], [], timeout)
        if readable:
            now = time.monotonic()
            while True:
                try:
                    held.append((now + delay_s, os.read(fd, 65536)))
                except BlockingIOError:
                    break
        now = time.monotonic()
        while held and held[0][0] <= now:
            try:
                os.write(fd, held.popleft()[1])
            except OSError:
                pass  # a packet the kernel refuses is lost, as on a wire


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: delay_relay.py TUN_NAME DELAY_US")
    relay(open_tun(sys.argv[1]), int(sys.argv[2]) / 1e6)


if __name__ == "__main__":
    main()
