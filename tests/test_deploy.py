"""deploy/: the Grafana dashboard and the Prometheus alert rules, checked against a live server.

A real ``kvstore serve`` (a child process, as operators run it) is driven through every
path that feeds a metric family: SDK puts and gets (shared memory and HTTP), a 404, a refused
token, a planner rollback, an engine connector's report, lm:// requests and a bad lm://
request. Its ``/metrics`` is then parsed, and every metric name any PromQL expression of
``deploy/`` names must be among the samples exported. ``promtool`` checks run too where one
is on PATH (or named by ``$PROMTOOL``); they are skipped otherwise, except under ``.ci/run``,
which unpacks Debian's and sets ``KVSTORE_REQUIRE_PROMTOOL``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.reliability_kit.serve_process import ServeProcess, small_env
from bench.serving import free_port
from client_sdk import KVClient
from kvstore import KVSpec
from kvstore.decisions import PREDICTION_ERROR
from server.connector_board import RETIRED
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvstore.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ADMIN = "deploy-admin-token-0123456789"

# --------------------------------------------------------------------------- PromQL names

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "atan2", "inf", "nan", "start", "end",
}
_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling",
              "scrape_series_added"}
"""Series Prometheus itself adds to every target: no exporter has them."""


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: PromQL or a Grafana query (``$var``, ``label_values``).

    Strings (label values), label matchers, grouping label lists, range and offset durations,
    numbers, functions, aggregations and keywords are not names; Prometheus's own ``up`` and
    ``scrape_*`` series are left out.
    """
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"#[^\n]*", " ", s)  # comments
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables ($__rate_interval, ${DS}, $job)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # range and subquery durations
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    s = re.sub(r"\blabel_values\s*\(([^,()]*),[^()]*\)", r" \1 ", s)  # Grafana: label_values(metric, label)
    s = re.sub(r"\blabel_values\s*\([^()]*\)", " ", s)  # label_values(label): no metric
    s = re.sub(r"\b(label_replace|label_join)\s*\(([^,()]*(?:\([^()]*\)[^,()]*)*),[^()]*\)", r" \2 ", s)
    s = re.sub(r"\boffset\s+-?\w+", " ", s)  # offset 1h
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS or word in _SYNTHETIC:
            continue  # a function or aggregation, a keyword, or Prometheus's own series
        names.add(word)
    return names


def test_the_extractor_finds_metric_names_and_only_them():
    expr = ('histogram_quantile(0.99, sum by (le, route) (rate(kvstore_request_duration_seconds_bucket'
            '{job=~"$job", route!="/v1/kv_get_total", x=\'a{b}\'}[$__rate_interval]))) > 1e3 and on (instance) '
            'sum without (tier) (kvstore_tier_bytes offset 1h) / ignoring(kind) group_left(tier) '
            'kvstore_tier_capacity_bytes[5m:1m] or up{job="kvstore"} == 0 unless absent(kvstore_blocks)')
    assert promql_metric_names(expr) == {"kvstore_request_duration_seconds_bucket", "kvstore_tier_bytes",
                                         "kvstore_tier_capacity_bytes", "kvstore_blocks"}
    assert promql_metric_names('label_values(kvstore_uptime_seconds{job=~"$job"}, instance)') == {
        "kvstore_uptime_seconds"}
    assert promql_metric_names("label_values(job)") == set()
    assert promql_metric_names('{__name__="kvstore_blocks"}') == set()  # a name only as a label value: none
    assert promql_metric_names("abs(ln(kvstore_raw_bytes)) > 0.693 and bool -inf") == {"kvstore_raw_bytes"}


def test_the_check_catches_a_made_up_metric(exported):
    """The negative case: a name the server does not export is reported, however it is written."""
    for expr in ('sum(rate(kvstore_made_up_total{job="kvstore"}[5m]))',
                 "kvstore_tier_bytes / on (tier) kvstore_tier_capacity_bytez",
                 'histogram_quantile(0.5, sum by (le) (rate(kvstore_request_duration_seconds_bukket[5m])))'):
        assert _missing({"probe": expr}, exported), expr
    assert not _missing({"probe": 'sum(rate(kvstore_requests_total{status=~"5.."}[5m]))'}, exported)


def _missing(exprs: dict[str, str], exported: set[str]) -> dict[str, set[str]]:
    out = {}
    for where, expr in exprs.items():
        unknown = promql_metric_names(expr) - exported
        if unknown:
            out[where] = unknown
    return out


# --------------------------------------------------------------------------- the files


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def dashboard_exprs() -> dict[str, str]:
    """Every PromQL expression of the dashboard (panel targets and variable queries), by where it is."""
    dash = _dashboard()
    out = {}
    for p in _panels(dash):
        for t in p.get("targets", []):
            out[f"panel {p['title']!r} {t.get('refId')}"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out[f"variable {v['name']}"] = q["query"] if isinstance(q, dict) else q
    return out


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def alert_exprs() -> dict[str, str]:
    return {f"alert {r['alert']}": r["expr"] for r in _rules()}


def test_the_dashboard_is_a_grafana_dashboard_whose_panels_all_query_prometheus():
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds_var = variables["DS_PROMETHEUS"]
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    panels = list(_panels(dash))
    assert len(panels) >= 20
    ids = [p["id"] for p in dash["panels"]] + [q["id"] for p in dash["panels"] for q in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        where = f"panel {p.get('title')!r}"
        assert p["title"] and p["type"] in {"timeseries", "stat", "bargauge", "gauge", "table"}, where
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, where
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, where
        assert p["targets"], f"{where} has no target"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), where
            assert t.get("datasource", p["datasource"]) == p["datasource"], where
            assert promql_metric_names(t["expr"]) or t["expr"].startswith("up{"), f"{where}: names no metric"
            assert t["expr"].count("(") == t["expr"].count(")"), where
            # every series scoped to the chosen job and instance ($job/$instance), but Prometheus's up
            for sel in re.findall(r"\b(kvstore_\w+)\{([^}]*)\}", t["expr"]):
                assert 'job=~"$job"' in sel[1] and 'instance=~"$instance"' in sel[1], (where, sel)
    for name in ("job", "instance"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def test_the_alert_rules_are_complete_prometheus_rules():
    doc = yaml.safe_load(ALERTS.read_text())
    assert doc["groups"]
    names = []
    for g in doc["groups"]:
        assert g["name"] and g["rules"], g.get("name")
        for r in g["rules"]:
            where = r.get("alert")
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, where
            assert re.fullmatch(r"Kvstore[A-Z][A-Za-z0-9]+", r["alert"]), where
            assert isinstance(r["expr"], str) and r["expr"].strip(), where
            assert re.fullmatch(r"\d+[smh]", str(r["for"])), where
            assert r["labels"]["severity"] in {"critical", "warning", "info"}, where
            assert r["annotations"]["summary"].strip() and len(r["annotations"]["description"]) > 40, where
            assert r["expr"].count("(") == r["expr"].count(")"), where
            assert 'job="kvstore"' in r["expr"], f"{where}: scope the rule to the kvstore job"
            names.append(r["alert"])
    assert len(names) == len(set(names)), "alert names must be unique"
    for wanted in ("KvstoreDown", "KvstoreHigh5xxRate", "KvstoreP99LatencyHigh", "KvstoreTierNearlyFull",
                   "KvstoreHitRatioCollapse", "KvstoreCorruptBlocks", "KvstoreAuthFailureSpike",
                   "KvstorePlannerRollback"):
        assert wanted in names


# --------------------------------------------------------------------------- a live server


def _drive(url: str, lm_port: int) -> None:
    """Traffic that gives every family the deploy files name samples."""
    from tests.server import lmwire

    spec = KVSpec("llama-tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16,
                  fingerprint="deploy-rev-1")
    admin = {"authorization": f"Bearer {ADMIN}"}
    toks = list(range(64))
    with KVClient(url, token=ADMIN) as client:  # co-located: shm
        client.put_kv(spec, toks, torch.randn(spec.kv_shape(64), dtype=torch.float16))
        _, n = client.get_kv(spec, toks)
        assert n == 64
        assert client.lookup(spec, toks + [7, 8, 9]) == 64
        client.get_kv(spec, list(range(500, 532)))  # a miss: tokens requested, none hit
    with KVClient(url, token=ADMIN, colocated=False) as client:  # HTTP
        client.put_kv(spec, list(range(100, 132)), torch.randn(spec.kv_shape(32), dtype=torch.float16))
        client.get_kv(spec, list(range(100, 132)))
    assert httpx.get(f"{url}/v1/no-such-route", headers=admin).status_code == 404
    assert httpx.get(f"{url}/admin/stats").status_code == 401  # an auth failure
    resp = httpx.post(f"{url}/admin/policy", headers=admin, timeout=10, json={
        "action": "candidate", "policy": {"version": 2, "prefetch": False}, "fraction": 0.1})
    assert resp.status_code == 200, resp.text
    resp = httpx.post(f"{url}/admin/policy", headers=admin, timeout=10, json={"action": "rollback", "why": "test"})
    assert resp.status_code == 200, resp.text
    resp = httpx.post(f"{url}/v1/connectors/report", headers=admin, json={
        "engine": "vllm", "instance": "deploy-test", "counters": {
            "lookups": 2, "looked_up_tokens": 64, "offered_tokens": 48, "loads": 1, "loaded_tokens": 48,
            "load_seconds": 0.01, "saves": 1, "saved_tokens": 16, "save_seconds": 0.01, "failed_blocks": 0}})
    assert resp.status_code == 200, resp.text
    sock = lmwire.connect(lm_port)
    try:
        assert lmwire.health(sock) == 200
        assert not lmwire.exists(sock, "llama@1@0@abd@bfloat16")
    finally:
        sock.close()
    bad = lmwire.connect(lm_port)
    try:
        bad.sendall(lmwire.meta(99, "x@1@0@0@half"))  # an unknown command: the listener closes it
        assert lmwire.is_closed(bad)
    finally:
        bad.close()


_NEEDED = ("kvstore_requests_total", "kvstore_request_duration_seconds_bucket", "kvstore_auth_failures_total",
           "kvstore_planner_rollbacks_total", "kvstore_planner_decisions_total",
           "kvstore_planner_prediction_ratio_bucket", "kvstore_colocated_ops_total", "kvstore_lmcache_requests_total",
           "kvstore_lmcache_closed_connections_total", "kvstore_connector_looked_up_tokens_total", "kvstore_tier_bytes",
           "kvstore_planner_prediction_error")


def _sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The sample names a live ``kvstore serve``'s /metrics exports once driven."""
    data = tmp_path_factory.mktemp("deploy") / "data"
    lm_port = free_port()
    proc = ServeProcess(small_env(data, KVSTORE_ADMIN_TOKEN=ADMIN), "--lmcache-port", str(lm_port)).start()
    try:
        _drive(proc.url, lm_port)

        def scrape() -> set[str] | None:  # clients report decisions in batches: wait for them to land
            resp = httpx.get(f"{proc.url}/metrics", timeout=10)  # no token: /metrics is open to scrapers
            assert resp.status_code == 200
            names = _sample_names(resp.text)
            return names if all(n in names for n in _NEEDED) else None

        names = wait_until(scrape, timeout_s=30, what="every family to have samples", step_s=0.2)
    finally:
        proc.stop()
    return names


def test_every_metric_the_dashboard_queries_is_exported(exported):
    exprs = dashboard_exprs()
    assert len(exprs) >= 40
    assert not _missing(exprs, exported), _missing(exprs, exported)


def test_every_metric_the_alerts_use_is_exported(exported):
    exprs = alert_exprs()
    assert not _missing(exprs, exported), _missing(exprs, exported)


def test_the_deploy_files_cover_the_main_families(exported):
    """Not every exported name needs a panel, but these do, and the legacy names are not used."""
    used = set().union(*(promql_metric_names(e) for e in {**dashboard_exprs(), **alert_exprs()}.values()))
    for name in ("kvstore_requests_total", "kvstore_request_duration_seconds_bucket", "kvstore_store_ops_total",
                 "kvstore_tier_bytes", "kvstore_tier_capacity_bytes", "kvstore_tier_reads_total", "kvstore_moves_total",
                 "kvstore_colocated_ops_total", "kvstore_planner_decisions_total",
                 "kvstore_planner_prediction_ratio_bucket", "kvstore_planner_rollbacks_total",
                 "kvstore_auth_failures_total", "kvstore_lmcache_connections", "kvstore_tier_up",
                 "kvstore_planner_prediction_error", "kvstore_connector_looked_up_tokens_total",
                 "kvstore_connector_offered_tokens_total", "kvstore_connector_loaded_tokens_total",
                 "kvstore_connector_saved_tokens_total"):
        assert name in used, name
    deprecated = {f"kvstore_tier_{n}_total" for n in ("hits", "misses", "puts", "gets", "errors", "deletes")}
    deprecated |= {f"kvstore_connector_{n}_total" for n in RETIRED}
    assert not used & deprecated, used & deprecated


def test_the_panels_of_defined_figures_use_the_servers_definitions():
    """The prediction error panel quotes ``kvstore.decisions``' definition, so the two cannot drift
    apart; the connector hit ratio is loaded over looked-up tokens, as the server's dashboard shows it."""
    panels = list(_panels(_dashboard()))

    def querying(name: str) -> list[dict[str, Any]]:
        return [p for p in panels if any(name in promql_metric_names(t["expr"]) for t in p["targets"])]

    [error] = querying("kvstore_planner_prediction_error")
    assert PREDICTION_ERROR in error["description"]
    [ratio] = [p for p in querying("kvstore_connector_looked_up_tokens_total") if "hit ratio" in p["title"]]
    [expr] = [t["expr"] for t in ratio["targets"]]
    loaded, looked_up = expr.split(" / ")
    assert promql_metric_names(loaded) == {"kvstore_connector_loaded_tokens_total"}
    assert promql_metric_names(looked_up) == {"kvstore_connector_looked_up_tokens_total"}


# --------------------------------------------------------------------------- promtool, where there is one


def _promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not found or not os.access(found, os.X_OK):
        if os.environ.get("KVSTORE_REQUIRE_PROMTOOL"):  # .ci/run unpacks one: there it must run
            pytest.fail(f"KVSTORE_REQUIRE_PROMTOOL is set but there is no promtool at {found!r}")
        pytest.skip("no promtool on PATH (set $PROMTOOL to one to run these checks)")
    return found


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_alert_rules():
    res = _run(_promtool(), "check", "rules", str(ALERTS))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_parses_every_dashboard_query(tmp_path):
    """The panels' PromQL, Grafana's variables filled in, as recording rules promtool parses."""
    promtool = _promtool()
    subst = {"$__rate_interval": "1m", "$__range": "6h", "$job": ".*", "$instance": ".*"}
    rules = []
    for i, (where, expr) in enumerate(sorted(dashboard_exprs().items())):
        if where.startswith("variable "):
            continue  # label_values() is Grafana's, not PromQL
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, (where, expr)
        rules.append({"record": f"kvstore:dashboard:{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = _run(promtool, "check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr


_RULE_TESTS = """
rule_files: [{alerts}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{{job="kvstore", instance="a:8470"}}'
        values: '1 1 0 0 0 0 0'
      - series: 'kvstore_tier_bytes{{job="kvstore", instance="a:8470", tier="shm", kind="shm"}}'
        values: '99x30'
      - series: 'kvstore_tier_capacity_bytes{{job="kvstore", instance="a:8470", tier="shm", kind="shm"}}'
        values: '100x30'
      - series: 'kvstore_tier_bytes{{job="kvstore", instance="a:8470", tier="nvme", kind="nvme"}}'
        values: '93x30'
      - series: 'kvstore_tier_capacity_bytes{{job="kvstore", instance="a:8470", tier="nvme", kind="nvme"}}'
        values: '100x30'
      - series: 'kvstore_store_ops_total{{job="kvstore", instance="a:8470", counter="corrupt_blocks"}}'
        values: '0 0 0 1 1 1'
      - series: 'kvstore_requests_total{{job="kvstore", instance="a:8470", route="/v1/kv/get", method="POST", status="200"}}'
        values: '0+600x20'
      - series: 'kvstore_requests_total{{job="kvstore", instance="a:8470", route="/v1/kv/get", method="POST", status="503"}}'
        values: '0+60x20'
      - series: 'kvstore_store_ops_total{{job="kvstore", instance="a:8470", counter="tokens_requested"}}'
        values: '0+1000x150'
      - series: 'kvstore_store_ops_total{{job="kvstore", instance="a:8470", counter="tokens_hit"}}'
        values: '0+900x120 108100+100x29'
    alert_rule_test:
      - eval_time: 3m
        alertname: KvstoreDown
        exp_alerts: []
      - eval_time: 5m
        alertname: KvstoreDown
        exp_alerts:
          - exp_labels: {{severity: critical, job: kvstore, instance: "a:8470"}}
      - eval_time: 20m
        alertname: KvstoreTierNearlyFull
        exp_alerts:
          - exp_labels: {{severity: warning, job: kvstore, instance: "a:8470", tier: shm}}
      - eval_time: 4m
        alertname: KvstoreCorruptBlocks
        exp_alerts:
          - exp_labels: {{severity: warning, job: kvstore, instance: "a:8470"}}
      - eval_time: 15m
        alertname: KvstoreHigh5xxRate
        exp_alerts:
          - exp_labels: {{severity: critical, job: kvstore, instance: "a:8470"}}
      - eval_time: 120m
        alertname: KvstoreHitRatioCollapse
        exp_alerts: []
      - eval_time: 150m
        alertname: KvstoreHitRatioCollapse
        exp_alerts:
          - exp_labels: {{severity: warning, job: kvstore, instance: "a:8470"}}
"""


def test_promtool_unit_tests_of_some_alerts(tmp_path):
    """Synthetic series: down after 2 m, a tier at 99% (not one at 93%: between the watermarks),
    a corrupt block, 9% of requests 503, a hit ratio falling from 90% to 10%."""
    promtool = _promtool()
    doc = yaml.safe_load(ALERTS.read_text())
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        rule.pop("annotations")  # promtool compares annotations too; the labels are what is tested
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump(doc))
    path = tmp_path / "alerts-test.yml"
    path.write_text(_RULE_TESTS.format(alerts=json.dumps(str(rules))))
    res = _run(promtool, "test", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
