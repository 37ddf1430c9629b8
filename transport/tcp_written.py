"""How many bytes a process has written to one of its TCP connections, from the kernel
(Linux): what the peer acknowledged (`TCP_INFO`'s `tcpi_bytes_acked`) plus what still waits
in the socket's send queue (`SIOCOUTQ`). Bytes counted here have left the process: the
kernel delivers them even if it dies next. transport/zmq_sender.py compares this count with
a message's size on the wire (`wire_size`) because libzmq's tracker is released before the
I/O thread writes the message's last <= 8 KiB (its output batch)."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios

TCP_INFO_BYTES_ACKED = 120  # offset of tcpi_bytes_acked in struct tcp_info (Linux >= 4.1)
CURVE_FRAME_OVERHEAD = 33  # a CurveZMQ MESSAGE: "\x07MESSAGE", 8-byte nonce, 16-byte MAC, flags


def wire_size(frames: list[int], *, curve: bool) -> int:
    """Bytes a ZMTP 3 message of frames of these sizes takes on the wire: per frame a flags
    byte, a 1-byte size (up to 255) or an 8-byte one, and the body (boxed with CURVE)."""
    bodies = [size + (CURVE_FRAME_OVERHEAD if curve else 0) for size in frames]
    return sum(1 + (1 if body <= 255 else 8) + body for body in bodies)


def connection(fd: int) -> tuple[str, int] | None:
    """(peer address, bytes written so far) of the TCP connection `fd`; None if it is not one
    (closed, or never was). Acknowledged bytes are read first: an acknowledgement arriving in
    between undercounts, never overcounts."""
    try:
        sock = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a duplicate: closing it is harmless
    except OSError:
        return None
    try:
        peer = str(sock.getpeername())
        acked = struct.unpack_from(
            "Q", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), TCP_INFO_BYTES_ACKED
        )[0]
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return None
    finally:
        sock.close()
    return peer, acked + queued
