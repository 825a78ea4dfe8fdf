"""Process exit and fork: what happens to live dispatchers when the process ends or forks.

- At interpreter exit (a normal end, ``sys.exit``, Ctrl-C), every live dispatcher is flushed
  and closed within :data:`EXIT_TIMEOUT` seconds in all; what cannot be delivered in time is
  counted (``close_timeout``), never lost silently. The exit hook runs before Python waits for
  its threads and before any ``atexit`` function (JAX's included), so JAX is still whole while
  the last steps are fetched.
- On SIGTERM every live dispatcher is flushed, then the handler sowtel's replaced decides:
  a Python handler is called and sessions stay open (it may keep the process running, as a
  "finish the epoch, then exit" handler does), an ignored SIGTERM stays ignored, and the
  default action closes every dispatcher and ends the process by the signal. A handler that
  chains to sowtel's from inside it gets the one sowtel's replaced before it, never itself
  again. While the process ends that way, a thread that offers records after the close waits
  for the end instead of carrying on, so no call that returned lost its records. A SIGTERM
  that another thread took while the main thread waits (in ``join()``, say) is sent on to the
  main thread, which Python alone runs handlers on (see :func:`_forward`).
- A dispatcher thread fetching a ``sowtel.jit`` step's summaries from the device is inside
  JAX's C++ code with the GIL released; a thread that comes back from there while Python is
  finalizing is torn down inside C++ and aborts the process. :data:`FETCHES` therefore closes
  at exit: no fetch starts after it, and the exit hook waits for the fetch in progress to end
  (at most :data:`FETCH_GRACE` seconds) before Python goes on tearing threads down. A program
  ``sowtel.jit`` compiles ahead in a thread goes through the same gate.
- In a child made by ``os.fork`` (``multiprocessing``'s fork start method), no sowtel thread
  exists and any lock a sowtel thread held in the parent would stay held forever: every lock
  and condition registered with :func:`after_fork` is made anew, and every inherited
  dispatcher refuses records and answers ``flush``, ``close`` and ``status`` at once.

Example:
    >>> from sowtel import _exit
    >>> with _exit.FETCHES.entered() as allowed:
    ...     allowed
    True
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["EXIT_TIMEOUT", "FETCH_GRACE", "FETCHES", "register", "unregister", "close_all",
           "sigterm_unhandled", "after_fork", "install_sigterm", "keep_sigterm", "watch_sigterm",
           "flush_all", "wait_if_ending"]

logger = logging.getLogger("sowtel")

#: Seconds the exit hooks (interpreter exit and SIGTERM) spend, in all, flushing and closing
#: every live dispatcher before the process goes on exiting.
EXIT_TIMEOUT: float = 10.0
#: Seconds the exit hook waits, beyond :data:`EXIT_TIMEOUT`, for a device fetch in progress.
FETCH_GRACE: float = 30.0


class FetchGate:
    """Counts the threads inside a device fetch; once closed, lets no new fetch start.

    Example:
        >>> gate = FetchGate()
        >>> with gate.entered() as allowed:
        ...     allowed
        True
        >>> gate.close(timeout=1.0)
        True
        >>> with gate.entered() as allowed:
        ...     allowed
        False
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._closed = False

    @contextlib.contextmanager
    def entered(self) -> Iterator[bool]:
        """Inside: True when the fetch may run; False once the process is exiting."""
        with self._cond:
            if self._closed:
                allowed = False
            else:
                self._inside += 1
                allowed = True
        try:
            yield allowed
        finally:
            if allowed:
                with self._cond:
                    self._inside -= 1
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Lets no fetch start from now on; waits for those inside. True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            while self._inside:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _after_fork(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0


#: The gate every fetch of a ``sowtel.jit`` step's summaries, and every program ``sowtel.jit``
#: compiles ahead in a thread, goes through: threads that may be inside JAX's C++ code.
FETCHES = FetchGate()

# -- live dispatchers ------------------------------------------------------------------------

_live: dict[int, Any] = {}
_hooks_lock = threading.RLock()
_installed = False
# The SIGTERM handlers sowtel's replaced, oldest first: the first is what the process had before
# sowtel; each later one was set by the user, and found when sowtel put its handler back.
_replaced: list[Any] = []
_calling = 0  # sowtel's handlers now inside the handler each replaced (main thread only)
_flushing = False  # sowtel's handler is flushing, before it calls the one it replaced
_ending = threading.Event()  # SIGTERM's default action is under way: the process ends
_warned_sigterm = False
_foreign_since: float | None = None  # when a handler other than sowtel's was first seen
_warned_foreign = False
# The signal wake-up pipe (read end, write end) sowtel set, if the program had none, and the
# thread that forwards to the main thread a SIGTERM another thread took (see _forward).
_wakeup: tuple[int, int] | None = None
_forwarder: threading.Thread | None = None
_forwarder_stops: dict[int, bool] = {}  # thread ident -> asked to end
_received = 0  # calls of sowtel's SIGTERM handler so far
_fork_hooks: list[Callable[[], None]] = []
_fork_objects: weakref.WeakSet[Any] = weakref.WeakSet()


def register(dispatcher: Any) -> None:
    """Adds a live dispatcher: closed at exit and on SIGTERM, forgotten in a forked child."""
    global _installed
    with _hooks_lock:
        _live[id(dispatcher)] = dispatcher
        if not _installed:
            _install_exit_hook()
            _installed = True
        _start_forwarder()
    install_sigterm()


def unregister(dispatcher: Any) -> None:
    """Removes a dispatcher that is closed; with the last one, the forwarding thread ends (a
    process with no live session leaves no sowtel thread behind)."""
    with _hooks_lock:
        _live.pop(id(dispatcher), None)
        if not _live:
            _stop_forwarder()


def _stop_forwarder() -> None:
    global _forwarder
    thread, _forwarder = _forwarder, None
    if thread is None or _wakeup is None:
        return
    _forwarder_stops[thread.ident or 0] = True
    try:
        os.write(_wakeup[1], b"\0")  # not a signal number: wakes the thread to end
    except OSError:
        return
    if thread is not threading.current_thread():
        thread.join(1.0)


def _install_exit_hook() -> None:
    # threading's own exit hooks run first thing at interpreter shutdown, before Python waits
    # for non-daemon threads and before atexit functions (JAX's among them). Where that private
    # hook is missing, atexit is the next best place.
    hook = getattr(threading, "_register_atexit", None)
    if callable(hook):
        try:
            hook(_at_exit)
            return
        except RuntimeError:  # already shutting down: atexit still runs
            pass
    atexit.register(_at_exit)


def _at_exit() -> None:
    close_all()
    if not FETCHES.close(FETCH_GRACE):
        logger.error("sowtel: a device fetch was still running %.0f s after exit began; the "
                     "process may abort while Python tears its threads down", FETCH_GRACE)


def close_all(timeout: float | None = None) -> None:
    """Flushes and closes every live dispatcher within ``timeout`` seconds in all.

    Runs at interpreter exit and on SIGTERM (with :data:`EXIT_TIMEOUT`); safe to call any time.

    Example:
        >>> close_all(timeout=5.0)
    """
    if timeout is None:
        timeout = EXIT_TIMEOUT
    deadline = time.monotonic() + timeout
    with _hooks_lock:
        dispatchers = list(_live.values())
    for dispatcher in dispatchers:
        try:
            dispatcher.close(max(0.0, deadline - time.monotonic()))
        except Exception:  # SystemExit from a chained SIGTERM handler must go through
            logger.exception("sowtel could not close a dispatcher at exit")


# -- SIGTERM --------------------------------------------------------------------------------------

def install_sigterm() -> None:
    """Puts the SIGTERM handler in place, chaining whatever handler is there now.

    Signal handlers can only be set from the main thread: this runs when sowtel is imported
    there, whenever a dispatcher is made there, and from :func:`keep_sigterm` (in case a
    handler was set since), so a session enabled in any thread is flushed on SIGTERM.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    with _hooks_lock:
        try:
            current = signal.getsignal(signal.SIGTERM)
            if current is _on_sigterm:
                return
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            return
        if not _replaced:
            _set_wakeup()
        _replaced.append(current)


def _set_wakeup() -> None:
    """On the main thread: a pipe Python writes the number of each caught signal to, from
    whatever thread caught it, unless the program set a wake-up fd of its own (asyncio does)."""
    global _wakeup
    if not hasattr(signal, "pthread_kill") or not hasattr(signal, "set_wakeup_fd"):
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if old != -1:  # the program's own: left as it was
            signal.set_wakeup_fd(old)
    except (ValueError, OSError):
        old = 0
    if old != -1:
        os.close(read)
        os.close(write)
        return
    _wakeup = (read, write)


def _start_forwarder() -> None:
    global _forwarder
    if _wakeup is None or _forwarder is not None:
        return
    _forwarder = threading.Thread(target=_forward, args=(_wakeup[0],), name="sowtel-signals",
                                  daemon=True)
    _forwarder.start()


def _forward(read: int) -> None:
    """Sends the main thread a SIGTERM that another thread took and the main one never saw.

    Python runs handlers on the main thread only, and a signal sent to the process goes to
    whichever thread is running: a training thread takes it, and a main thread waiting in
    ``join()`` never wakes to run the handler (the process would neither flush nor end).
    Python writes each caught signal to the wake-up pipe, from whatever thread caught it; when
    sowtel's handler has not started within a moment of it, this thread sends SIGTERM to the
    main thread itself, which wakes it; the handler still runs once (Python runs it once for
    signals that arrive before it runs).
    """
    own = 0  # SIGTERMs this thread sent: their bytes are not new signals
    while True:
        before = _received
        try:
            data = os.read(read, 512)
        except OSError:
            return
        if not data:
            return
        new = data.count(signal.SIGTERM)
        taken = min(own, new)
        own -= taken
        # The last session closed: this thread ends (after forwarding a SIGTERM read with it).
        stopping = _forwarder_stops.pop(threading.get_ident(), False)
        if new > taken:
            deadline = time.monotonic() + 0.2
            while _received == before and time.monotonic() < deadline:
                time.sleep(0.01)
            # Unless the main thread took it up (or the handler is not sowtel's to wake).
            if _received == before and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                own += 1
                try:
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
                except (OSError, ValueError):
                    own -= 1
        if stopping:
            return


def keep_sigterm() -> None:
    """On the main thread, while a dispatcher is live: puts sowtel's SIGTERM handler back if a
    handler set since replaced it (chaining that one), so that a handler installed after
    ``enable()`` does not skip the flush. Called by ``sowtel.jit`` calls, ``log``, ``flush``
    and ``export``; one ``getsignal`` when nothing changed.

    Example:
        >>> keep_sigterm()
    """
    if (_live and signal.getsignal(signal.SIGTERM) is not _on_sigterm
            and threading.current_thread() is threading.main_thread()):
        install_sigterm()


def watch_sigterm() -> None:
    """From a dispatcher thread, about twice a second: warns once per process when a handler
    set after sowtel's has replaced it for a second or more (so no main-thread call of sowtel
    put it back), as SIGTERM then flushes nothing unless that handler chains to sowtel's.

    Example:
        >>> watch_sigterm()
    """
    global _foreign_since, _warned_foreign
    if _warned_foreign or not _replaced:
        return
    try:
        current = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return
    if current is _on_sigterm or current is None or current == signal.SIG_IGN:  # none lose
        _foreign_since = None
        return
    now = time.monotonic()
    if _foreign_since is None:
        _foreign_since = now
        return
    if now - _foreign_since < 1.0:
        return
    _warned_foreign = True
    with contextlib.suppress(Warning):  # under -W error: a dispatcher thread must not die of it
        _warn_foreign(current)


def _warn_foreign(current: Any) -> None:
    warnings.warn(
        f"sowtel: a SIGTERM handler set after sowtel.enable() ({current!r}) replaced sowtel's, "
        "so unless it calls the handler it replaced, SIGTERM will not flush the session: "
        "records still queued are lost if it ends the process. Set your handler before "
        "enable(), call sowtel.flush() or sowtel.disable() in it, or chain to the handler "
        "signal.getsignal(signal.SIGTERM) returned before you set yours", RuntimeWarning,
        stacklevel=1)


def sigterm_unhandled() -> str | None:
    """Once per process, when SIGTERM would not flush sessions: why, and what to do instead.

    That is the case when sowtel was first imported outside the main thread and no dispatcher
    was made on it since, or when a SIGTERM handler set later replaced sowtel's.

    Example:
        >>> sigterm_unhandled() is None  # imported on the main thread
        True
    """
    global _warned_sigterm
    try:
        ours = signal.getsignal(signal.SIGTERM) is _on_sigterm
    except (ValueError, OSError):
        ours = False
    with _hooks_lock:
        if ours or _warned_sigterm:
            return None
        _warned_sigterm = True
    return ("sowtel cannot flush this session on SIGTERM: its handler could not be installed "
            "(signal handlers can only be set from the main thread, and sowtel was imported "
            "elsewhere, or a handler set since replaced it). Import sowtel on the main thread "
            "before starting threads, or call sowtel.disable() (or "
            "sowtel.dispatcher.close_all()) from your own handler; normal exit and Ctrl-C "
            "still flush")


def flush_all(timeout: float | None = None) -> None:
    """Flushes every live dispatcher within ``timeout`` seconds in all (default
    :data:`EXIT_TIMEOUT`), leaving them open.

    Example:
        >>> flush_all(timeout=5.0)
    """
    deadline = time.monotonic() + (EXIT_TIMEOUT if timeout is None else timeout)
    with _hooks_lock:
        dispatchers = list(_live.values())
    for dispatcher in dispatchers:
        try:
            dispatcher.flush(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the user's handler must still run
            logger.exception("sowtel could not flush a dispatcher on SIGTERM")


def wait_if_ending() -> None:
    """Called by a thread whose records a closed dispatcher refused: while SIGTERM's default
    action ends the process, it waits for the end rather than go on as if they were kept (a
    training thread would otherwise report steps whose records were never written).

    Example:
        >>> wait_if_ending()  # at once: the process is not ending
    """
    if _ending.is_set() and threading.current_thread() is not threading.main_thread():
        threading.Event().wait()


def _on_sigterm(signum: int, frame: Any) -> None:
    global _calling, _flushing, _received
    _received += 1
    # Called again from inside the chain (a handler sowtel's replaced calls the one it had
    # replaced, which was sowtel's), this call stands for the handler before that one.
    position = len(_replaced) - 1 - _calling
    previous = _replaced[position] if position >= 0 else signal.SIG_DFL
    if not callable(previous) and previous != signal.SIG_IGN:  # SIG_DFL, or not from Python
        _terminate()
        return
    if not _flushing:  # a second SIGTERM while the first one flushes goes straight on
        _flushing = True
        try:
            # Flushed, not closed: the handler may let the process go on (set a flag, finish
            # the epoch). If it raises SystemExit, Python exits through the exit hook.
            flush_all()
        finally:
            _flushing = False
    if previous == signal.SIG_IGN:
        return
    _calling += 1
    try:
        previous(signum, frame)
    finally:
        _calling -= 1


def _terminate() -> None:
    # No Python handler: end the way SIGTERM would have without sowtel. The process ends by
    # the signal, without Python's finalization, so no thread is torn down inside JAX; a fetch
    # in progress is waited for all the same, so no file is cut mid-write.
    _ending.set()
    close_all()
    FETCHES.close(FETCH_GRACE)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    os._exit(128 + signal.SIGTERM)


# -- fork ---------------------------------------------------------------------------------------

def after_fork(target: Any) -> None:
    """Registers what to renew in a forked child: a function (called), or an object whose
    ``_after_fork()`` method is called while it is alive.

    Example:
        >>> after_fork(lambda: None)
    """
    with _hooks_lock:
        if callable(target) and not hasattr(target, "_after_fork"):
            _fork_hooks.append(target)
        else:
            _fork_objects.add(target)


def _after_fork_in_child() -> None:
    global _hooks_lock, _wakeup, _forwarder
    _hooks_lock = threading.RLock()
    _forwarder = None
    if _wakeup is not None:
        # The pipe is the parent's too: the child's signals must not reach its forwarder.
        for fd in _wakeup:
            with contextlib.suppress(OSError):
                os.close(fd)
        _wakeup = None
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        if threading.current_thread() is threading.main_thread():
            _set_wakeup()
    FETCHES._after_fork()
    # Objects first (dispatchers, workers, sessions, exporters): then module-level locks.
    for obj in list(_fork_objects):
        try:
            obj._after_fork()
        except Exception:  # noqa: BLE001 - a child must start whatever one object does
            logger.exception("sowtel: renewing %r after fork failed", obj)
    for hook in list(_fork_hooks):
        try:
            hook()
        except Exception:  # noqa: BLE001
            logger.exception("sowtel: a fork hook failed")
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
install_sigterm()
