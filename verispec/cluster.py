"""Ray, for the commands that scale out (run-batch --ray, serve --ray-replicas)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Connects to the Ray cluster at `address` (e.g. one from `ray start --head`), or starts a
    local one when None, and disconnects (stopping the local one) at the end. A session the
    caller already opened (ray.init in a notebook or test) is used and left open."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address=address, logging_level="warning", configure_logging=True)
    try:
        yield
    finally:
        ray.shutdown()
