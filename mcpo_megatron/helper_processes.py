"""What every pool of helper processes a rank starts (the reward workers, the tool sandbox) needs besides its own
protocol: refusing to start inside a process that multiprocessing's ``spawn`` is still bootstrapping, and closing
the pool when the interpreter exits.

A ``spawn`` child re-imports the main script; a script without a ``__main__`` guard then creates the pool again,
inside the child, which starts helpers of its own before the child can talk to its parent (multiprocessing's own
error there is an opaque RuntimeError). :func:`refuse_in_bootstrap` says so on stderr and exits with
:data:`UNGUARDED_MAIN_EXIT`, which a parent recognises.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
import weakref
from typing import Callable

# Exit code of a process that was re-importing the caller's unguarded main script (see refuse_in_bootstrap).
UNGUARDED_MAIN_EXIT = 87


def unguarded_main_advice(started: str, creates: str, does: str) -> str:
    """Why an unguarded main script fails under ``spawn`` and what to do: ``started`` names the processes (e.g.
    "the reward workers are started"), ``creates`` the object the script creates on import, ``does`` what the
    code to guard does."""
    # in a spawn child that is importing the script, multiprocessing runs it as __mp_main__
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "your main script"
    return (f"{started} with multiprocessing's 'spawn' method, which re-imports the main script ({script}) in "
            f"every worker, and that script creates {creates} when it is imported. Put the code that {does} under "
            f"`if __name__ == \"__main__\":` in {script}")


def refuse_in_bootstrap(message: str) -> None:
    """In a ``spawn`` child still importing the main script: print ``error: <message>`` on stderr and exit with
    UNGUARDED_MAIN_EXIT (the child cannot reach its pipe yet). Elsewhere: nothing."""
    if getattr(mp.current_process(), "_inheriting", False):  # multiprocessing's own test for this case
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(UNGUARDED_MAIN_EXIT)


def close_at_exit(pool) -> Callable[[], None]:
    """Call ``pool.close()`` at interpreter exit without keeping the pool alive; returns the registered function
    (``atexit.unregister`` it in ``close``). Exit hooks run last registered first, so a pool registered after
    multiprocessing was imported is closed before multiprocessing's own hook terminates daemon children (helpers
    ignore the SIGTERM it sends: helper_signals)."""
    ref = weakref.ref(pool)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)
    return close
