"""A packet delay line for the network lab, for kernels without ``netem``.

Run inside the lab's router namespace (``ip netns exec ROUTER python -m tests.helpers.delayline
QUEUE``). iptables hands every forwarded packet to netfilter queue ``QUEUE`` (``-j NFQUEUE``);
this process learns each packet's id and its in/out interfaces from the kernel (metadata only:
the payload stays in the kernel) and gives the verdict ``accept`` once the packet has waited the
one-way delay of its incoming link plus that of its outgoing link. Packets of one flow cross the
same two links, so they wait the same time and keep their order; the kernel holds them
meanwhile, so throughput is not limited by this process (it only sends small verdict messages).
TCP sees the real round trip, with its own congestion control and retransmissions, which a
userspace TCP relay (that acknowledges locally) would hide.

Delays are set on stdin, one line per link: ``IFNAME MILLISECONDS`` (the router-side interface of
the link; 0 removes it). The process prints ``ready`` once bound to the queue, and exits when
stdin closes or on SIGTERM.

The netlink messages are nfnetlink_queue's (linux/netfilter/nfnetlink_queue.h), built here with
``struct``; no library is needed.
"""

from __future__ import annotations

import heapq
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_IFINDEX_INDEV, NFQA_IFINDEX_OUTDEV = 1, 2, 5, 6
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33
NLMSG_HDR = struct.Struct("=IHHII")
NFGEN = struct.Struct("=BBH")


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _msg(msg_type: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


def _attrs(data: bytes, off: int) -> dict[int, bytes]:
    out = {}
    while off + 4 <= len(data):
        n, kind = struct.unpack_from("=HH", data, off)
        if n < 4:
            break
        out[kind & 0x3FFF] = data[off + 4:off + n]
        off += (n + 3) & ~3
    return out


class DelayLine:
    def __init__(self, queue: int, maxlen: int = 65536):
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((0, 0))
        self.delay_s: dict[int, float] = {}  # ifindex -> one-way seconds
        self.pending: list[tuple[float, int, int]] = []  # (due, seq, packet id)
        self._seq = 0
        cmd = struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, socket.htons(socket.AF_INET))
        self._config(_attr(NFQA_CFG_CMD, cmd))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
                     + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen))
                     + _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO))
                     + _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO)))

    def _config(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(_msg(NFQNL_MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self._seq))
        data = self.sock.recv(65536)
        _, kind, _, _, _ = NLMSG_HDR.unpack_from(data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, NLMSG_HDR.size)
            if err:
                raise OSError(-err, f"nfqueue config: {os.strerror(-err)}")

    def set_delay(self, ifname: str, ms: float) -> None:
        index = socket.if_nametoindex(ifname)
        if ms > 0:
            self.delay_s[index] = ms / 1000.0
        else:
            self.delay_s.pop(index, None)

    def _verdicts(self, now: float) -> None:
        out = []
        while self.pending and self.pending[0][0] <= now:
            _, _, pid = heapq.heappop(self.pending)
            out.append(_msg(NFQNL_MSG_VERDICT, self.queue, _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, pid))))
            if len(out) >= 256:
                self.sock.send(b"".join(out))
                out = []
        if out:
            self.sock.send(b"".join(out))

    def _receive(self) -> None:
        data = self.sock.recv(1 << 20)
        now = time.monotonic()
        off = 0
        while off + NLMSG_HDR.size <= len(data):
            n, kind, _, _, _ = NLMSG_HDR.unpack_from(data, off)
            if n < NLMSG_HDR.size:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                a = _attrs(data[off:off + n], NLMSG_HDR.size + NFGEN.size)
                hdr = a.get(NFQA_PACKET_HDR)
                if hdr is not None:
                    (pid,) = struct.unpack_from(">I", hdr)
                    d = 0.0
                    for k in (NFQA_IFINDEX_INDEV, NFQA_IFINDEX_OUTDEV):
                        if k in a:
                            d += self.delay_s.get(struct.unpack(">I", a[k][:4])[0], 0.0)
                    self._seq += 1
                    heapq.heappush(self.pending, (now + d, self._seq, pid))
            off += (n + 3) & ~3

    def run(self, control) -> None:
        buf = b""
        fd = control.fileno()
        os.set_blocking(fd, False)
        while True:
            timeout = max(0.0, self.pending[0][0] - time.monotonic()) if self.pending else 1.0
            ready, _, _ = select.select([self.sock, fd], [], [], timeout)
            if self.sock in ready:
                self._receive()
            if fd in ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    parts = line.decode().split()
                    if len(parts) == 2:
                        self.set_delay(parts[0], float(parts[1]))
                        print(f"set {parts[0]} {parts[1]}", flush=True)
            self._verdicts(time.monotonic())
        # let every queued packet through before leaving (the rules are removed by the lab)
        self._verdicts(float("inf"))


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    line = DelayLine(int(sys.argv[1]))
    print("ready", flush=True)
    line.run(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
