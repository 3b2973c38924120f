"""The worker side: the bootstep that checks settings and tasks at start-up and frees
locks at shutdown (bootstep), the request that frees a dead child's lock (request), the
watch on prefork children (child_watch), and what each pool offers a locked run (pools).
"""

from __future__ import annotations

from ..app.config import StartupConfigError

__all__ = ["StartupConfigError"]
