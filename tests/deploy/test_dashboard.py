"""The Grafana dashboard queries only what the server exports and shows every topic of issue 4.

Every PromQL expression (panel targets and template variables) is reduced to the series names it selects;
each must be a series of a family that ``server.metrics.Metrics`` declares, with the right type (``_bucket``
only on histograms, ``_total`` only on counters) and with the labels its ``by`` clauses group on.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import yaml

from tests.deploy import promql
from tests.deploy.conftest import ROOT
from tests.deploy.exported_metrics import Family, sample_index

# The series issue 4 requires, as Prometheus stores them.
ISSUE_4_SERIES = [
    *(
        f"lookahead_{name}_total"
        for name in (
            "prompt_tokens",
            "generation_tokens",
            "decode_steps",
            "draft_tokens",
            "accepted_tokens",
            "accepted_tokens_per_position",
            "requests",
            "requests_rejected",
            "client_disconnects",
        )
    ),
    *(
        f"lookahead_{name}_{suffix}"
        for name in (
            "acceptance_rate",
            "steps_per_token",
            "tokens_per_step",
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "step_duration_seconds",
        )
        for suffix in ("bucket", "sum", "count")
    ),
    "lookahead_requests_running",
    "lookahead_requests_waiting",
    "lookahead_config_info",
]
ISSUE_4_LABELS = {
    "lookahead_accepted_tokens_per_position": "position",
    "lookahead_requests": "finish_reason",
    "lookahead_requests_rejected": "reason",
}
CONFIG_INFO_LABELS = ("model", "device", "dtype", "window_size", "ngram_size", "guess_set_size")
QUANTILES = ("0.5", "0.9", "0.99")


def metric_problems(queries: list[tuple[str, str]], exported: dict[str, Family]) -> list[str]:
    """Every name, function or grouping label in ``queries`` that the exported metrics do not back."""
    series = sample_index(exported)
    problems = []
    for owner, expr in queries:
        parsed = promql.parse(expr)
        problems += [f"{owner}: unknown function {name}()" for name in sorted(parsed.unknown_functions)]
        problems += [f"{owner}: {name} is not exported" for name in sorted(parsed.metrics - set(series))]
        families = [series[name] for name in parsed.metrics if name in series]
        for labels in parsed.grouping:
            for label in labels:
                if families and not any(family.has_label(label) for family in families):
                    problems.append(f"{owner}: no metric in {expr!r} has the label {label!r}")
    return problems


def readme_queries() -> list[tuple[str, str]]:
    """("README", expr) for each line of the README's ```promql blocks."""
    blocks = re.findall(r"```promql\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    return [("README", line.strip()) for block in blocks for line in block.splitlines() if line.strip()]


def panel_exprs(panel: dict) -> list[str]:
    """The normalized PromQL expressions of one panel."""
    return [promql.normalize(target["expr"]) for target in panel.get("targets", []) if target.get("expr")]


def panel_metrics(panel: dict) -> set[str]:
    """Every series name one panel's expressions select."""
    return {name for expr in panel_exprs(panel) for name in promql.parse(expr).metrics}


def has_quantiles(family: str) -> Callable[[dict], bool]:
    """Predicate: the panel plots p50, p90 and p99 of ``family`` with histogram_quantile over its buckets."""

    def check(panel: dict) -> bool:
        found = set()
        for expr in panel_exprs(panel):
            match = re.match(r"\s*histogram_quantile\(\s*([\d.]+)\s*,", expr)
            if match and f"{family}_bucket" in promql.parse(expr).metrics:
                found.add(match.group(1))
        return found >= set(QUANTILES)

    return check


def uses(*names: str) -> Callable[[dict], bool]:
    """Predicate: the panel selects every one of ``names``."""
    return lambda panel: set(names) <= panel_metrics(panel)


def uses_rate_of(name: str) -> Callable[[dict], bool]:
    """Predicate: the panel takes rate() or increase() of the counter ``name``."""
    return lambda panel: any(re.search(rf"\b(rate|increase)\(\s*{name}\s*\)", expr) for expr in panel_exprs(panel))


def grouped_by(name: str, label: str) -> Callable[[dict], bool]:
    """Predicate: the panel selects ``name`` and groups by ``label``."""

    def check(panel: dict) -> bool:
        return any(
            name in parsed.metrics and any(label in labels for labels in parsed.grouping)
            for parsed in map(promql.parse, panel_exprs(panel))
        )

    return check


def either(*checks: Callable[[dict], bool]) -> Callable[[dict], bool]:
    """Predicate: any of ``checks`` holds."""
    return lambda panel: any(check(panel) for check in checks)


@dataclass(frozen=True)
class Topic:
    """A thing issue 4 wants on the dashboard: a panel of one of ``types`` for which ``check`` holds."""

    name: str
    types: tuple[str, ...]
    check: Callable[[dict], bool]


TIMESERIES = ("timeseries",)
TOPICS = [
    Topic("throughput (tokens/s)", ("timeseries", "stat"), uses_rate_of("lookahead_generation_tokens_total")),
    Topic("TTFT p50/p90/p99", TIMESERIES, has_quantiles("lookahead_time_to_first_token_seconds")),
    Topic("ITL p50/p90/p99", TIMESERIES, has_quantiles("lookahead_inter_token_latency_seconds")),
    Topic("e2e latency p50/p90/p99", TIMESERIES, has_quantiles("lookahead_e2e_request_latency_seconds")),
    Topic("queue time", TIMESERIES, has_quantiles("lookahead_request_queue_time_seconds")),
    Topic("step duration", TIMESERIES, has_quantiles("lookahead_step_duration_seconds")),
    Topic(
        "acceptance rate over time",
        TIMESERIES,
        either(
            uses("lookahead_accepted_tokens_total", "lookahead_draft_tokens_total"),
            uses("lookahead_acceptance_rate_sum", "lookahead_acceptance_rate_count"),
        ),
    ),
    Topic(
        "steps per token over time",
        TIMESERIES,
        either(
            uses("lookahead_steps_per_token_sum", "lookahead_steps_per_token_count"),
            uses("lookahead_decode_steps_total", "lookahead_generation_tokens_total"),
        ),
    ),
    Topic("acceptance rate distribution", ("heatmap",), uses("lookahead_acceptance_rate_bucket")),
    Topic("steps per token distribution", ("heatmap",), uses("lookahead_steps_per_token_bucket")),
    Topic(
        "acceptance by position", ("bargauge",), grouped_by("lookahead_accepted_tokens_per_position_total", "position")
    ),
    Topic("requests running", ("timeseries", "stat"), uses("lookahead_requests_running")),
    Topic("requests waiting", ("timeseries", "stat"), uses("lookahead_requests_waiting")),
    Topic("requests rejected by reason", TIMESERIES, grouped_by("lookahead_requests_rejected_total", "reason")),
    Topic("finish reasons", TIMESERIES, grouped_by("lookahead_requests_total", "finish_reason")),
    Topic("guesses from the shared memory", TIMESERIES, uses_rate_of("lookahead_memory_accepted_tokens_total")),
]


def test_the_server_exports_the_issue_4_metric_set(exported: dict[str, Family]) -> None:
    """Every series of issue 4 exists (the dashboard relies on them), with its labels."""
    series = sample_index(exported)
    assert [name for name in ISSUE_4_SERIES if name not in series] == []
    for family, label in ISSUE_4_LABELS.items():
        assert exported[family].labelnames == (label,), family
    assert exported["lookahead_config"].type == "info"


def test_every_dashboard_expression_names_exported_metrics(dashboard: dict, exported: dict[str, Family]) -> None:
    """No panel or variable queries a metric, function or label the server does not have."""
    queries = list(promql.dashboard_queries(dashboard))
    assert len(queries) >= 20
    assert metric_problems(queries, exported) == []


def test_readme_promql_names_exported_metrics(exported: dict[str, Family]) -> None:
    """The Observability section's PromQL (acceptance rate, steps per token) queries real series."""
    queries = readme_queries()
    named = {name for _, expr in queries for name in promql.parse(expr).metrics}
    assert {"lookahead_accepted_tokens_total", "lookahead_draft_tokens_total", "lookahead_decode_steps_total"} <= named
    assert metric_problems(queries, exported) == []


def test_a_typo_in_the_dashboard_is_caught(dashboard: dict, exported: dict[str, Family]) -> None:
    """The check above can fail: a misspelt metric, a counter read as a histogram, a wrong label."""
    broken = copy.deepcopy(dashboard)
    panel = next(panel for panel in promql.dashboard_panels(broken) if panel.get("targets"))
    original = panel["targets"][0]["expr"]
    for mutation in (
        "sum(rate(lookahead_generation_token_total[5m]))",
        "histogram_quantile(0.9, sum by (le) (rate(lookahead_generation_tokens_total_bucket[5m])))",
        "sum by (finish_reasons) (rate(lookahead_requests_total[5m]))",
        "sum(rat(lookahead_requests_total[5m]))",
    ):
        panel["targets"][0]["expr"] = mutation
        assert len(metric_problems(list(promql.dashboard_queries(broken)), exported)) == 1, mutation
    panel["targets"][0]["expr"] = original
    assert metric_problems(list(promql.dashboard_queries(broken)), exported) == []


def test_every_exported_family_is_on_the_dashboard(dashboard: dict, exported: dict[str, Family]) -> None:
    """Each metric the server exports appears in at least one query."""
    used = {name for _, expr in promql.dashboard_queries(dashboard) for name in promql.parse(expr).metrics}
    series = sample_index(exported)
    shown = {series[name].name for name in used if name in series}
    assert sorted(set(exported) - shown) == []


@pytest.mark.parametrize("topic", TOPICS, ids=[topic.name for topic in TOPICS])
def test_issue_4_topic_has_a_panel(dashboard: dict, topic: Topic) -> None:
    """The dashboard has a panel of the right kind for each topic issue 4 lists."""
    panels = [panel for panel in promql.dashboard_panels(dashboard) if panel.get("type") in topic.types]
    assert any(topic.check(panel) for panel in panels), f"no {'/'.join(topic.types)} panel shows {topic.name}"


def test_histogram_quantiles_aggregate_buckets_by_le(dashboard: dict) -> None:
    """histogram_quantile is only ever applied to _bucket rates summed by le."""
    for owner, expr in promql.dashboard_queries(dashboard):
        if "histogram_quantile" not in expr:
            continue
        parsed = promql.parse(expr)
        assert parsed.metrics and all(name.endswith("_bucket") for name in parsed.metrics), owner
        assert any("le" in labels for labels in parsed.grouping), owner


def test_heatmaps_read_prometheus_buckets(dashboard: dict) -> None:
    """Heatmaps plot pre-bucketed histograms: format heatmap, grouped by le, no client-side bucketing."""
    heatmaps = [panel for panel in promql.dashboard_panels(dashboard) if panel["type"] == "heatmap"]
    assert heatmaps
    for panel in heatmaps:
        assert panel["options"]["calculate"] is False, panel["title"]
        for target in panel["targets"]:
            assert target.get("format") == "heatmap", panel["title"]
            assert any("le" in labels for labels in promql.parse(target["expr"]).grouping), panel["title"]


def test_the_config_info_table_shows_the_configuration(dashboard: dict) -> None:
    """A table reads lookahead_config_info, whose labels carry model, device, dtype and W, N, G."""
    tables = [panel for panel in promql.dashboard_panels(dashboard) if panel["type"] == "table"]
    assert any("lookahead_config_info" in panel_metrics(panel) for panel in tables)
    order = next(t for t in tables[0]["transformations"] if t["id"] == "organize")["options"]["indexByName"]
    assert set(CONFIG_INFO_LABELS) <= set(order)


def test_panels_use_the_provisioned_datasource(dashboard: dict, datasources: list[dict]) -> None:
    """Every panel, target and variable names the provisioned Prometheus datasource by its uid."""
    uids = [source["uid"] for source in datasources if source["type"] == "prometheus"]
    assert len(uids) == 1
    expected = {"type": "prometheus", "uid": uids[0]}
    owners = list(promql.dashboard_panels(dashboard)) + dashboard["templating"]["list"]
    for owner in owners:
        assert owner["datasource"] == expected, owner.get("title", owner.get("name"))
        for target in owner.get("targets", []):
            assert target["datasource"] == expected, owner.get("title")


def test_dashboard_layout(dashboard: dict) -> None:
    """A current schema, a stable uid, unique panel ids and a grid without overlapping panels."""
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    panels = list(promql.all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        columns, rows = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        area = {(x, y) for x in columns for y in rows}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
    assert {panel["type"] for panel in panels} >= {"timeseries", "stat", "heatmap", "bargauge"}


def test_promtool_accepts_every_expression(dashboard: dict, tmp_path) -> None:
    """Prometheus' own parser (promtool check rules) accepts each expression, Grafana variables filled in."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus); PromQL syntax not checked")
    rules = [
        {"record": f"dashboard:query_{index}", "expr": promql.substitute_grafana_variables(expr)}
        for index, (_, expr) in enumerate(promql.dashboard_queries(dashboard))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
