"""Test-only TCP proxy in front of a redis-server that can lose one reply.

`drop_reply_to(b"XADD")` arms it: the next client command containing that word is forwarded to
Redis, Redis executes it and answers, and the proxy then closes the client's connection instead of
passing the answer on: a connection that dropped after the command landed. A client that retries
on a connection error (parity.rollout_queue.ReconnectingRedis) sends the command again, so an XADD
lands twice, which is what the consumer's dedupe must absorb.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class _Link:
    """One client connection and its upstream connection to Redis."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.mute = threading.Event()  # set: the next reply is swallowed and the client cut off


class ReplyDroppingProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._armed: bytes | None = None
        self._lock = threading.Lock()
        self.dropped = 0  # replies swallowed so far
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def drop_reply_to(self, word: bytes) -> None:
        with self._lock:
            self._armed = word

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            link = _Link(client, socket.create_connection(self.target, timeout=10))
            link.server.settimeout(None)
            threading.Thread(target=self._upstream, args=(link,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(link,), daemon=True).start()

    def _take(self, chunk: bytes) -> bool:
        with self._lock:
            if self._armed is not None and self._armed in chunk:
                self._armed = None
                return True
        return False

    def _upstream(self, link: _Link) -> None:
        try:
            while chunk := link.client.recv(65536):
                if self._take(chunk):
                    link.mute.set()  # before Redis can answer
                link.server.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(link.client, link.server)

    def _downstream(self, link: _Link) -> None:
        try:
            while chunk := link.server.recv(65536):
                if link.mute.is_set():  # Redis executed the command and answered: lose the answer
                    with self._lock:
                        self.dropped += 1
                    break
                link.client.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(link.client, link.server)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
