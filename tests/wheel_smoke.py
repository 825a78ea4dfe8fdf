"""Checks an installed sowtel wheel as a user's ``pip install sowtel[tensorboard]`` has it.

``make wheel-check`` builds the wheel, installs it (not editable) with the ``tensorboard``
extra in a fresh virtual environment, and runs this file there, from a folder outside the
repository, so that nothing is imported from the checkout. Exit status 0 when every check holds;
otherwise the first failed check's message.

Example:
    $ build/wheel-venv/bin/python tests/wheel_smoke.py
    sowtel 0.1.0 from .../site-packages/sowtel: 7 checks passed
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile


def main() -> int:
    import sowtel
    import sowtel.tensorboard_plugin as plugin
    from sowtel.dashboard import dashboards_path

    where = os.path.dirname(sowtel.__file__)
    checks = 0

    def check(ok: bool, what: str) -> None:
        nonlocal checks
        if not ok:
            raise SystemExit(f"wheel check failed: {what}")
        checks += 1

    check("site-packages" in where, f"sowtel was imported from {where}, not an installed wheel")
    dist = importlib.metadata.distribution("sowtel")
    files = {str(f) for f in dist.files or ()}
    check(any(f.endswith("licenses/LICENSE") for f in files), "no LICENSE in the wheel")
    check(dist.metadata["License-Expression"] == "Apache-2.0", "no licence expression")
    static = os.path.join(os.path.dirname(plugin.__file__), "static")
    check(sorted(os.listdir(static)) == ["charts.js", "index.js"],
          f"the plugin page's files: {os.listdir(static)}")
    grafana = os.path.join(dashboards_path(), "grafana")
    check(sorted(os.listdir(grafana)) == ["sowtel-metrics.json", "sowtel-traces.json"],
          f"the Grafana dashboards at {grafana}")
    [entry] = [e for e in importlib.metadata.entry_points(group="tensorboard_plugins")
               if e.name == "sowtel"]
    check(entry.load().plugin_name == "sowtel", "the TensorBoard entry point")
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "demo")
        out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "sowtel"), "demo",
                              "--steps", "5", "--logdir", run], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        check(out.returncode == 0 and any(n.startswith("events.out.tfevents")
                                          for n in os.listdir(run)),
              f"sowtel demo: exit {out.returncode}\n{out.stderr[-2000:]}")
    print(f"sowtel {sowtel.__version__} from {where}: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
