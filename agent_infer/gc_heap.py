"""Freeze a long-lived process's startup heap so full garbage collections stop re-reading it.

Importing torch leaves about 150 thousand container objects that live as long as the process. A
full (generation-2) collection traverses every tracked object, so each one costs 60-90 ms here,
and it lands on whatever request happens to allocate when the collector's thresholds trip: a
schema compile, a decode step. ``gc.freeze()`` moves everything alive into a permanent generation
that collections skip; objects made afterwards are tracked and collected as before. This is what
vLLM's engine does after start-up (``freeze_gc_heap``); the server does it once the engine is
loaded (``AGENT_INFER_GC_FREEZE``, on by default).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns the number of frozen objects.

    Collecting first matters: ``gc.freeze()`` keeps whatever it finds, so garbage left in a
    younger generation would become permanent.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
