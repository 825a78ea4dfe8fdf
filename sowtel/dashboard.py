"""``sowtel dashboard``: TensorBoard on the runs the TensorBoard exporter writes.

It starts TensorBoard in this process, bound to 127.0.0.1 (pass ``--host`` to serve other
machines), on port 6006 or, when 6006 is taken and no ``--port`` was asked for, on a free port;
prints the URL and serves until Ctrl-C. TensorBoard re-reads the event files every 2 seconds,
the interval at which the exporter syncs them, so curves grow while training runs.

Example:
    $ sowtel dashboard --logdir runs
    TensorBoard: http://127.0.0.1:6006/
    sowtel's depth view (layers x steps, health): http://127.0.0.1:6006/#sowtel
    sowtel's layout (one category per site): http://127.0.0.1:6006/#custom_scalars
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import signal
import socket
import sys
import threading
from typing import Any

from sowtel import errors

__all__ = ["DEFAULT_PORT", "SAMPLES_PER_PLUGIN", "configure_dashboard", "run_dashboard",
           "pick_port", "dashboard_command", "dashboards_path", "configure_dashboards",
           "run_dashboards"]

#: The port TensorBoard usually listens on; taken when free.
DEFAULT_PORT = 6006
# Matches the exporter's default flush interval, so a new point shows within about 4 s.
_RELOAD_SECS = 2
#: TensorBoard's ``--samples_per_plugin``: every one of the sowtel plugin's tensors (0 keeps
#: every step), as the depth view shows every logging step.
SAMPLES_PER_PLUGIN = "sowtel=0"


def dashboard_command(logdir: str | os.PathLike[str]) -> str:
    """The ``sowtel dashboard`` command that shows the run in ``logdir``.

    A run under ``./runs`` (the TensorBoard exporter's default) is shown with every other run
    there, to compare them; any other run alone. Paths under the working directory are
    relative.

    Example:
        >>> dashboard_command(os.path.join("runs", "20250101-120000"))
        'sowtel dashboard --logdir runs'
        >>> dashboard_command(os.path.join(os.sep, "data", "exp 1"))
        "sowtel dashboard --logdir '/data/exp 1'"
    """
    path = os.path.abspath(os.fspath(logdir))
    cwd = os.getcwd()
    if os.path.dirname(path) == os.path.join(cwd, "runs"):
        path = os.path.dirname(path)
    shown = os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path
    return f"sowtel dashboard --logdir {shlex.quote(shown)}"


def configure_dashboard(parser: argparse.ArgumentParser) -> None:
    """Adds the ``sowtel dashboard`` options to ``parser``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser()
        >>> configure_dashboard(p)
        >>> p.parse_args(["--logdir", "runs"]).port is None
        True
    """
    parser.add_argument("--logdir", default="runs",
                        help="folder of runs written by the TensorBoard exporter (default: runs)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to serve on (default: {DEFAULT_PORT}, or a free port if "
                             f"{DEFAULT_PORT} is taken)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only; "
                             "0.0.0.0 serves every network interface)")


def pick_port(host: str, port: int | None) -> int:
    """Returns ``port`` if it is free on ``host``; without one, 6006 if free, else a free port.

    Raises ValueError when the asked-for port is out of range or taken.

    Example:
        >>> p = pick_port("127.0.0.1", None)
        >>> 0 < p < 65536
        True
    """
    if port is not None:
        if not 0 < port < 65536:
            raise errors.BadCommandLineError(f"--port {port}",
                                             "is not a TCP port: use a number from 1 to 65535")
        if not _free(host, port):
            raise errors.BadCommandLineError(
                f"port {port} on {host}", "is in use: pass another --port, or leave --port out "
                "to pick a free one"
            )
        return port
    if _free(host, DEFAULT_PORT):
        return DEFAULT_PORT
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _fail(message: str) -> int:
    print(f"sowtel dashboard: error: {message}", file=sys.stderr)
    return 2


def run_dashboard(args: argparse.Namespace) -> int:
    """Starts TensorBoard on ``args.logdir``, prints its URL and serves until interrupted.

    Returns the exit status: 0 after Ctrl-C or SIGTERM, 2 for bad options.

    Example:
        >>> args = argparse.Namespace(logdir="runs", port=None, host="127.0.0.1")
        >>> run_dashboard(args)  # doctest: +SKIP
        TensorBoard: http://127.0.0.1:6006/
    """
    logdir = os.path.abspath(os.fspath(args.logdir))
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        return _fail(f"--logdir {args.logdir!r} is not a directory: pass the folder of runs "
                     "(such as runs)")
    try:
        port = pick_port(args.host, args.port)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    if not os.path.isdir(logdir):
        print(f"sowtel dashboard: warning: --logdir {args.logdir!r} does not exist ({logdir}), "
              "so the board is empty until runs are written there: check the path, or start "
              "one with: sowtel demo", file=sys.stderr, flush=True)
    missing = _missing_extra()
    if missing:
        return _fail(missing)
    url = _launch(logdir, args.host, port)
    print(f"TensorBoard: {url}")
    print(f"sowtel's depth view (layers x steps, health): {url}#sowtel")
    print(f"sowtel's layout (one category per site): {url}#custom_scalars", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    return 0


def _missing_extra() -> str | None:
    """What to install when TensorBoard is not there, else None."""
    import importlib.util

    for module in ("tensorboard", "tensorboardX"):
        if importlib.util.find_spec(module) is None:
            return (f"the dashboard needs the package {module!r}, which is not installed: "
                    "pip install 'sowtel[tensorboard]'")
    return None


def _plugins() -> list[Any]:
    """TensorBoard's plugins with sowtel's: loaded here too, so the depth view is there even
    when the ``tensorboard_plugins`` entry point of an older install is stale."""
    from tensorboard import default

    from sowtel.tensorboard_plugin import PLUGIN_NAME, TensorBoardPlugin

    others = [p for p in default.get_plugins()
              if getattr(p, "plugin_name", None) != PLUGIN_NAME]
    return [*others, TensorBoardPlugin]


def _launch(logdir: str, host: str, port: int) -> str:
    from tensorboard import program

    board: Any = program.TensorBoard(plugins=_plugins())
    board.configure(argv=[
        "tensorboard", "--logdir", logdir, "--host", host, "--port", str(port),
        "--reload_interval", str(_RELOAD_SECS),
        # The depth view needs every step of its tensors, not TensorBoard's sample of them.
        "--samples_per_plugin", SAMPLES_PER_PLUGIN,
    ])
    url: str = board.launch()
    # TensorBoard names the machine in its URL; show the address actually bound.
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" if host not in ("0.0.0.0", "::") else url


# -- sowtel dashboards: where the ready-made Grafana dashboards are installed -----------------

def dashboards_path() -> str:
    """The folder of the dashboards installed with sowtel: ``grafana/*.json`` and a README.

    They ship inside the package (``sowtel.dashboards``), so a ``pip install sowtel`` has them
    as a clone does.

    Example:
        >>> sorted(os.listdir(os.path.join(dashboards_path(), "grafana")))
        ['sowtel-metrics.json', 'sowtel-traces.json']
    """
    try:
        import sowtel.dashboards as shipped
    except ImportError as e:
        raise FileNotFoundError(f"sowtel's dashboards are not installed with this sowtel ({e}): "
                                "reinstall it (pip install --force-reinstall sowtel)") from e
    return os.path.dirname(os.path.abspath(shipped.__file__ or ""))


def configure_dashboards(parser: argparse.ArgumentParser) -> None:
    """Adds the ``sowtel dashboards`` options to ``parser``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> configure_dashboards(p)
        >>> p.parse_args(["--path"]).path
        True
    """
    parser.add_argument("--path", action="store_true",
                        help="print only the folder (for scripts: cp -r \"$(sowtel dashboards "
                             "--path)/grafana\" ...)")


def run_dashboards(args: argparse.Namespace) -> int:
    """Prints where the dashboards are (with ``--path``, the folder alone); exit status 0.

    Example:
        >>> run_dashboards(argparse.Namespace(path=True))  # doctest: +ELLIPSIS
        /.../dashboards
        0
    """
    try:
        path = dashboards_path()
    except FileNotFoundError as e:
        print(f"sowtel dashboards: error: {e}", file=sys.stderr)
        return 2
    if args.path:
        print(path)
        return 0
    print(f"sowtel's dashboards are in {path}")
    for folder, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if name.endswith((".json", ".md")):
                print(f"  {os.path.relpath(os.path.join(folder, name), path)}")
    print("Import the Grafana JSON files (Dashboards > New > Import), or provision the "
          "grafana folder; README.md says how.")
    return 0
