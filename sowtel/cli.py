"""The ``sowtel`` command: ``demo``, ``dashboard``, ``dashboards``, ``inspect``, ``diff``.

Each subcommand lives in the module that owns its subject; this file only routes to it.

Example:
    $ sowtel --version
    $ sowtel demo --steps 200
    $ sowtel dashboard --logdir runs
    $ sowtel dashboards --path
    $ sowtel inspect dump.safetensors
    $ sowtel diff a.safetensors b.safetensors --rtol 1e-5
    $ sowtel diff runs/baseline runs/bf16
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help). The module defines configure_<command>(parser) and
# run_<command>(args) -> int exit status.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sowtel.demo", "train a small model with sows, streaming to TensorBoard under runs/"),
    "dashboard": ("sowtel.dashboard", "start TensorBoard on 127.0.0.1 with sowtel's layout"),
    "dashboards": ("sowtel.dashboard", "where the Grafana dashboards are installed (--path)"),
    "inspect": ("sowtel.postmortem", "table of a dump's sites, modes, shapes and stats"),
    "diff": ("sowtel.compare", "the first divergence of two runs, or per-entry differences of "
             "two dumps (exit 1 beyond tolerance)"),
}


def build_parser() -> argparse.ArgumentParser:
    from sowtel import __version__

    parser = argparse.ArgumentParser(prog="sowtel", description="Observability for JAX.")
    parser.add_argument("--version", action="version", version=f"sowtel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(command, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        getattr(module, f"configure_{command}")(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(getattr(module, f"run_{args.command}")(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
