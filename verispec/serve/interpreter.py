"""The Python interpreter tuned for a server's latency: one interpreter lock is shared by the event
loop, the engine thread and the worker threads that prepare requests (parsing bodies, rendering
chats, building grammars), so how long one thread can keep it is how long every stream can stall.

- The switch interval (how long a thread that wants the lock waits before the holder is asked to
  drop it) goes from Python's 5 ms to 0.5 ms: the engine thread gives the lock up around torch
  calls and wants it back right after, and beside a worker busy in Python it waited up to 5 ms
  each time (on a loaded 2-core machine, a stream's largest gap beside hostile requests went
  from up to 0.8 s to about 0.13 s with it).
- The objects alive at start-up (the model, torch's and the libraries' modules: half a million)
  are frozen out of the cyclic garbage collector: a full collection, which a request that makes
  many objects (a large schema's dicts) can trigger, walked them all, holding the lock for 0.2 s
  on an idle core of a 2-core machine (0 ms once frozen).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def responsive_interpreter() -> Iterator[None]:
    """Within: the switch interval shortened and the objects alive on entry frozen (module
    docstring); both restored on exit."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()  # what is garbage now is not kept frozen
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)
