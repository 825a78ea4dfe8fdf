"""Ready-made dashboards, installed with sowtel as ``sowtel.dashboards`` (package data).

``grafana/sowtel-metrics.json`` and ``grafana/sowtel-traces.json`` are Grafana dashboards of
what the ``otel`` exporter emits; ``README.md`` says how to import or provision them. Their
folder, wherever sowtel is installed:

    $ sowtel dashboards --path

Example:
    >>> import os, sowtel.dashboards
    >>> sorted(os.listdir(os.path.join(os.path.dirname(sowtel.dashboards.__file__), "grafana")))
    ['sowtel-metrics.json', 'sowtel-traces.json']
"""
