#!/usr/bin/env python3
"""netsim's shaping check: a timed TCP transfer of about 2 seconds at the configured rate.

  shapecheck.py bits RATE                      RATE (tc syntax: 100mbit, 1gbit, 500kbit) in bit/s
  shapecheck.py recv ADDR PORT READY BITS      listen, touch READY, receive until EOF, judge
  shapecheck.py send ADDR PORT BITS            send 2 s worth of BITS bit/s to ADDR:PORT

The receiver times from the first byte to EOF and prints `ok` when the goodput is within
[0.85, 1.02] x the rate (TCP/IP and Ethernet headers take about 4.5 % of a tbf rate), `FAIL`
otherwise. Every socket operation has a timeout.
"""
import os
import re
import socket
import sys
import time

SECONDS = 2.0
LOW, HIGH = 0.85, 1.02


def parse_rate(text):
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", text.strip().lower())
    if not m:
        raise SystemExit(f"shapecheck: cannot parse rate {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return value * (8 if m.group(3) == "bps" else 1)


def main(argv):
    if argv[1] == "bits":
        print(int(parse_rate(argv[2])))
    elif argv[1] == "recv":
        addr, port, ready, bits = argv[2], int(argv[3]), argv[4], float(argv[5])
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(1)
        srv.settimeout(15)
        open(ready, "w").close()
        conn, _ = srv.accept()
        conn.settimeout(15)
        buf = bytearray(1 << 20)
        total, first = 0, None
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            if first is None:
                first = time.monotonic()
            total += n
        elapsed = time.monotonic() - first
        goodput = total * 8 / elapsed
        ratio = goodput / bits
        verdict = "ok" if LOW <= ratio <= HIGH else "FAIL"
        print(f"{verdict}: {total} bytes in {elapsed:.3f} s, {goodput / 1e6:.2f} Mbit/s, "
              f"{ratio:.3f} x the tbf rate {bits / 1e6:.1f} Mbit/s (accepted {LOW}-{HIGH})")
        os.unlink(ready)
    elif argv[1] == "send":
        addr, port, bits = argv[2], int(argv[3]), float(argv[4])
        total = int(bits * SECONDS / 8)
        sock = socket.create_connection((addr, port), timeout=15)
        chunk = b"\x5a" * (1 << 16)
        left = total
        while left > 0:
            sock.sendall(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # EOF from the receiver once it has everything
        sock.close()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
