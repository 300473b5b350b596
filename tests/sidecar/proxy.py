"""A loopback TCP proxy that can corrupt or cut the server-to-client stream."""
from __future__ import annotations

import socket
import threading


class FaultyProxy:
    """Forwards to `target`; flips the byte at `flip_at` and/or closes after `cut_at`
    bytes of the server->client direction (None: leave it alone). `seen` keeps every
    byte that passed, per direction ("to_server", "to_client"): what a wiretap reads."""

    def __init__(self, target: str, flip_at: int | None = None, cut_at: int | None = None, host: str = "127.0.0.1") -> None:
        self.target = target
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.seen = {"to_server": bytearray(), "to_client": bytearray()}
        self.sock = socket.create_server((host, 0))
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            host, _, port = self.target.rpartition(":")
            try:
                upstream = socket.create_connection((host, int(port)))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if faulty:
                    buf = bytearray(data)
                    if self.flip_at is not None and seen <= self.flip_at < seen + len(buf):
                        buf[self.flip_at - seen] ^= 0xFF
                    if self.cut_at is not None and seen + len(buf) >= self.cut_at:
                        dst.sendall(bytes(buf[: self.cut_at - seen]))
                        break
                    data = bytes(buf)
                seen += len(data)
                self.seen["to_client" if faulty else "to_server"] += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()
