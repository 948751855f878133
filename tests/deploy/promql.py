"""Names in PromQL expressions and the Grafana dashboard, found without a full PromQL parser.

Contract: ``parse(expr)`` returns the metric (sample) names an expression selects, the functions and
aggregations it calls, and the label lists of its ``by`` / ``without`` clauses. String literals, label
matchers, range and subquery brackets, durations, numbers and Grafana variables are not names. Example::

    parse('histogram_quantile(0.9, sum by (le) (rate(x_bucket{a="b"}[$__rate_interval])))')
    -> metrics {"x_bucket"}, functions {"histogram_quantile", "sum", "rate"}, grouping [("le",)]

``dashboard_queries(dashboard)`` yields every query of a Grafana dashboard (panel targets, rows included,
and template variables) with the title of the panel or variable it belongs to.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

FUNCTIONS = frozenset(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
    clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
    double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
    time timestamp vector year
    """.split()
)
AGGREGATIONS = frozenset(
    "avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar sum topk".split()
)
KEYWORDS = frozenset("and atan2 bool by group_left group_right ignoring inf nan offset on or unless without".split())

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)")
_LABEL_LIST = re.compile(r"\b(on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(
    r"(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)|(?P<name>[A-Za-z_:][\w:]*)(?P<call>\s*\()?"
)
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<query>.+),)?\s*(?P<label>\w+)\s*\)\s*$")
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<query>.+)\)\s*$")


@dataclass
class Parsed:
    """What one PromQL expression names."""

    metrics: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    unknown_functions: set[str] = field(default_factory=set)
    grouping: list[tuple[str, ...]] = field(default_factory=list)


def normalize(expr: str) -> str:
    """``expr`` without the parts that hold no metric names (strings, matchers, ranges, variables).

    >>> normalize('rate(x_total{job="a"}[$__rate_interval])')
    'rate(x_total)'
    """
    expr = _STRING.sub('""', expr)
    expr = _VARIABLE.sub("1", expr)
    expr = _MATCHERS.sub("", expr)
    return _BRACKETS.sub("", expr)


def parse(expr: str) -> Parsed:
    """Metric names, called functions and ``by``/``without`` label lists of one PromQL expression."""
    parsed = Parsed()
    text = normalize(expr)
    for match in _GROUPING.finditer(text):
        parsed.grouping.append(tuple(label.strip() for label in match.group(2).split(",") if label.strip()))
    text = _LABEL_LIST.sub(" ", _GROUPING.sub(" ", text))
    for token in _TOKEN.finditer(text):
        name = token.group("name")
        if name is None or name in KEYWORDS:
            continue
        if token.group("call"):
            known = name in FUNCTIONS or name in AGGREGATIONS
            (parsed.functions if known else parsed.unknown_functions).add(name)
        else:
            parsed.metrics.add(name)
    return parsed


def variable_query_expr(query: str) -> str | None:
    """The PromQL inside a Grafana template query (``label_values(expr, label)``, ``query_result(expr)``)."""
    for pattern in (_LABEL_VALUES, _QUERY_RESULT):
        match = pattern.match(query)
        if match:
            return match.group("query")
    return None


def all_panels(panels: list[dict]) -> Iterator[dict]:
    """Every panel, descending into rows (collapsed rows keep their panels inside)."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_panels(dashboard: dict) -> Iterator[dict]:
    """Every non-row panel of a dashboard."""
    return (panel for panel in all_panels(dashboard.get("panels", [])) if panel.get("type") != "row")


def dashboard_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(owner title, PromQL) for every panel target and every query-type template variable."""
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield panel.get("title", "?"), target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        yield f"variable {variable.get('name')}", variable_query_expr(query) or query


def substitute_grafana_variables(expr: str, window: str = "1m") -> str:
    """Replace Grafana's built-in and dashboard variables so a real Prometheus can evaluate ``expr``."""
    for name in ("$__rate_interval", "$__interval", "$__range", "${__rate_interval}", "${__range}"):
        expr = expr.replace(name, window)
    return _VARIABLE.sub(".+", expr)
