"""The Grafana dashboards: their structure, and their queries against what the exporter emits.

The metrics dashboard's PromQL runs against a real Prometheus (Debian's ``prometheus``, which
``make system-deps`` installs) that scrapes the exporter's Prometheus endpoint while a jitted
MLP trains.
The traces dashboard's TraceQL may only name spans, events and attributes the exporter writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import sowtel
from sowtel.exporters.otel import OTelExporter
from sowtel.records import Record
from sowtel.summaries import host_summary

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "dashboards" / "grafana"
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__all"}
PANEL_TYPES = {"row", "stat", "timeseries", "table", "bargauge", "traces"}
# Values Grafana would put in for its own variables, for a 1 s scrape interval.
BUILTIN_VALUES = {"__rate_interval": "5s", "__interval": "1s", "__range": "1m"}


def dashboards() -> dict[str, dict[str, Any]]:
    files = sorted(GRAFANA.glob("*.json"))
    assert files, f"no dashboards in {GRAFANA}"
    return {f.name: json.loads(f.read_text()) for f in files}


def all_panels(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None]]:
    """Every panel with the variable its row repeats over (rows nest collapsed panels)."""
    repeat = None
    for p in dashboard["panels"]:
        if p["type"] == "row":
            repeat = p.get("repeat")
            yield p, None
            for inner in p.get("panels", []):
                yield inner, repeat
        else:
            yield p, repeat


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def variable_query(var: dict[str, Any]) -> str:
    q = var.get("query")
    return q.get("query", "") if isinstance(q, dict) else str(q)


def referenced_variables(text: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", text))


def datasource_kind(dashboard: dict[str, Any]) -> str:
    [ds] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    return ds["query"]


def prom_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(panel title, expression, repeated variable) for every Prometheus target."""
    out = []
    for p, repeat in all_panels(dashboard):
        for t in p.get("targets", []):
            if "expr" in t:
                out.append((p["title"], t["expr"], repeat))
    return out


# -- structure ------------------------------------------------------------------------------


def test_dashboards_have_panels_datasources_and_unique_ids():
    boards = dashboards()
    assert {datasource_kind(d) for d in boards.values()} == {"prometheus", "tempo"}
    uids = [d["uid"] for d in boards.values()]
    assert len(uids) == len(set(uids)), uids
    for name, d in boards.items():
        assert d["title"].startswith("sowtel") and isinstance(d["schemaVersion"], int), name
        kind = datasource_kind(d)
        defined = set(variables(d))
        ids = []
        panels = list(all_panels(d))
        assert sum(p["type"] != "row" for p, _ in panels) >= 5, name
        for p, _ in panels:
            ids.append(p["id"])
            assert p["type"] in PANEL_TYPES, (name, p["type"])
            g = p["gridPos"]
            assert 0 <= g["x"] and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p)
            if p["type"] == "row":
                if "repeat" in p:
                    assert p["repeat"] in defined
                continue
            assert p["title"] and p.get("description"), (name, p["id"])
            assert p["datasource"] == {"type": kind, "uid": "${datasource}"}, (name, p["title"])
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), (name, p["title"])
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"]
                text = t["expr"] if kind == "prometheus" else t["query"]
                assert text.strip(), (name, p["title"])
                used = referenced_variables(text) | referenced_variables(p["title"])
                unknown = used - defined - BUILTIN_VARIABLES
                assert not unknown, (name, p["title"], unknown)
        assert len(ids) == len(set(ids)), (name, ids)
        # Panels do not overlap.
        cells: set[tuple[int, int]] = set()
        for p, _ in panels:
            g = p["gridPos"]
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & area, (name, p["title"])
            cells |= area
        for v in d["templating"]["list"]:
            unknown = referenced_variables(variable_query(v)) - defined - BUILTIN_VARIABLES
            assert not unknown, (name, v["name"], unknown)


def exposition(exporter: OTelExporter) -> str:
    assert exporter.prometheus_url is not None
    with urllib.request.urlopen(exporter.prometheus_url, timeout=10) as response:
        return response.read().decode()


def sample_records(step: int) -> list[Record]:
    x = np.array([1.0, -2.0, np.nan, np.inf, 0.0], np.float32)
    s = host_summary(x, "stats")
    return [Record(name=name, mode=mode, tag="intermediates", step=step, index=index,
                   wall_time=time.time(), summary="stats", shape=x.shape, dtype="float32",
                   stats=s["stats"])
            for name, mode, index in (("a/h", "primal", None), ("a/h", "cotangent", None),
                                      ("scan/x", "primal", 3))]


def test_every_metric_and_label_a_dashboard_queries_is_one_the_exporter_emits():
    exporter = OTelExporter(prometheus="127.0.0.1:0")
    # Within a session, so the counters read from sowtel.status() have their exporter labels.
    with sowtel.enable(exporter=exporter):
        for step in range(2):
            sowtel.export({"a/h": {"primal": np.array([1.0, np.nan, 0.0], np.float32)}},
                          step=step)
            exporter.write([r for r in sample_records(step) if r.index is not None])
            sowtel.log({"train/loss": 1.0 / (step + 1)}, step=step)
        assert sowtel.flush()
        text = exposition(exporter)
    # A gauge per logged name, holding the latest value.
    assert re.search(r"^sowtel_log_train_loss(\{[^}]*\})? 0\.5$", text, re.MULTILINE), text
    families = set(re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE))
    samples = re.findall(r"^(\w+)\{([^}]*)\}", text, re.MULTILINE)
    labels = {k for _, body in samples for k in re.findall(r'(\w+)="', body)}
    emitted = families | {n for n, _ in samples}
    queried: set[str] = set()
    for board in dashboards().values():
        if datasource_kind(board) != "prometheus":
            continue
        texts = [e for _, e, _ in prom_expressions(board)]
        texts += [variable_query(v) for v in board["templating"]["list"] if v["type"] == "query"]
        for text in texts:
            # A matcher on metric names (the logged values' gauges) names a family, not a metric.
            families_queried = re.findall(r'__name__=~"(sowtel_\w+)\.\+"', text)
            for prefix in families_queried:
                assert any(e.startswith(prefix) for e in emitted), (text, prefix)
            text = re.sub(r'__name__=~"[^"]*"', "", text)
            names = set(re.findall(r"\bsowtel_\w+", text))
            grouped = {n for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text)
                       for n in re.findall(r"\w+", clause)}
            grouped |= set(re.findall(r"label_values\(.*,\s*(\w+)\)", text))
            label_names = {n for n in names if n in grouped or re.search(rf"\b{n}\s*[=!]", text)}
            metric_names = names - label_names
            queried |= metric_names
            assert metric_names <= emitted, (text, metric_names - emitted)
            assert label_names <= labels, (text, label_names - labels)
    # The dashboards show every statistic and counter, not a subset.
    assert queried >= {"sowtel_mean", "sowtel_std", "sowtel_l2", "sowtel_min", "sowtel_max",
                       "sowtel_nonfinite_elements_total", "sowtel_records_dropped_total",
                       "sowtel_records_exported_total", "sowtel_exporter_errors_total"}


def test_traceql_names_only_what_the_exporter_writes():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    exporter = OTelExporter(tracer_provider=provider, max_events_per_span=2)
    exporter.write(sample_records(0))
    exporter.close()
    finished = spans.get_finished_spans()
    assert {sp.attributes["sowtel.part"] for sp in finished} == {0, 1}
    span_attrs = {k for sp in finished for k in sp.attributes}
    event_attrs = {k for sp in finished for e in sp.events for k in e.attributes}
    event_names = {e.name for sp in finished for e in sp.events}
    own = OTelExporter()
    resource_attrs = set(own.tracer_provider.resource.attributes)
    own.close()
    [traces] = [d for d in dashboards().values() if datasource_kind(d) == "tempo"]
    assert variables(traces)["service"]["query"] == "sowtel"  # the exporter's default name
    queries = [t["query"] for p, _ in all_panels(traces) for t in p.get("targets", [])]
    assert any("event." in q for q in queries) and any("span." in q for q in queries)
    for q in queries:
        if q.startswith("$"):
            continue  # a trace id typed into a variable
        assert q.startswith("{") and q.endswith("}"), q
        for scope, attr in re.findall(r"\b(resource|span|event)\.([\w.]+)", q):
            known = {"resource": resource_attrs, "span": span_attrs, "event": event_attrs}[scope]
            assert attr in known, (q, scope, attr)
        for name in re.findall(r'(?<![:.\w])name\s*=\s*"([^"]+)"', q):
            assert name in {sp.name for sp in finished}, (q, name)
        for name in re.findall(r'event:name\s*=\s*"([^"]+)"', q):
            assert name in event_names, (q, name)


# -- a real Prometheus ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, **params: Any) -> Any:
    query = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}?{query}" if query else url, timeout=10) as response:
        body = json.loads(response.read().decode())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on 127.0.0.1, scraping every second the targets written to its file."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    assert os.path.exists(binary), (
        "the prometheus binary is missing: install Debian's package (apt-get install "
        "prometheus; make test does it with make system-deps) to run this test")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sowtel\n    file_sd_configs:\n"
        f"      - files: ['{targets}']\n        refresh_interval: 1s\n")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready in 30 s"
            time.sleep(0.1)
        yield url, targets
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def fill(expr: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


def any_of(items: list[str]) -> str:
    # What Grafana substitutes for a multi-value variable set to "All".
    return "(" + "|".join(re.escape(i).replace("\\", "\\\\") for i in items) + ")"


def mlp_loss(params, x, step):
    w1, w2 = params
    with sowtel.at_step(step):
        h = sowtel.sow(jnp.tanh(x @ w1), "mlp/h1")
        sowtel.sow(jnp.log(h), "mlp/log_h1")  # negative entries give NaN: a diagnostic site

        def layer(c, scale):  # three residual layers under scan: the depth panels' data
            return c + sowtel.sow(jnp.tanh(c) * scale, "mlp/layers"), None

        h, _ = jax.lax.scan(layer, h, jnp.array([0.5, 0.25, 0.125]))
        out = sowtel.sow(h @ w2, "mlp/out")
    return jnp.mean(out ** 2)


def test_every_promql_expression_returns_data_from_a_real_prometheus(prometheus):
    url, targets = prometheus
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    params = (jax.random.normal(k1, (4, 16)), jax.random.normal(k2, (16, 2)))
    x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
    grad = jax.jit(jax.grad(mlp_loss))
    [metrics] = [d for d in dashboards().values() if datasource_kind(d) == "prometheus"]
    exprs = prom_expressions(metrics)
    otel = OTelExporter(prometheus="127.0.0.1:0")
    target = urllib.parse.urlparse(otel.prometheus_url).netloc
    targets.write_text(json.dumps([{"targets": [target]}]))
    sites = ["mlp/h1", "mlp/log_h1", "mlp/layers", "mlp/out"]
    values = {"job": "sowtel", "site": any_of(sites), "mode": any_of(["cotangent", "primal"]),
              **BUILTIN_VALUES}
    missing: list[str] = []
    with sowtel.enable(exporter=otel):
        step, deadline = 0, time.monotonic() + 60
        while True:
            for _ in range(20):
                params = jax.tree.map(lambda p, g: p - 0.01 * g, params, grad(params, x, step))
                sowtel.log({"loss": 1.0 / (step + 1)}, step=step)
                step += 1
            time.sleep(0.25)
            missing = []
            for title, expr, repeat in exprs:
                # A repeated row shows one site per copy: each must have data.
                for site in (sites if repeat == "site" else [None]):
                    filled = fill(expr, values | ({"site": re.escape(site)} if site else {}))
                    if not http_json(f"{url}/api/v1/query", query=filled)["result"]:
                        missing.append(f"{title}: {filled}")
            if not missing or time.monotonic() > deadline:
                break
        # The variables' label_values() queries list the sites and modes that streamed.
        found = {}
        for name in ("job", "site", "mode"):
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable_query(
                variables(metrics)[name]))
            assert m, variable_query(variables(metrics)[name])
            found[name] = set(http_json(f"{url}/api/v1/label/{m.group(2)}/values",
                                        **{"match[]": fill(m.group(1), values)}))
        # Numbers, not just presence: the step gauge holds the latest streamed step (asked
        # while the exporter still serves: Prometheus marks a series stale once it is gone).
        latest = http_json(f"{url}/api/v1/query",
                           query='sowtel_step{sowtel_name="mlp/out", sowtel_mode="primal"}')
    assert not missing, "expressions without data after 60 s:\n" + "\n".join(missing)
    assert found == {"job": {"sowtel"}, "site": set(sites), "mode": {"primal", "cotangent"}}
    assert 0 < float(latest["result"][0]["value"][1]) < step


def scraped_series(text: str) -> list[str]:
    """The series of one scrape in Prometheus's text format, one entry per sample line."""
    return [line.rsplit(" ", 1)[0] for line in text.splitlines()
            if line and not line.startswith("#")]


def prometheus_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{")]
    return value


def test_one_series_per_label_set_in_each_scrape_after_flushes(prometheus):
    # Every sowtel.flush() flushes the exporter's meter provider; a Prometheus reader must not
    # turn each flush into one more copy of every series in the next scrape.
    url, targets = prometheus
    loss = jax.jit(jax.grad(lambda w: jnp.sum(sowtel.sow(jnp.tanh(w), "h") ** 2)))
    with sowtel.enable(exporter="otel", prometheus="127.0.0.1:0") as session:
        [otel] = session.exporters
        for step in range(4):
            loss(jnp.linspace(-1.0, 1.0, 8) * step)
            sowtel.flush()
        assert isinstance(otel, OTelExporter) and otel.prometheus_url
        targets.write_text(json.dumps(
            [{"targets": [urllib.parse.urlparse(otel.prometheus_url).netloc]}]))
        deadline = time.monotonic() + 60
        while not http_json(f"{url}/api/v1/query", query='up{job="sowtel"} == 1')["result"]:
            assert time.monotonic() < deadline, "Prometheus did not scrape the exporter in 60 s"
            time.sleep(0.2)
        # The real Prometheus: every sample it scraped is a series of its own.
        scraped = http_json(f"{url}/api/v1/query", query='scrape_samples_scraped{job="sowtel"}')
        stored = http_json(f"{url}/api/v1/query",
                           query='count({job="sowtel", __name__=~"sowtel_.*|target_info"})')
        assert float(scraped["result"][0]["value"][1]) == float(stored["result"][0]["value"][1])
        assert prometheus_counter(
            url, "prometheus_target_scrapes_sample_duplicate_timestamp_total") == 0
        # And one scrape of our own, after more flushes.
        for _ in range(3):
            sowtel.flush()
        with urllib.request.urlopen(otel.prometheus_url, timeout=10) as response:
            series = scraped_series(response.read().decode())
    assert len(series) == len(set(series))
    means = [s for s in series if s.startswith("sowtel_mean{")]
    assert sorted(re.search(r'sowtel_mode="(\w+)"', s).group(1) for s in means) == [
        "cotangent", "primal"]
