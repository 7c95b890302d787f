"""Process plumbing shared by the engine process and tensor-parallel ranks."""
from __future__ import annotations

import os
import threading
import time


def watch_parent(parent: int) -> None:
    """End this process when ``parent`` is gone (killed by a supervisor, say) - also while it loads a model,
    computes or is stuck, when no socket or collective would tell it."""
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=watch, name="tiered-moe-parent-watch", daemon=True).start()
