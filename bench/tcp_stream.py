"""A plain TCP stream to calibrate a link (bench/measure_multihost.sh): what one
connection delivers per second of payload, the same unit as the payload bytes the collectives
move.

  python3 tcp_stream.py serve PORT             receives one connection until EOF; prints JSON
  python3 tcp_stream.py send ADDR PORT SECONDS sends 1 MiB writes for SECONDS

The receiver leaves out the first 0.5 s after the first byte (slow start, and the burst that
tbf lets through at once), then rate = bytes / seconds until the last byte.
"""

import json
import socket
import sys
import time

WARMUP = 0.5


def serve(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(1)
        conn, peer = s.accept()
        buf = bytearray(4 << 20)
        total = warm_bytes = 0
        t_first = t_warm = t_last = None
        with conn:
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                total += n
                t_last = now
                if t_warm is None and now - t_first >= WARMUP:
                    t_warm, warm_bytes = now, total
        if t_warm is None or t_last <= t_warm:
            sys.exit("tcp_stream: the stream from %s lasted less than %.1f s" % (peer[0], WARMUP))
        print(json.dumps({"from": peer[0], "bytes": total, "seconds": round(t_last - t_first, 4),
                          "payload_bytes_per_s": round((total - warm_bytes) / (t_last - t_warm))}))


def send(addr, port, seconds):
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection((addr, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    chunk = bytes(1 << 20)
    with s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(chunk)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["send"]:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit("usage: tcp_stream.py serve PORT | send ADDR PORT SECONDS")
