"""Small process-level helpers shared by the launcher and the workers."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_process_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM to this process when its parent exits, so no engine outlives
    the launcher even if the launcher is killed with SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
