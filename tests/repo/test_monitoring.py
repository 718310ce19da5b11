"""configs/monitoring/ (the Cloud Monitoring dashboard and alert policies of a newsvec Dataflow job,
docs/dataflow-operations.md, "Dashboard and alerts") checked without Cloud Monitoring:

- every newsvec metric they name is one the code emits: the ``Metrics.counter``, ``distribution``
  and ``gauge`` calls of pipeline/ and transforms/ are read from their AST (namespace and name,
  through module constants and imports), and the per-reason dead-letter counters, the only ones
  named at run time, are named by ``transforms.types.Reason``; and every metric the code emits is
  on the dashboard;
- each file holds what the API reads: a policy parses, strictly, as the API's ``AlertPolicy``
  message (google-cloud-monitoring's own protobuf: an unknown field, a wrong type or an enum
  value that does not exist fails), in the JSON names gcloud reads, with the rules the API's
  reference states; the dashboard, whose protobuf is not installed, against the fields of the
  ``Dashboard`` resource it uses, written out below from the API's protos
  (googleapis, google/monitoring/dashboard/v1);
- every query of a job's metrics is limited to ``${JOB_NAME}``, of the subscription to
  ``${SUBSCRIPTION}``, and those placeholders and ``${NOTIFICATION_CHANNEL}`` are the ones
  docs/dataflow.md says to substitute; each policy names its runbook, a heading of
  docs/dataflow-operations.md.

How Dataflow names a Beam metric in Cloud Monitoring (``dataflow.googleapis.com/job/user_counter``,
label ``metric_name``, no namespace; a distribution as ``<name>_MEAN``, ``_MAX``, ``_MIN``,
``_COUNT``) is taken from Google's list of Dataflow metrics and from Beam's Dataflow client
(``apache_beam/runners/dataflow/dataflow_metrics.py``), not from Cloud Monitoring itself.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from google.cloud import monitoring_v3
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tests.repo.test_docs import anchors

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "configs" / "monitoring"
DASHBOARDS = sorted(MONITORING.glob("dashboard*.json"))
POLICIES = sorted(MONITORING.glob("alert-*.json"))
RUNBOOK = REPO / "docs" / "dataflow-operations.md"  # what each alert means, what to do
INSTALL = REPO / "docs" / "dataflow.md"  # step 10: the placeholders and the commands
CODE_ROOTS = ("pipeline", "transforms")

PLACEHOLDERS = {"JOB_NAME", "SUBSCRIPTION", "NOTIFICATION_CHANNEL"}
EXAMPLE_VALUES = {"JOB_NAME": "newsvec-daily-.*", "SUBSCRIPTION": "news",
                  "NOTIFICATION_CHANNEL": "projects/p/notificationChannels/1"}
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")

USER_COUNTER = "dataflow.googleapis.com/job/user_counter"
# Dataflow exports a Beam distribution as one user counter per statistic (Beam's Dataflow client
# reads them back so: "four different scalar metrics labeled as _MIN, _MAX, _COUNT_, _MEAN").
DISTRIBUTION_SUFFIXES = ("_MEAN", "_MAX", "_MIN", "_COUNT")
# The metric types the files may name: their monitored resource and kind, from Google's list of
# Cloud metrics (dataflow, pubsub). All are gauges: a Beam counter is a gauge holding the job's
# running total.
METRIC_TYPES = {
    USER_COUNTER: ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/system_lag": ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/data_watermark_age": ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/backlog_bytes": ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/backlog_elements": ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/estimated_backlog_processing_time": ("dataflow_job", "GAUGE"),
    "dataflow.googleapis.com/job/gpu_utilization": ("dataflow_job", "GAUGE"),
    "pubsub.googleapis.com/subscription/num_undelivered_messages": ("pubsub_subscription", "GAUGE"),
    "pubsub.googleapis.com/subscription/oldest_unacked_message_age": ("pubsub_subscription",
                                                                      "GAUGE"),
}
# "valid for CUMULATIVE and DELTA metrics" only (the API's Aggregation.Aligner)
NOT_FOR_GAUGES = {"ALIGN_DELTA", "ALIGN_RATE"}
# how each query limits itself to the job, the subscription, the job's logs
JOB_IN_FILTER = 'resource.labels.job_name=monitoring.regex.full_match("${JOB_NAME}")'
JOB_IN_PROMQL = ('monitored_resource="dataflow_job"', 'job_name=~"${JOB_NAME}"')
SUBSCRIPTION_IN_FILTER = 'resource.labels.subscription_id="${SUBSCRIPTION}"'
SUBSCRIPTION_IN_PROMQL = ('monitored_resource="pubsub_subscription"',
                          'subscription_id="${SUBSCRIPTION}"')
JOB_IN_LOGS = ('resource.type="dataflow_step"', 'resource.labels.job_name=~"^(${JOB_NAME})$"')


def load(path: Path) -> dict:
    return json.loads(path.read_text())


# -- what the code emits ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MetricCall:
    """One ``Metrics.counter/distribution/gauge(namespace, name)`` call of the code."""

    kind: str
    namespace: Optional[str]  # None: not a constant the AST resolves
    name: Optional[str]
    where: str  # module:line
    function: Optional[str]  # the function it is in


def code_sources() -> dict[str, str]:
    """module -> source, for every .py file of pipeline/ and transforms/."""
    sources = {}
    for root in CODE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = \
                path.read_text()
    return sources


def metric_calls(sources: dict[str, str]) -> list[MetricCall]:
    """Every Beam metric the sources create, its namespace and name resolved where they are string
    constants: a literal, a module-level constant, or one imported from another module."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    constants = {module: {target.id: node.value.value for node in tree.body
                          if isinstance(node, ast.Assign)
                          and isinstance(node.value, ast.Constant)
                          and isinstance(node.value.value, str)
                          for target in node.targets if isinstance(target, ast.Name)}
                 for module, tree in trees.items()}
    calls = []
    for module, tree in trees.items():
        # the module's names: its own constants, and those it imports from another module
        names = {alias.asname or alias.name: constants.get(node.module or "", {}).get(alias.name)
                 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names}
        names.update(constants[module])
        for function, call in _calls(tree):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr in ("counter", "distribution",
                                                                  "gauge") \
                    and _names_metrics(func.value) and len(call.args) == 2:
                namespace, name = (_string(arg, names) for arg in call.args)
                calls.append(MetricCall(func.attr, namespace, name, f"{module}:{call.lineno}",
                                        function))
    return calls


def _string(node: ast.AST, names: dict[str, Optional[str]]) -> Optional[str]:
    """A string literal's value, or that of a name bound to one; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return names.get(node.id) if isinstance(node, ast.Name) else None


def _names_metrics(node: ast.AST) -> bool:
    """``Metrics`` or ``<...>.Metrics``."""
    return (isinstance(node, ast.Name) and node.id == "Metrics") or \
        (isinstance(node, ast.Attribute) and node.attr == "Metrics")


def _calls(tree: ast.AST, function: Optional[str] = None) -> Iterator[tuple[Optional[str],
                                                                          ast.Call]]:
    """(the function it is in, call) for every call of ``tree``."""
    for node in ast.iter_child_nodes(tree):
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            else function
        if isinstance(node, ast.Call):
            yield function, node
        yield from _calls(node, inner)


def dead_letter_reasons() -> set[str]:
    from transforms.types import Reason

    return {str(reason) for reason in Reason}


@dataclasses.dataclass(frozen=True)
class Emitted:
    """What Cloud Monitoring's ``metric_name`` may be, and what each one is in the code."""

    names: dict[str, str]  # metric_name -> "namespace:name (kind)"
    counters: set[str]  # Beam counter names, every namespace
    distributions: set[str]


def emitted(sources: Optional[dict[str, str]] = None) -> Emitted:
    """The ``metric_name`` of every metric the code emits. A call whose name is not a constant
    must be the dead-letter counter (named by its reason): any other fails, so that a metric named
    at run time is not missed."""
    from transforms import metrics

    calls = metric_calls(code_sources() if sources is None else sources)
    names: dict[str, str] = {}
    counters, distributions = set(), set()
    for call in calls:
        if call.name is None or call.namespace is None:
            assert (call.where.startswith("transforms.metrics:")
                    and call.function == "dead_letter_counter" and call.kind == "counter"
                    and call.namespace == metrics.DEAD_LETTER_NAMESPACE), \
                f"{call.where}: a metric whose namespace or name this test cannot read from the " \
                "code; name it with constants, or teach emitted() what it is"
            found = {str(reason): f"{call.namespace}:{reason} (counter)"
                     for reason in dead_letter_reasons()}
            counters |= set(found)
        elif call.kind == "counter":
            found = {call.name: f"{call.namespace}:{call.name} (counter)"}
            counters.add(call.name)
        elif call.kind == "distribution":
            found = {call.name + suffix: f"{call.namespace}:{call.name} (distribution)"
                     for suffix in DISTRIBUTION_SUFFIXES}
            distributions.add(call.name)
        else:  # how Dataflow exports a Beam gauge to Cloud Monitoring is not known here
            continue
        for name, what in found.items():
            assert names.get(name, what) == what, \
                f"{name} would be two metrics in Cloud Monitoring ({names[name]}, {what}): " \
                "user_counter has no namespace label"
            names[name] = what
    return Emitted(names, counters, distributions)


# -- what the files name ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Query:
    file: str
    where: str  # the JSON path
    language: str  # "filter" (Monitoring), "promql", "logs", "mql"
    text: str


def queries(path: Path, document: Optional[dict] = None) -> list[Query]:
    """Every query of a dashboard or policy, by the field that holds it."""
    found = []
    for where, key, parent, value in _strings(load(path) if document is None else document):
        if key in ("filter", "denominatorFilter"):
            language = "logs" if parent in ("logsPanel", "conditionMatchedLog") else "filter"
        elif key == "prometheusQuery" or (key == "query"
                                          and parent == "conditionPrometheusQueryLanguage"):
            language = "promql"
        elif key == "timeSeriesQueryLanguage" or (key == "query" and parent ==
                                                   "conditionMonitoringQueryLanguage"):
            language = "mql"
        else:
            continue
        found.append(Query(path.name, where, language, value))
    return found


def _strings(node: Any, where: str = "", key: str = "", parent: str = "") -> Iterator[
        tuple[str, str, str, str]]:
    """(JSON path, key, the key of the object holding it, value) of every string."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{where}.{k}", k, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{where}[{i}]", key, parent)
    elif isinstance(node, str):
        yield where, key, parent, node


_FILTER_TYPE = re.compile(r'metric\.type\s*=\s*"([^"]+)"')
_FILTER_RESOURCE = re.compile(r'resource\.type\s*=\s*"([^"]+)"')
_FILTER_NAME = re.compile(r'metric\.labels?\.metric_name\s*=\s*(?:"([^"]*)"|one_of\(([^)]*)\))')
_SELECTOR = re.compile(r'([A-Za-z_:][A-Za-z0-9_:]*)\{((?:[^{}"]|"[^"]*")*)\}')  # quotes hold }
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def promql_name(metric_type: str) -> str:
    """Cloud Monitoring's PromQL name of a metric type: the first '/' becomes ':', every other
    character but letters, digits and '_' becomes '_'."""
    domain, _, path = metric_type.partition("/")
    return re.sub(r"[^A-Za-z0-9_]", "_", domain) + ":" + re.sub(r"[^A-Za-z0-9_]", "_", path)


PROMQL_TYPES = {promql_name(t): t for t in METRIC_TYPES}


def metric_names(query: Query) -> set[str]:
    """The ``metric_name`` values a query of the user counter names; an AssertionError where one
    of its user-counter selections does not name them in a form read here."""
    names: set[str] = set()
    if query.language == "filter":
        if USER_COUNTER not in _FILTER_TYPE.findall(query.text):
            return names
        found = _FILTER_NAME.findall(query.text)
        assert len(found) == 1, f"{query.file}{query.where}: the user counter with no " \
            f"metric.labels.metric_name = \"...\" or one_of(...): {query.text}"
        single, several = found[0]
        names = {single} if single else set(re.findall(r'"([^"]*)"', several))
    elif query.language == "promql":
        name = promql_name(USER_COUNTER)
        selectors = [labels for metric, labels in _SELECTOR.findall(query.text)
                     if metric == name]
        assert len(selectors) == query.text.count(name), \
            f"{query.file}{query.where}: a user-counter selector without labels: {query.text}"
        for labels in selectors:
            matchers = [(op, value) for label, op, value in _MATCHER.findall(labels)
                        if label == "metric_name"]
            assert len(matchers) == 1 and matchers[0][0] in ("=", "=~"), \
                f"{query.file}{query.where}: a user-counter selector names no metric_name with " \
                f"= or =~: {{{labels}}}"
            op, value = matchers[0]
            alternatives = value.split("|") if op == "=~" else [value]
            assert all(_NAME.match(a) for a in alternatives), \
                f"{query.file}{query.where}: metric_name=~ must list names (a|b|c): {value}"
            names |= set(alternatives)
    elif query.language == "mql":
        raise AssertionError(f"{query.file}{query.where}: an MQL query, which this test does not "
                             "read: write it as a filter or in PromQL")
    assert names or query.language == "logs", f"{query.file}{query.where}: no metric_name"
    return names


def referenced(paths: list[Path]) -> dict[str, set[str]]:
    """metric_name -> the files that name it."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for query in queries(path):
            for name in metric_names(query):
                found.setdefault(name, set()).add(path.name)
    return found


def unknown(names: dict[str, set[str]], code: Emitted) -> list[str]:
    return [f"{name} (in {', '.join(sorted(files))})" for name, files in sorted(names.items())
            if name not in code.names]


# -- the tests: metrics -----------------------------------------------------------------------
def test_the_files_are_there():
    assert DASHBOARDS and len(POLICIES) >= 4, sorted(MONITORING.iterdir())
    assert {p.name for p in MONITORING.iterdir()} == {p.name for p in DASHBOARDS + POLICIES}, \
        "configs/monitoring/ holds only dashboard*.json and alert-*.json"


def test_the_code_is_read():
    """The AST reading finds the metrics the stages share and the one a step names inline."""
    code = emitted()
    assert {"events_in", "rows_written", "dead_lettered", "store_loads_skipped"} <= code.counters
    assert {"embed_batch_ms", "batch_docs"} <= code.distributions
    assert {"invalid_json", "embedding_failed"} <= code.counters  # newsvec.dead_letter


def test_the_dead_letter_counters_are_named_by_their_reason():
    from apache_beam.metrics.metricbase import MetricName

    from transforms.metrics import DEAD_LETTER_NAMESPACE, dead_letter_counter
    from transforms.types import Reason

    for reason in Reason:
        name = dead_letter_counter(reason).metric_name
        assert (name.namespace, str(name.name)) == (DEAD_LETTER_NAMESPACE, str(reason)), name
        assert isinstance(name, MetricName)


def test_every_metric_the_files_name_is_one_the_code_emits():
    names = referenced(DASHBOARDS + POLICIES)
    assert names, "the files name no newsvec metric"
    missing = unknown(names, emitted())
    assert not missing, "metric_name values that no Metrics.counter/distribution of pipeline/ " \
        f"or transforms/ emits (renamed in the code?): {missing}"


def test_a_renamed_metric_is_caught():
    """Renaming ``rows_written`` in the code leaves the files naming a metric that is gone."""
    sources = code_sources()
    assert '"rows_written"' in sources["transforms.metrics"]
    sources["transforms.metrics"] = sources["transforms.metrics"].replace('"rows_written"',
                                                                          '"rows_stored"')
    names = referenced(DASHBOARDS + POLICIES)
    assert any(m.startswith("rows_written ") for m in unknown(names, emitted(sources)))
    sources["transforms.metrics"] = sources["transforms.metrics"].replace(
        'Metrics.distribution(NAMESPACE, "embed_batch_ms")',
        'Metrics.distribution(NAMESPACE, "engine_call_ms")')
    assert any(m.startswith("embed_batch_ms_MEAN ") for m in unknown(names, emitted(sources)))


def test_the_dashboard_shows_every_metric_the_code_emits():
    """Each counter, each dead-letter reason, and a statistic of each distribution: a metric added
    to the code is missed here until the dashboard shows it."""
    code = emitted()
    shown = set(referenced(DASHBOARDS))
    missing = sorted(code.counters - shown) + sorted(
        d for d in code.distributions if not any(d + s in shown for s in DISTRIBUTION_SUFFIXES))
    assert not missing, f"metrics the code emits that configs/monitoring/dashboard.json lacks: " \
        f"{missing}"


def test_metric_types_resources_and_aligners():
    """Every metric type is one of Google's, on its monitored resource; no gauge is aligned with
    an aligner the API allows only for cumulative and delta metrics."""
    problems = []
    for path in DASHBOARDS + POLICIES:
        document = load(path)
        for query in queries(path):
            if query.language == "filter":
                types = _FILTER_TYPE.findall(query.text)
                resources = _FILTER_RESOURCE.findall(query.text)
                if len(types) != 1 or len(resources) != 1:
                    problems.append(f"{path.name}{query.where}: one metric.type and one "
                                    f"resource.type: {query.text}")
                    continue
                if types[0] not in METRIC_TYPES:
                    problems.append(f"{path.name}{query.where}: unknown metric {types[0]}")
                    continue
                resource, kind = METRIC_TYPES[types[0]]
                if resources[0] != resource:
                    problems.append(f"{path.name}{query.where}: {types[0]} is on {resource}")
                aligners = {a for _, key, _, a in _strings(_holder(document, query.where))
                            if key == "perSeriesAligner"}
                if kind == "GAUGE" and aligners & NOT_FOR_GAUGES:
                    problems.append(f"{path.name}{query.where}: {aligners & NOT_FOR_GAUGES} on "
                                    f"the gauge {types[0]}")
            elif query.language == "promql":
                for metric, labels in _SELECTOR.findall(query.text):
                    if metric not in PROMQL_TYPES:
                        problems.append(f"{path.name}{query.where}: unknown metric {metric}")
                    elif f'monitored_resource="{METRIC_TYPES[PROMQL_TYPES[metric]][0]}"' \
                            not in labels:
                        problems.append(f"{path.name}{query.where}: {metric} without its "
                                        "monitored_resource")
                problems += _promql_syntax(path.name, query)
    assert not problems, "\n".join(problems)


def _holder(document: dict, where: str) -> Any:
    """The object that holds the field at ``where`` (a JSON path from _strings)."""
    node: Any = document
    steps = re.findall(r"\.(\w+)|\[(\d+)\]", where)[:-1]
    for key, index in steps:
        node = node[key] if key else node[int(index)]
    return node


def _promql_syntax(file: str, query: Query) -> list[str]:
    """Brackets that close in order, and range selectors of a duration."""
    problems, stack = [], []
    text = re.sub(r'"[^"]*"', '""', query.text)
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or "([{"[")]}".index(ch)] != stack.pop():
                return [f"{file}{query.where}: unbalanced {ch}: {query.text}"]
    if stack:
        problems.append(f"{file}{query.where}: unclosed {stack}: {query.text}")
    for window in re.findall(r"\[([^\]]*)\]", text):
        if not re.fullmatch(r"\d+[smhd]", window):
            problems.append(f"{file}{query.where}: range [{window}]")
    return problems


def test_every_query_is_limited_to_the_job_or_the_subscription():
    problems = []
    for path in DASHBOARDS + POLICIES:
        for query in queries(path):
            text = query.text
            if query.language == "filter":
                resource = (_FILTER_RESOURCE.findall(text) or [""])[0]
                wanted = {"dataflow_job": [JOB_IN_FILTER],
                          "pubsub_subscription": [SUBSCRIPTION_IN_FILTER]}.get(resource, ["?"])
            elif query.language == "promql":
                wanted = [m for metric, labels in _SELECTOR.findall(text)
                          for m in (JOB_IN_PROMQL if metric.startswith("dataflow")
                                    else SUBSCRIPTION_IN_PROMQL) if m not in labels]
                if wanted:
                    problems.append(f"{path.name}{query.where}: a selector without {wanted}")
                continue
            else:
                wanted = list(JOB_IN_LOGS)
            missing = [w for w in wanted if w not in text]
            if missing:
                problems.append(f"{path.name}{query.where}: lacks {missing}: {text}")
    assert not problems, "\n".join(problems)


def test_the_log_filters_search_for_what_the_code_logs():
    """A log filter's search terms (its quoted words that compare no field) are the name of an
    exception class of the code or words of a string the code writes (not a docstring), so that
    a reworded log line or a renamed exception fails the test rather than silence the alert."""
    classes, strings = set(), []
    for source in code_sources().values():
        tree = ast.parse(source)
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    id(node) not in docstrings:
                strings.append(node.value.lower())
    searched = 0
    for path in DASHBOARDS + POLICIES:
        for query in queries(path):
            if query.language != "logs":
                continue
            free = re.sub(r'[\w.]+\s*(?:=~|!=|>=|<=|=|:|>|<)\s*"[^"]*"', "", query.text)
            terms = re.findall(r'"([^"]+)"', free)
            assert terms, f"{path.name}{query.where}: a log filter with no search term"
            for term in terms:
                searched += 1
                assert term in classes or any(term.lower() in s for s in strings), \
                    f"{path.name}{query.where}: {term!r} is neither a class of the code nor in " \
                    "a string it writes"
    assert searched


# -- the tests: placeholders ------------------------------------------------------------------
def substitute(text: str, values: dict[str, str]) -> str:
    """What ``envsubst`` does with the placeholders named (docs/dataflow.md, step 10)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def test_the_placeholders_are_the_documented_ones():
    used = {name for path in DASHBOARDS + POLICIES
            for name in _PLACEHOLDER.findall(path.read_text())}
    assert used <= PLACEHOLDERS, f"placeholders the docs do not name: {used - PLACEHOLDERS}"
    assert {"JOB_NAME", "SUBSCRIPTION"} <= used
    install = INSTALL.read_text()
    for name in used:
        assert f"| `${{{name}}}` |" in install, f"docs/dataflow.md's table of placeholders " \
            f"lacks ${{{name}}}"
    envsubst = re.findall(r"envsubst '([^']*)'", install)
    assert envsubst and all(set(_PLACEHOLDER.findall(e)) == used for e in envsubst), \
        f"the docs' envsubst commands must name exactly {sorted(used)}: {envsubst}"
    for path in POLICIES:
        policy = load(path)
        assert policy.get("notificationChannels") == ["${NOTIFICATION_CHANNEL}"], path.name
        assert "${JOB_NAME}" in policy["displayName"], path.name


def test_the_files_hold_after_substitution():
    for path in DASHBOARDS + POLICIES:
        text = substitute(path.read_text(), EXAMPLE_VALUES)
        assert "${" not in text, path.name
        document = json.loads(text)
        if path in POLICIES:
            assert not policy_problems(document, path.name), path.name
        else:
            assert not dashboard_problems(document), path.name


# -- the tests: the alert policies (the API's AlertPolicy) ------------------------------------
CONDITION_KINDS = {"conditionThreshold", "conditionAbsent", "conditionMatchedLog",
                   "conditionMonitoringQueryLanguage", "conditionPrometheusQueryLanguage",
                   "conditionSql"}
_RUNBOOK_LINK = re.compile(r"docs/dataflow-operations\.md#([\w-]+)")


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", duration)
    assert match, f"not a protobuf Duration in JSON: {duration!r}"
    return float(match.group(1))


def json_name_problems(node: Any, descriptor: Descriptor, where: str = "") -> list[str]:
    """Keys that are not the field's JSON name (gcloud reads ``displayName``, not
    ``display_name``), at any depth; maps' keys are free."""
    problems = []
    fields = {f.json_name: f for f in descriptor.fields}
    for key, value in node.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{where}.{key}: not a field's JSON name of {descriptor.full_name}")
            continue
        message = field.message_type
        if message is None or message.GetOptions().map_entry or \
                message.full_name.startswith("google.protobuf."):
            continue
        repeated = field.label == FieldDescriptor.LABEL_REPEATED
        for i, item in enumerate(value if repeated else [value]):
            problems += json_name_problems(item, message, f"{where}.{key}"
                                           + (f"[{i}]" if repeated else ""))
    return problems


def policy_problems(policy: dict, name: str = "") -> list[str]:
    """Why the API would refuse the policy, as its reference describes the AlertPolicy resource
    (the docstrings of google.cloud.monitoring_v3.types.AlertPolicy), and our own rules: a
    runbook in the documentation, and a display name on each condition."""
    try:
        json_format.ParseDict(policy, monitoring_v3.AlertPolicy.pb()())
    except json_format.ParseError as exc:
        return [f"{name}: not an AlertPolicy: {exc}"]
    problems = json_name_problems(policy, monitoring_v3.AlertPolicy.pb().DESCRIPTOR)
    if not policy.get("displayName"):
        problems.append("no displayName")
    documentation = policy.get("documentation", {})
    content = documentation.get("content", "")
    if documentation.get("mimeType") != "text/markdown":
        problems.append('documentation.mimeType must be "text/markdown"')
    if not 0 < len(content) <= 8192:
        problems.append("documentation.content: 1 to 8,192 characters")
    links = _RUNBOOK_LINK.findall(content)
    if not links or any(link not in anchors(RUNBOOK) for link in links):
        problems.append(f"documentation.content names no runbook heading of "
                        f"docs/dataflow-operations.md (docs/dataflow-operations.md#...): {links}")
    if policy.get("combiner", "COMBINE_UNSPECIFIED") == "COMBINE_UNSPECIFIED":
        problems.append("no combiner")
    conditions = policy.get("conditions", [])
    if not 1 <= len(conditions) <= 6:
        problems.append("from one to six conditions")
    for i, condition in enumerate(conditions):
        kinds = CONDITION_KINDS & set(condition)
        if not condition.get("displayName") or len(kinds) != 1:
            problems.append(f"conditions[{i}]: a displayName and one condition kind: {kinds}")
            continue
        kind = kinds.pop()
        if kind in ("conditionMonitoringQueryLanguage", "conditionMatchedLog") and \
                len(conditions) > 1:
            problems.append(f"conditions[{i}]: a {kind} must be the policy's only condition")
        check = _CONDITION_CHECKS.get(kind)
        if check is None:
            problems.append(f"conditions[{i}]: no checks here for {kind}: add them")
        else:
            problems += [f"conditions[{i}].{kind}: {p}" for p in check(condition[kind], policy)]
    for channel in policy.get("notificationChannels", []):
        if channel != "${NOTIFICATION_CHANNEL}" and \
                not re.fullmatch(r"projects/[^/]+/notificationChannels/[^/]+", channel):
            problems.append(f"notificationChannels: not a channel's name: {channel}")
    return [f"{name}: {p}" for p in problems]


def _threshold(condition: dict, policy: dict) -> list[str]:
    problems = []
    text = condition.get("filter", "")
    if not (_FILTER_TYPE.search(text) and _FILTER_RESOURCE.search(text)) or len(text) > 2048:
        problems.append("filter: the metric type and the resource type, at most 2,048 characters")
    if condition.get("comparison") not in ("COMPARISON_GT", "COMPARISON_LT"):
        problems.append("comparison: only COMPARISON_GT and COMPARISON_LT are supported")
    if "thresholdValue" not in condition:
        problems.append("no thresholdValue")
    if "duration" not in condition or seconds(condition["duration"]) % 60:
        problems.append("duration: a multiple of a minute")
    for aggregation in condition.get("aggregations", []):
        problems += _aggregation(aggregation, alerting=True)
    return problems


def _aggregation(aggregation: dict, alerting: bool = False) -> list[str]:
    aligner = aggregation.get("perSeriesAligner", "ALIGN_NONE")
    if aligner == "ALIGN_NONE":
        return []
    if "alignmentPeriod" not in aggregation:
        return ["aggregation: an aligner needs an alignmentPeriod"]
    period = seconds(aggregation["alignmentPeriod"])
    highest = 90_000 if alerting else 104 * 7 * 86_400
    return [] if 60 <= period <= highest else [f"alignmentPeriod {period} s: 60 to {highest}"]


def _promql(condition: dict, policy: dict) -> list[str]:
    problems = []
    if not condition.get("query", "").strip():
        problems.append("an empty query")
    if "evaluationInterval" in condition and (
            seconds(condition["evaluationInterval"]) <= 0
            or seconds(condition["evaluationInterval"]) % 30):
        problems.append("evaluationInterval: a positive multiple of 30 seconds")
    if "duration" in condition:
        seconds(condition["duration"])
    return problems


def _matched_log(condition: dict, policy: dict) -> list[str]:
    problems = [] if condition.get("filter", "").strip() else ["an empty filter"]
    rate = policy.get("alertStrategy", {}).get("notificationRateLimit", {})
    if "period" not in rate:
        problems.append("a log-based policy needs alertStrategy.notificationRateLimit.period")
    return problems


_CONDITION_CHECKS = {"conditionThreshold": _threshold,
                     "conditionPrometheusQueryLanguage": _promql,
                     "conditionMatchedLog": _matched_log}


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_each_policy_is_what_the_api_reads(path):
    problems = policy_problems(load(path), path.name)
    assert not problems, "\n".join(problems)


def test_the_policy_checks_refuse_what_the_api_would():
    policy = load(POLICIES[0])
    assert not policy_problems(policy)
    condition = policy["conditions"][0]
    kind = (CONDITION_KINDS & set(condition)).pop()
    broken = [
        {**policy, "combiner": "ORR"},  # no such enum value
        {**policy, "display_name": "snake case"},  # not the JSON name
        {**policy, "conditions": [{**condition, "conditionThreshhold": {}}]},  # misspelt
        {**policy, "conditions": [{**condition, "conditionAbsent": {"filter": "x"}}]},  # two kinds
        {**policy, "conditions": [{"displayName": "x", "conditionMatchedLog": {"filter": "x"}},
                                  condition]},  # a log match beside another
        {**policy, "documentation": {"content": "no runbook", "mimeType": "text/markdown"}},
        {k: v for k, v in policy.items() if k != "combiner"},
        {**policy, "conditions": [{k: v for k, v in condition.items() if k != kind}]},
    ]
    for bad in broken:
        assert policy_problems(bad), bad


# -- the tests: the dashboard (the API's Dashboard resource) ----------------------------------
# The fields of the Dashboard resource this dashboard may use, by message, from googleapis'
# google/monitoring/dashboard/v1 protos (dashboard, layouts, widget, xychart, metrics, text,
# logs_panel). A type is "string", "int", "number", "bool", "duration", "map" (string to string),
# "aggregation" (read as monitoring_v3.Aggregation, the same fields), a tuple (an enum's values),
# a message's name, or a one-item list (a repeated field).
DASHBOARD_FIELDS: dict[str, dict[str, Any]] = {
    "Dashboard": {"displayName": "string", "labels": "map", "gridLayout": "GridLayout",
                  "mosaicLayout": "MosaicLayout", "rowLayout": "RowLayout",
                  "columnLayout": "ColumnLayout"},
    "GridLayout": {"columns": "int", "widgets": ["Widget"]},
    "MosaicLayout": {"columns": "int", "tiles": ["Tile"]},
    "Tile": {"xPos": "int", "yPos": "int", "width": "int", "height": "int", "widget": "Widget"},
    "RowLayout": {"rows": ["Row"]},
    "Row": {"weight": "int", "widgets": ["Widget"]},
    "ColumnLayout": {"columns": ["Column"]},
    "Column": {"weight": "int", "widgets": ["Widget"]},
    "Widget": {"title": "string", "xyChart": "XyChart", "text": "Text",
               "logsPanel": "LogsPanel"},
    "XyChart": {"dataSets": ["DataSet"], "timeshiftDuration": "duration",
                "thresholds": ["Threshold"], "xAxis": "Axis", "yAxis": "Axis", "y2Axis": "Axis",
                "chartOptions": "ChartOptions"},
    "DataSet": {"timeSeriesQuery": "TimeSeriesQuery",
                "plotType": ("LINE", "STACKED_AREA", "STACKED_BAR", "HEATMAP"),
                "legendTemplate": "string", "minAlignmentPeriod": "duration",
                "targetAxis": ("Y1", "Y2")},
    "Axis": {"label": "string", "scale": ("LINEAR", "LOG10")},
    "ChartOptions": {"mode": ("COLOR", "X_RAY", "STATS")},
    "Threshold": {"label": "string", "value": "number"},
    "TimeSeriesQuery": {"timeSeriesFilter": "TimeSeriesFilter",
                        "timeSeriesFilterRatio": "TimeSeriesFilterRatio",
                        "timeSeriesQueryLanguage": "string", "prometheusQuery": "string",
                        "unitOverride": "string", "outputFullDuration": "bool"},
    "TimeSeriesFilter": {"filter": "string", "aggregation": "aggregation",
                         "secondaryAggregation": "aggregation"},
    "TimeSeriesFilterRatio": {"numerator": "RatioPart", "denominator": "RatioPart",
                              "secondaryAggregation": "aggregation"},
    "RatioPart": {"filter": "string", "aggregation": "aggregation"},
    "Text": {"content": "string", "format": ("MARKDOWN", "RAW")},
    "LogsPanel": {"filter": "string", "resourceNames": ["string"]},
}
# oneofs: exactly one of these fields is set
DASHBOARD_ONEOFS = {
    "Dashboard": ("gridLayout", "mosaicLayout", "rowLayout", "columnLayout"),
    "Widget": ("xyChart", "text", "logsPanel"),
    "TimeSeriesQuery": ("timeSeriesFilter", "timeSeriesFilterRatio", "timeSeriesQueryLanguage",
                        "prometheusQuery"),
}
# required by the API ("Required." in the protos) and, for a widget's title, by us
DASHBOARD_REQUIRED = {"Dashboard": {"displayName"}, "Widget": {"title"},
                      "DataSet": {"timeSeriesQuery"}, "XyChart": {"dataSets"},
                      "TimeSeriesFilter": {"filter"}, "RatioPart": {"filter"},
                      "Tile": {"width", "height", "widget"}}


def dashboard_problems(node: Any, message: str = "Dashboard", where: str = "") -> list[str]:
    """Why the Dashboard API would refuse ``node`` as a ``message``, as far as the fields above
    tell."""
    if not isinstance(node, dict):
        return [f"{where}: a {message} is an object"]
    problems = []
    fields = DASHBOARD_FIELDS[message]
    for key in node.keys() - fields.keys():
        problems.append(f"{where}.{key}: not a field of {message} (known to this test)")
    for key in DASHBOARD_REQUIRED.get(message, set()) - node.keys():
        problems.append(f"{where}: a {message} needs {key}")
    if message in DASHBOARD_ONEOFS:
        set_ = [k for k in DASHBOARD_ONEOFS[message] if k in node]
        if len(set_) != 1:
            problems.append(f"{where}: a {message} holds one of {DASHBOARD_ONEOFS[message]}, "
                            f"not {set_}")
    for key, value in node.items():
        if key in fields:
            problems += _field_problems(value, fields[key], f"{where}.{key}")
    if message == "XyChart" and not node.get("dataSets"):
        problems.append(f"{where}: an XyChart needs a data set")
    if message == "MosaicLayout":
        problems += _tile_problems(node)
    if message == "TimeSeriesFilter" and "aggregation" in node:
        problems += [f"{where}: {p}" for p in _aggregation(node["aggregation"])]
    return problems


def _field_problems(value: Any, kind: Any, where: str) -> list[str]:
    if isinstance(kind, list):
        if not isinstance(value, list):
            return [f"{where}: a list"]
        return [p for i, item in enumerate(value)
                for p in _field_problems(item, kind[0], f"{where}[{i}]")]
    if isinstance(kind, tuple):
        return [] if value in kind else [f"{where}: {value!r} is none of {kind}"]
    if kind == "aggregation":
        try:
            json_format.ParseDict(value, monitoring_v3.Aggregation.pb()())
        except json_format.ParseError as exc:
            return [f"{where}: {exc}"]
        return json_name_problems(value, monitoring_v3.Aggregation.pb().DESCRIPTOR, where)
    if kind == "duration":
        return [] if isinstance(value, str) and re.fullmatch(r"\d+(\.\d+)?s", value) \
            else [f"{where}: a duration such as \"60s\""]
    python_types = {"string": str, "int": int, "number": (int, float), "bool": bool, "map": dict}
    if kind in python_types:
        ok = isinstance(value, python_types[kind]) and not (kind in ("int", "number") and
                                                             isinstance(value, bool))
        if kind == "map":
            ok = ok and all(isinstance(v, str) for v in value.values())
        return [] if ok else [f"{where}: {value!r} is not a {kind}"]
    return dashboard_problems(value, kind, where)


def _tile_problems(layout: dict) -> list[str]:
    """Tiles inside the columns (1 to 12), at least 1 by 1, none over another."""
    columns = layout.get("columns", 0)
    problems = [] if 1 <= columns <= 12 else [f"mosaicLayout.columns {columns}: 1 to 12"]
    taken: dict[tuple[int, int], int] = {}
    for i, tile in enumerate(layout.get("tiles", [])):
        x, y = tile.get("xPos", 0), tile.get("yPos", 0)
        width, height = tile.get("width", 0), tile.get("height", 0)
        if x < 0 or y < 0 or width < 1 or height < 1 or x + width > columns:
            problems.append(f"tiles[{i}]: outside the grid or empty")
        for cell in ((cx, cy) for cx in range(x, x + width) for cy in range(y, y + height)):
            if cell in taken:
                problems.append(f"tiles[{i}] overlaps tiles[{taken[cell]}]")
                break
            taken[cell] = i
    return problems


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_each_dashboard_is_what_the_api_reads(path):
    problems = dashboard_problems(load(path))
    assert not problems, "\n".join(problems)


def test_the_dashboard_checks_refuse_what_the_api_would():
    dashboard = load(DASHBOARDS[0])
    assert not dashboard_problems(dashboard)
    layout = dashboard["mosaicLayout"]
    tile = layout["tiles"][1]
    chart = tile["widget"]["xyChart"]
    query = chart["dataSets"][0]["timeSeriesQuery"]

    def with_tile(new_tile: dict) -> dict:
        return {**dashboard, "mosaicLayout": {**layout, "tiles": [new_tile]}}

    def with_chart(**changes: Any) -> dict:
        return with_tile({**tile, "widget": {**tile["widget"], "xyChart": {**chart, **changes}}})

    broken = [
        {**dashboard, "gridLayout": {"widgets": []}},  # two layouts
        {k: v for k, v in dashboard.items() if k != "displayName"},
        with_tile({**tile, "widget": {"xyChart": chart}}),  # no title
        with_tile({**tile, "widget": {**tile["widget"], "text": {"content": "x"}}}),  # two kinds
        with_tile({**tile, "xPos": 10}),  # past the 12 columns
        with_chart(dataSets=[{"timeSeriesQuery": {**query, "timeSeriesQueryLanguage": "x"}}]),
        with_chart(dataSets=[{"timeSeriesQuery": query, "plotType": "PIE"}]),
        with_chart(dataSets=[{"timeSeriesQuery": {"timeSeriesFilter": {
            "filter": "x", "aggregation": {"perSeriesAligner": "ALIGN_MAXIMUM"}}}}]),
        with_chart(dataSets=[{"timeSeriesQuery": {"timeSeriesFilter": {
            "filter": "x", "aggregation": {"perSeriesAligner": "ALIGN_MAX",
                                           "alignmentPeriod": "30s"}}}}]),
        with_chart(dataSets=[], yAxis={"label": "x"}),
        with_chart(y_axis={"label": "x"}),  # not the JSON name
    ]
    for bad in broken:
        assert dashboard_problems(bad), bad
