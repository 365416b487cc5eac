"""A TCP proxy on 127.0.0.1 that cuts a connection (both sides closed, no goodbye) when the
server sends a marker again after it was passed on once: how a browser's connection drops in
the middle of a stream that has begun."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


def _pipe(source: socket.socket, sink: socket.socket, marker: bytes | None, cut: threading.Event) -> None:
    passed = False  # whether a read holding the marker was passed on
    try:
        while data := source.recv(65536):
            if marker is not None and marker in data:
                if passed:
                    cut.set()
                    break
                passed = True
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@contextlib.contextmanager
def cutting_proxy(target_port: int, marker: bytes) -> Iterator[tuple[str, threading.Event]]:
    """Yields (the proxy's base url, an event set once a connection was cut at `marker`'s second
    read from the server); every connection and the listener are closed on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    cut = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", target_port))
            threading.Thread(target=_pipe, args=(client, server, None, cut), daemon=True).start()
            threading.Thread(target=_pipe, args=(server, client, marker, cut), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", cut
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
