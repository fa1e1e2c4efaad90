#!/usr/bin/env python3
"""Checks the Grafana dashboard and the Prometheus configurations of deploy/ against the metric names the Spade
binaries serve.

    check_dashboard.py --source-dir DIR --promtool PATH [--metrics-dump FILE ...] [--self-test]

Dashboard (deploy/grafana/spade-dashboard.json):
  - valid JSON, title/uid, schemaVersion >= 36, a templated Prometheus datasource variable that every panel and
    target uses ("${VAR}"), unique integer panel ids (rows included), grid positions inside 24 columns that do not
    overlap, unique refIds per panel;
  - every target expression parses (promtool check rules on a generated rule file) and references only metric
    names of the Spade metric list below, used as their type allows: histograms through _bucket under
    histogram_quantile with `le` kept by every aggregation in between, or through _sum/_count under rate; counters
    only under rate/irate/increase; gauges never under them; label names in matchers, by (...) and {{legend}} are
    labels of those metrics or target labels (job, instance, namespace, pod, component);
  - every metric of the list is shown by some panel.
Prometheus (deploy/prometheus/prometheus.yml and prometheus-kubernetes.yml): promtool check config (the Kubernetes
discovery block is swapped for a static one, since Debian's Prometheus is built without Kubernetes discovery), and
the relabelling reads exactly the pod annotations and labels the manifests of deploy/k8s set, in the namespace the
overlays deploy to.
--metrics-dump FILE (repeatable; /metrics output of the running processes): `promtool check metrics` lint (its
complaint that a name contains ':' is allowed on vLLM's vllm: names only), every metric the dashboard uses is in one
of the dumps, with the type of the list.
--self-test: mutates the dashboard, the configurations and a synthetic dump, and asserts each mutation is caught.
Exit status: 0 ok, 1 problems, 2 usage.
"""
import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover
    sys.stderr.write("check_dashboard: PyYAML is required (Debian package python3-yaml)\n")
    sys.exit(2)

# The metrics the binaries serve: name -> (type, labels). The contract between the binaries and deploy/grafana.
METRICS = {
    "spade_time_to_first_token_seconds": ("histogram", []),
    "spade_inter_token_latency_seconds": ("histogram", []),
    "spade_e2e_request_latency_seconds": ("histogram", []),
    "spade_request_queue_time_seconds": ("histogram", []),
    "spade_generation_tokens_total": ("counter", []),
    "spade_prompt_tokens_total": ("counter", []),
    "spade_num_requests_running": ("gauge", []),
    "spade_num_requests_waiting": ("gauge", []),
    "spade_kv_cache_usage_perc": ("gauge", []),
    "spade_cache_kv_usage_perc": ("gauge", []),
    "spade_request_success_total": ("counter", ["finished_reason"]),
    "spade_request_failure_total": ("counter", []),
    "spade_selection_time_seconds": ("histogram", []),
    "spade_selection_overlap_ratio": ("histogram", []),
    "spade_transfer_bytes_total": ("counter", ["direction", "transport"]),
    "spade_selected_tokens_total": ("counter", []),
    "spade_sent_tokens_total": ("counter", []),
    "spade_selection_stalls_total": ("counter", []),
    "spade_dense_fallbacks_total": ("counter", []),
    "spade_kv_pages_dropped_total": ("counter", []),
    "spade_rank_up": ("gauge", ["role", "rank", "role_index"]),
    "spade_http_requests_total": ("counter", ["endpoint", "code"]),
    "spade_api_request_params_n": ("histogram", []),
    "spade_prefix_cache_queries_total": ("counter", []),
    "spade_prefix_cache_hits_total": ("counter", []),
    "spade_retained_prefix_reused_tokens_total": ("counter", []),
    "spade_cache_sequences": ("gauge", []),
    "spade_cache_retained_prefixes": ("gauge", []),
    "spade_cache_kv_pages_used": ("gauge", []),
    # vLLM's exact names (a vLLM dashboard's or autoscaler's queries), labelled with the served model name.
    "vllm:num_requests_running": ("gauge", ["model_name"]),
    "vllm:num_requests_waiting": ("gauge", ["model_name"]),
    "vllm:kv_cache_usage_perc": ("gauge", ["model_name"]),
    "vllm:time_to_first_token_seconds": ("histogram", ["model_name"]),
    "vllm:inter_token_latency_seconds": ("histogram", ["model_name"]),
    "vllm:e2e_request_latency_seconds": ("histogram", ["model_name"]),
    "vllm:request_queue_time_seconds": ("histogram", ["model_name"]),
    "vllm:prompt_tokens_total": ("counter", ["model_name"]),
    "vllm:generation_tokens_total": ("counter", ["model_name"]),
    "vllm:request_success_total": ("counter", ["model_name", "finished_reason"]),
    "vllm:prefix_cache_queries_total": ("counter", ["model_name"]),
    "vllm:prefix_cache_hits_total": ("counter", ["model_name"]),
    "vllm:request_params_n": ("histogram", ["model_name"]),
}
TARGET_LABELS = {"job", "instance", "namespace", "pod", "component"}
AGGREGATIONS = {"sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values"}
RATE_FUNCS = {"rate", "irate", "increase"}
FUNCTIONS = RATE_FUNCS | {"histogram_quantile", "abs", "ceil", "floor", "round", "clamp", "clamp_min", "clamp_max",
                          "delta", "deriv", "idelta", "avg_over_time", "max_over_time", "min_over_time",
                          "sum_over_time", "count_over_time", "last_over_time", "resets", "changes", "absent",
                          "label_replace", "label_join", "vector", "scalar", "time", "timestamp", "sort",
                          "sort_desc", "predict_linear"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
DASHBOARD = "deploy/grafana/spade-dashboard.json"
PROM_LOCAL = "deploy/prometheus/prometheus.yml"
PROM_K8S = "deploy/prometheus/prometheus-kubernetes.yml"
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$model_name": ".*"}
# promtool's lint reserves ':' for recording rules; vLLM's names have it, and Spade serves them exactly as vLLM does.
VLLM_COLON_LINT = re.compile(r"vllm:\S+ metric names should not contain ':'")


def promtool_metrics_problems(promtool, text):
    """promtool check metrics on a /metrics text: its complaints, less the colon lint on vllm: names."""
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    lines = [l for l in (p.stdout + p.stderr).strip().splitlines() if l.strip()]
    if p.returncode == 0 or (p.returncode == 3 and all(VLLM_COLON_LINT.fullmatch(l) for l in lines)):
        return []
    return lines or [f"exit status {p.returncode}"]


# ----------------------------------------------------------------------------------------------------------------
# PromQL reading (enough of the grammar to find metric names, functions, aggregations and label names)

TOKEN = re.compile(r"""\s*(?:(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')|(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)"""
                   r"""|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],<>=@]))""")


def tokenize(expr):
    toks, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r}")
        kind = m.lastgroup
        toks.append((kind, m.group(kind)))
        pos = m.end()
    return toks


def analyze(expr):
    """Returns (uses, errors): uses = [(metric, suffix, labels used, enclosing stack)] where the stack is a list of
    ("func", name) / ("agg", name, by_labels or None, without_labels or None) from outermost to innermost."""
    errors, uses = [], []
    toks = tokenize(expr)
    stack = []  # entries pushed at "(": ("func", name) | ("agg", name, by, without) | ("paren",)
    i = 0
    depth_check = 0
    while i < len(toks):
        kind, val = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else (None, None)
        if kind == "op" and val == "[":
            j = i
            while j < len(toks) and toks[j] != ("op", "]"):
                j += 1
            if j == len(toks):
                errors.append("unclosed '['")
            i = j + 1
            continue
        if kind == "op" and val == "(":
            stack.append(("paren",))
            depth_check += 1
            i += 1
            continue
        if kind == "op" and val == ")":
            if not stack:
                errors.append("unbalanced ')'")
            else:
                stack.pop()
            i += 1
            continue
        if kind != "id":
            i += 1
            continue
        if val in AGGREGATIONS:
            by = without = None
            j = i + 1
            if j < len(toks) and toks[j][0] == "id" and toks[j][1] in ("by", "without"):
                labels, j = read_label_list(toks, j + 1, errors)
                if toks[i + 1][1] == "by":
                    by = labels
                else:
                    without = labels
            if j >= len(toks) or toks[j] != ("op", "("):
                errors.append(f"aggregation {val} must be written 'sum by (...) (expr)'")
                i = j
                continue
            stack.append(("agg", val, by, without))
            i = j + 1
            # a trailing 'by (...)' after the closing paren is not supported (prefix form only)
            continue
        if val in GROUPING:
            if val in ("by", "without"):
                errors.append(f"'{val}' must follow its aggregation directly ('sum {val} (...) (expr)')")
            _, i = read_label_list(toks, i + 1, errors)
            continue
        if val in KEYWORDS:
            i += 1
            continue
        if nxt == ("op", "("):
            if val not in FUNCTIONS:
                errors.append(f"unknown function {val}()")
            stack.append(("func", val))
            i += 2
            continue
        # a metric selector
        labels = []
        j = i + 1
        if j < len(toks) and toks[j] == ("op", "{"):
            j += 1
            while j < len(toks) and toks[j] != ("op", "}"):
                if toks[j][0] == "id":
                    labels.append(toks[j][1])
                    if j + 2 >= len(toks) or toks[j + 1][0] != "op" or toks[j + 2][0] != "str":
                        errors.append(f"bad label matcher after {toks[j][1]}")
                    j += 3
                elif toks[j] == ("op", ","):
                    j += 1
                else:
                    errors.append(f"bad label matcher {toks[j][1]!r}")
                    j += 1
            j += 1
        name = val
        uses.append((name, labels, [s for s in stack if s[0] != "paren"]))
        i = j
    if stack:
        errors.append("unbalanced '('")
    return uses, errors


def read_label_list(toks, j, errors):
    labels = []
    if j >= len(toks) or toks[j] != ("op", "("):
        errors.append("expected '(' and a label list")
        return labels, j
    j += 1
    while j < len(toks) and toks[j] != ("op", ")"):
        if toks[j][0] == "id":
            labels.append(toks[j][1])
        elif toks[j] != ("op", ","):
            errors.append(f"bad label list entry {toks[j][1]!r}")
        j += 1
    return labels, j + 1


def base_metric(name):
    """(base, suffix) for a series name of the list: histogram series end in _bucket/_sum/_count."""
    if name in METRICS:
        return name, ""
    for suf in ("_bucket", "_sum", "_count"):
        if name.endswith(suf) and METRICS.get(name[: -len(suf)], ("",))[0] == "histogram":
            return name[: -len(suf)], suf
    return None, None


def check_expr(expr, where):
    errs = []
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    try:
        uses, perrs = analyze(expr)
    except ValueError as e:
        return [f"{where}: {e}"], set(), set()
    errs += [f"{where}: {e}" for e in perrs]
    used, labels_ok = set(), set(TARGET_LABELS)
    for name, labels, stack in uses:
        base, suf = base_metric(name)
        if base is None:
            errs.append(f"{where}: '{name}' is not a Spade metric (not in the metric list)")
            continue
        used.add(base)
        mtype, mlabels = METRICS[base]
        allowed = set(mlabels) | TARGET_LABELS | ({"le"} if suf == "_bucket" else set())
        labels_ok |= allowed
        for l in labels:
            if l not in allowed:
                errs.append(f"{where}: label '{l}' in {name}{{...}} is not a label of {base} {sorted(allowed)}")
        funcs = [s[1] for s in stack if s[0] == "func"]
        innermost = funcs[-1] if funcs else None
        if mtype == "histogram" and suf == "":
            errs.append(f"{where}: histogram {name} must be read through _bucket, _sum or _count")
        if mtype == "histogram" and suf == "_bucket":
            if "histogram_quantile" not in funcs:
                errs.append(f"{where}: {name} is used outside histogram_quantile")
            if innermost not in RATE_FUNCS:
                errs.append(f"{where}: {name} must be under rate()/increase() inside histogram_quantile")
            hq = max(k for k, s in enumerate(stack) if s[0] == "func" and s[1] == "histogram_quantile") \
                if "histogram_quantile" in funcs else -1
            for s in stack[hq + 1:]:
                if s[0] == "agg":
                    if s[2] is None and s[3] is None:
                        errs.append(f"{where}: {s[1]}(...) around {name} drops 'le' (write {s[1]} by (le) (...))")
                    elif s[2] is not None and "le" not in s[2]:
                        errs.append(f"{where}: {s[1]} by ({', '.join(s[2])}) around {name} drops 'le'")
                    elif s[3] is not None and "le" in s[3]:
                        errs.append(f"{where}: {s[1]} without (le) around {name} drops 'le'")
        if mtype == "histogram" and suf in ("_sum", "_count") and innermost not in RATE_FUNCS:
            errs.append(f"{where}: {name} is a counter series: use it under rate()/increase()")
        if mtype == "counter" and innermost not in RATE_FUNCS:
            errs.append(f"{where}: counter {name} must be under rate()/irate()/increase()")
        if mtype == "gauge" and innermost in RATE_FUNCS:
            errs.append(f"{where}: gauge {name} under {innermost}() (rate of a gauge is meaningless)")
        for s in stack:
            if s[0] == "agg":
                for l in (s[2] or []) + (s[3] or []):
                    if l not in allowed:
                        errs.append(f"{where}: {s[1]} by/without label '{l}' is not a label of {base}")
    return errs, used, labels_ok


# ----------------------------------------------------------------------------------------------------------------
# dashboard

def all_panels(dash):
    out = []
    for p in dash.get("panels") or []:
        out.append(p)
        for q in p.get("panels") or []:
            out.append(q)
    return out


def check_dashboard(dash, promtool, tmpdir):
    errs = []
    if not isinstance(dash, dict):
        return ["dashboard: the JSON is not an object"], set()
    for k in ("title", "uid", "panels", "schemaVersion", "templating"):
        if k not in dash:
            errs.append(f"dashboard: top-level '{k}' is missing")
    sv = dash.get("schemaVersion")
    if not isinstance(sv, int) or sv < 36:
        errs.append(f"dashboard: schemaVersion {sv!r} < 36 (Grafana 9+ dashboards)")
    ds_vars = [v for v in (dash.get("templating") or {}).get("list") or []
               if v.get("type") == "datasource" and v.get("query") == "prometheus"]
    if not ds_vars:
        errs.append("dashboard: no templated datasource variable (type datasource, query prometheus)")
    ds_uids = {f"${{{v.get('name')}}}" for v in ds_vars} | {f"${v.get('name')}" for v in ds_vars}
    ids, rects, used, rules = {}, [], set(), []
    for p in all_panels(dash):
        pid = p.get("id")
        title = p.get("title", "?")
        where = f"panel {pid} '{title}'"
        if not isinstance(pid, int):
            errs.append(f"{where}: id must be an integer")
        elif pid in ids:
            errs.append(f"{where}: id {pid} is also the id of panel '{ids[pid]}'")
        else:
            ids[pid] = title
        gp = p.get("gridPos") or {}
        try:
            x, y, w, h = (int(gp[k]) for k in ("x", "y", "w", "h"))
            if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > 24:
                errs.append(f"{where}: gridPos {gp} is outside the 24-column grid")
            for other, (ox, oy, ow, oh) in rects:
                if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                    errs.append(f"{where}: gridPos {gp} overlaps panel '{other}'")
            rects.append((title, (x, y, w, h)))
        except (KeyError, TypeError, ValueError):
            errs.append(f"{where}: gridPos needs integer x, y, w, h")
        if p.get("type") == "row":
            continue
        targets = p.get("targets") or []
        if not targets:
            errs.append(f"{where}: no targets")
        for obj, what in [(p, "panel")] + [(t, f"target {t.get('refId')}") for t in targets]:
            uid = (obj.get("datasource") or {}).get("uid")
            if uid not in ds_uids:
                errs.append(f"{where}: {what} datasource uid {uid!r} is not the templated variable "
                            f"{sorted(ds_uids)}")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            errs.append(f"{where}: refIds {refs} are not unique")
        for t in targets:
            expr = t.get("expr") or ""
            tw = f"{where} target {t.get('refId')}"
            if not expr.strip():
                errs.append(f"{tw}: empty expr")
                continue
            e2, u, labels_ok = check_expr(expr, tw)
            errs += e2
            used |= u
            for l in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", t.get("legendFormat") or ""):
                if l not in labels_ok:
                    errs.append(f"{tw}: legend label '{{{{{l}}}}}' is not a label of the series {sorted(labels_ok)}")
            concrete = expr
            for k, v in GRAFANA_VARS.items():
                concrete = concrete.replace(k, v)
            if "$" in concrete:
                errs.append(f"{tw}: expr uses a Grafana variable this check does not know: {expr}")
            rules.append((tw, concrete))
    for m in sorted(set(METRICS) - used):
        errs.append(f"dashboard: no panel shows {m}")
    errs += promtool_rules(promtool, rules, tmpdir)
    return errs, used


def promtool_rules(promtool, rules, tmpdir):
    """Validates PromQL syntax with promtool: every expression as a recording rule."""
    if not rules:
        return []
    path = os.path.join(tmpdir, "dashboard-exprs.rules.yml")
    group = {"groups": [{"name": "spade_dashboard", "rules": [{"record": f"spade_dashboard:expr_{i}", "expr": e}
                                                                 for i, (_, e) in enumerate(rules)]}]}
    with open(path, "w") as f:
        yaml.safe_dump(group, f)
    p = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
    if p.returncode == 0:
        return []
    out = (p.stdout + p.stderr).strip()
    errs = []
    for i, (where, e) in enumerate(rules):
        if f"expr_{i}\"" in out or re.search(rf"\brule {i + 1}\b", out):
            errs.append(f"{where}: promtool rejects the expression: {e}")
    return errs or [f"dashboard: promtool check rules failed: {out[-600:]}"]


# ----------------------------------------------------------------------------------------------------------------
# Prometheus configurations

def manifest_facts(source_dir):
    """Annotation keys and labels of the Spade pod templates and the overlays' namespaces (from the sources)."""
    ann, labels, namespaces = set(), set(), set()
    base = os.path.join(source_dir, "deploy/k8s/base")
    for f in sorted(os.listdir(base)):
        if not f.endswith(".yaml") or f == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(open(os.path.join(base, f))):
            if d and d.get("kind") in ("Deployment", "StatefulSet"):
                md = d["spec"]["template"].get("metadata") or {}
                ann |= set((md.get("annotations") or {}))
                labels |= set((md.get("labels") or {}).items())
    ov = os.path.join(source_dir, "deploy/k8s/overlays")
    for o in sorted(os.listdir(ov)):
        k = os.path.join(ov, o, "kustomization.yaml")
        if os.path.isfile(k):
            namespaces.add((yaml.safe_load(open(k)) or {}).get("namespace"))
    return ann, labels, namespaces


def sanitize(name):
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def promtool_config(promtool, path, text):
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([promtool, "check", "config", path], capture_output=True, text=True)
    return None if p.returncode == 0 else " ".join((p.stdout + p.stderr).split())[-600:]


def check_prometheus(source_dir, promtool, tmpdir, local_text, k8s_text):
    errs = []
    out = promtool_config(promtool, os.path.join(tmpdir, "prometheus.yml"), local_text)
    if out:
        errs.append(f"{PROM_LOCAL}: promtool check config fails: {out}")
    try:
        local = yaml.safe_load(local_text) or {}
        jobs = [j.get("job_name") for j in local.get("scrape_configs") or []]
        for j in local.get("scrape_configs") or []:
            for sc in j.get("static_configs") or []:
                for t in sc.get("targets") or []:
                    if not re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", str(t)):
                        errs.append(f"{PROM_LOCAL}: job {j.get('job_name')}: target {t!r} is not host:port")
        for want in ("spade-coordinator", "spade-inference", "spade-cache"):
            if want not in jobs:
                errs.append(f"{PROM_LOCAL}: no scrape job {want}")
    except yaml.YAMLError as e:
        errs.append(f"{PROM_LOCAL}: not YAML: {e}")
    try:
        k8s = yaml.safe_load(k8s_text) or {}
    except yaml.YAMLError as e:
        return errs + [f"{PROM_K8S}: not YAML: {e}"]
    swapped = copy.deepcopy(k8s)
    sd_jobs = []
    for j in swapped.get("scrape_configs") or []:
        sd = j.pop("kubernetes_sd_configs", None)
        if sd is not None:
            sd_jobs.append((j.get("job_name"), sd))
            j["static_configs"] = [{"targets": ["127.0.0.1:1"]}]
    if not sd_jobs:
        errs.append(f"{PROM_K8S}: no job with kubernetes_sd_configs")
    out = promtool_config(promtool, os.path.join(tmpdir, "prometheus-kubernetes.yml"), yaml.safe_dump(swapped))
    if out:
        errs.append(f"{PROM_K8S}: promtool check config fails (Kubernetes discovery swapped for a static target): "
                    f"{out}")
    ann, labels, namespaces = manifest_facts(source_dir)
    for job in (k8s.get("scrape_configs") or []):
        sd = job.get("kubernetes_sd_configs")
        if not sd:
            continue
        where = f"{PROM_K8S} job {job.get('job_name')}"
        for s in sd:
            if s.get("role") != "pod":
                errs.append(f"{where}: role {s.get('role')} (the manifests annotate pods: role pod)")
            names = set(((s.get("namespaces") or {}).get("names")) or [])
            if names != namespaces - {None}:
                errs.append(f"{where}: namespaces {sorted(names)} != the overlays' namespaces "
                            f"{sorted(namespaces - {None})}")
        metas = set()
        for r in job.get("relabel_configs") or []:
            for sl in r.get("source_labels") or []:
                metas.add(sl)
                m = re.fullmatch(r"__meta_kubernetes_pod_annotation_(\w+)", sl)
                if m and m.group(1) not in {sanitize(a) for a in ann}:
                    errs.append(f"{where}: reads annotation meta label {sl}, but the pod templates carry "
                                f"{sorted(ann)}")
                m = re.fullmatch(r"__meta_kubernetes_pod_label_(\w+)", sl)
                if m and m.group(1) not in {sanitize(k) for k, _ in labels}:
                    errs.append(f"{where}: reads label meta label {sl}, but the pod templates carry "
                                f"{sorted(k for k, _ in labels)}")
                    continue
                if m and r.get("action") == "keep":
                    vals = {v for k, v in labels if sanitize(k) == m.group(1)}
                    if not any(re.fullmatch(r.get("regex", "(.*)"), v) for v in vals):
                        errs.append(f"{where}: keeps {sl} =~ {r.get('regex')!r}, which no pod template matches "
                                    f"{sorted(vals)}")
        for a in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
            if a in ann and f"__meta_kubernetes_pod_annotation_{sanitize(a)}" not in metas:
                errs.append(f"{where}: does not use the pods' annotation {a}")
    return errs


# ----------------------------------------------------------------------------------------------------------------
# metrics dumps

def parse_dump(text):
    """{family: type} from '# TYPE' lines, plus the sample names."""
    types, samples = {}, set()
    for line in text.splitlines():
        m = re.match(r"#\s*TYPE\s+(\S+)\s+(\S+)", line)
        if m:
            types[m.group(1)] = m.group(2)
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[^{\s]+", line).group(0))
    return types, samples


def check_dumps(dumps, used, promtool):
    errs = []
    types, samples = {}, set()
    for path, text in dumps:
        problems = promtool_metrics_problems(promtool, text)
        if problems:
            errs.append(f"{path}: promtool check metrics: {'; '.join(problems)[:400]}")
        t, s = parse_dump(text)
        types.update(t)
        samples |= s
    for m in sorted(used):
        want = METRICS[m][0]
        fam = m if m in types else (m[:-6] if m.endswith("_total") and m[:-6] in types else None)
        if fam is None:
            errs.append(f"metrics dumps: {m} (used by the dashboard) is in none of {[p for p, _ in dumps]}")
            continue
        if types[fam] != want:
            errs.append(f"metrics dumps: {m} is a {types[fam]}, the dashboard reads it as a {want}")
        series = {m + s for s in ("_bucket", "_sum", "_count")} if want == "histogram" else {m}
        if not (series & samples):
            errs.append(f"metrics dumps: {m} has a TYPE line but no samples {sorted(series)}")
    return errs


def synthetic_dump():
    """A /metrics text with every listed metric, as the binaries are specified to serve them (for --self-test)."""
    out = []
    for name, (mtype, labels) in METRICS.items():
        lab = ",".join(f'{l}="x"' for l in labels)
        out.append(f"# HELP {name} {name.replace('_', ' ')}.")
        out.append(f"# TYPE {name} {mtype}")
        if mtype == "histogram":
            for le in ("0.1", "1", "+Inf"):
                out.append(f'{name}_bucket{{{lab + "," if lab else ""}le="{le}"}} 3')
            out.append(f"{name}_sum{{{lab}}} 1.5" if lab else f"{name}_sum 1.5")
            out.append(f"{name}_count{{{lab}}} 3" if lab else f"{name}_count 3")
        else:
            out.append(f"{name}{{{lab}}} 1" if lab else f"{name} 1")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------

def run_all(source_dir, promtool, dash_text, local_text, k8s_text, dumps):
    with tempfile.TemporaryDirectory(prefix="spade-dash-") as tmp:
        try:
            dash = json.loads(dash_text)
        except json.JSONDecodeError as e:
            errs, used = [f"{DASHBOARD}: not valid JSON: {e}"], set()
        else:
            errs, used = check_dashboard(dash, promtool, tmp)
        errs += check_prometheus(source_dir, promtool, tmp, local_text, k8s_text)
        if dumps:
            errs += check_dumps(dumps, used, promtool)
    return errs


def mutate_json(text, fn):
    d = json.loads(text)
    fn(d)
    return json.dumps(d)


def panel_by_title(d, title):
    return [p for p in all_panels(d) if p.get("title", "").startswith(title)][0]


def set_expr(title, expr, ref=0):
    def fn(d):
        panel_by_title(d, title)["targets"][ref]["expr"] = expr
    return fn


DASH_MUTATIONS = [
    ("invalid JSON", lambda t: t[:-3], r"not valid JSON"),
    ("duplicate panel id", lambda t: mutate_json(t, lambda d: panel_by_title(d, "Queue time").update(id=2)),
     r"id 2 is also the id"),
    ("old schemaVersion", lambda t: mutate_json(t, lambda d: d.update(schemaVersion=27)), r"schemaVersion 27 < 36"),
    ("unknown metric", lambda t: mutate_json(t, set_expr("Dense fallbacks",
                                                         "sum(rate(spade_dense_fallback_total[$__rate_interval]))")),
     r"'spade_dense_fallback_total' is not a Spade metric"),
    ("metric no panel shows", lambda t: mutate_json(t, lambda d: d["panels"].remove(panel_by_title(d, "Dense"))),
     r"no panel shows spade_dense_fallbacks_total"),
    ("rate of a gauge", lambda t: mutate_json(t, set_expr("KV cache usage",
                                                          "rate(spade_kv_cache_usage_perc[$__rate_interval])")),
     r"gauge spade_kv_cache_usage_perc under rate"),
    ("counter without rate", lambda t: mutate_json(t, set_expr("Throughput", "sum(spade_generation_tokens_total)")),
     r"counter spade_generation_tokens_total must be under rate"),
    ("quantile without le", lambda t: mutate_json(t, set_expr(
        "Time to first token", "histogram_quantile(0.5, sum(rate(spade_time_to_first_token_seconds_bucket[5m])))")),
     r"drops 'le'"),
    ("histogram read raw", lambda t: mutate_json(t, set_expr("Queue time", "spade_request_queue_time_seconds")),
     r"must be read through _bucket"),
    ("wrong label name", lambda t: mutate_json(t, set_expr(
        "Request outcomes", "sum by (finish_reason) (rate(spade_request_success_total[$__rate_interval]))")),
     r"label 'finish_reason' is not a label"),
    ("wrong matcher label", lambda t: mutate_json(t, set_expr(
        "Data plane", 'sum(rate(spade_transfer_bytes_total{dir="send"}[$__rate_interval]))')),
     r"label 'dir' in spade_transfer_bytes_total"),
    ("legend label absent", lambda t: mutate_json(
        t, lambda d: panel_by_title(d, "Rank up")["targets"][0].update(legendFormat="{{role}} {{ranks}}")),
     r"legend label '\{\{ranks\}\}'"),
    ("PromQL syntax error", lambda t: mutate_json(t, set_expr(
        "Selection stalls", "sum by (instance) (rate(spade_selection_stalls_total[$__rate_interval])")),
     r"(unbalanced|promtool)"),
    ("promtool-only syntax error", lambda t: mutate_json(t, set_expr(
        "Selection stalls", "sum by (instance) (rate(spade_selection_stalls_total[5 m]))")),
     r"promtool rejects the expression"),
    ("hard-coded datasource", lambda t: mutate_json(
        t, lambda d: panel_by_title(d, "Queue time").update(datasource={"type": "prometheus", "uid": "abc"})),
     r"datasource uid 'abc' is not the templated"),
    ("overlapping panels", lambda t: mutate_json(
        t, lambda d: panel_by_title(d, "Queue time")["gridPos"].update(x=4)), r"overlaps panel"),
    ("unknown function", lambda t: mutate_json(t, set_expr(
        "Throughput", "sum(ratee(spade_generation_tokens_total[5m]))")), r"unknown function ratee"),
    ("vLLM name misspelt", lambda t: mutate_json(t, set_expr(
        "vLLM: scheduler state", 'sum by (model_name) (vllm:num_requests_runing{model_name=~"$model_name"})')),
     r"'vllm:num_requests_runing' is not a Spade metric"),
    ("vLLM series without its model_name label", lambda t: mutate_json(t, set_expr(
        "vLLM: KV cache usage", 'max by (instance) (vllm:kv_cache_usage_perc{model="x"})')),
     r"label 'model' in vllm:kv_cache_usage_perc"),
    ("no panel shows a vLLM series", lambda t: mutate_json(
        t, lambda d: d["panels"].remove(panel_by_title(d, "vLLM: queue time"))),
     r"no panel shows vllm:request_queue_time_seconds"),
]

CONFIG_MUTATIONS = [
    ("local config: bad target", "local", '"127.0.0.1:8000"', '"127.0.0.1:80x00"', r"is not host:port"),
    ("local config: unknown field", "local", "metrics_path: /metrics", "metrics_paths: /metrics",
     r"prometheus\.yml: promtool check config fails"),
    ("local config: job missing", "local", "job_name: spade-cache", "job_name: spade-kache", r"no scrape job spade-cache"),
    ("k8s config: annotation name typo", "k8s", "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
     "__meta_kubernetes_pod_annotation_prometheus_io_scrap", r"reads annotation meta label"),
    ("k8s config: bad relabel action", "k8s", "action: keepequal", "action: keepequals",
     r"prometheus-kubernetes\.yml: promtool"),
    ("k8s config: wrong namespace", "k8s", "names: [spade]", "names: [default]", r"namespaces \['default'\]"),
    ("k8s config: keeps no Spade pod", "k8s", "regex: spade\n", "regex: spad\n", r"which no pod template matches"),
]


def self_test(source_dir, promtool, dash_text, local_text, k8s_text):
    failures = []
    base = set(run_all(source_dir, promtool, dash_text, local_text, k8s_text, []))
    print(f"self-test: baseline has {len(base)} problem(s)")

    def expect(name, errs, pattern):
        new = set(errs) - base
        hit = [e for e in new if re.search(pattern, e)]
        print(f"  {'caught' if hit else 'MISSED'}: {name}" + (f"  <- {hit[0][:200]}" if hit else ""))
        if not hit:
            failures.append(f"{name}: no new problem matching /{pattern}/ (new: {sorted(new)[:3]})")

    for name, fn, pattern in DASH_MUTATIONS:
        expect(name, run_all(source_dir, promtool, fn(dash_text), local_text, k8s_text, []), pattern)
    for name, which, old, new, pattern in CONFIG_MUTATIONS:
        text = local_text if which == "local" else k8s_text
        if old not in text:
            failures.append(f"{name}: '{old}' not in the configuration; it changed shape")
            continue
        text = text.replace(old, new, 1)
        args = (text, k8s_text) if which == "local" else (local_text, text)
        expect(name, run_all(source_dir, promtool, dash_text, *args, []), pattern)
    good = synthetic_dump()
    errs = set(run_all(source_dir, promtool, dash_text, local_text, k8s_text, [("synthetic", good)])) - base
    if errs:
        failures.append(f"the synthetic dump of the metric list fails: {sorted(errs)[:3]}")
    else:
        print("  ok: a dump serving every listed metric passes (promtool check metrics included)")
    for name, dump, pattern in [
        ("dump lacks a metric", re.sub(r"(?m)^.*spade_rank_up.*\n", "", good), r"spade_rank_up \(used by"),
        ("dump has the wrong type", good.replace("# TYPE spade_kv_cache_usage_perc gauge",
                                                  "# TYPE spade_kv_cache_usage_perc counter"),
         r"spade_kv_cache_usage_perc is a counter"),
        ("dump fails promtool lint", good + "# TYPE spade_bad_counter counter\nspade_bad_counter 1\n",
         r"promtool check metrics"),
        ("dump has a colon name that is not vLLM's", good + "# TYPE spade:bad gauge\nspade:bad 1\n",
         r"promtool check metrics: spade:bad metric names should not contain"),
        ("dump lacks a vLLM series", re.sub(r"(?m)^.*vllm:generation_tokens_total.*\n", "", good),
         r"vllm:generation_tokens_total \(used by"),
    ]:
        expect(name, run_all(source_dir, promtool, dash_text, local_text, k8s_text, [("dump", dump)]), pattern)
    if failures:
        print("self-test FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"self-test passed: {len(DASH_MUTATIONS) + len(CONFIG_MUTATIONS) + 3} mutations caught")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--promtool", default="promtool", help="promtool (Debian package prometheus)")
    ap.add_argument("--metrics-dump", action="append", default=[], help="a /metrics output to check against")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    src = os.path.abspath(a.source_dir)
    try:
        subprocess.run([a.promtool, "--version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check_dashboard: error: cannot run promtool '{a.promtool}': {e} (Debian package prometheus)",
              file=sys.stderr)
        return 1
    texts = []
    for rel in (DASHBOARD, PROM_LOCAL, PROM_K8S):
        try:
            texts.append(open(os.path.join(src, rel), encoding="utf-8").read())
        except OSError as e:
            print(f"check_dashboard: error: {rel}: {e}", file=sys.stderr)
            return 1
    if a.self_test:
        return self_test(src, a.promtool, *texts)
    dumps = []
    for path in a.metrics_dump:
        try:
            dumps.append((path, open(path, encoding="utf-8").read()))
        except OSError as e:
            print(f"check_dashboard: error: metrics dump {path}: {e}", file=sys.stderr)
            return 1
    errs = run_all(src, a.promtool, *texts, dumps)
    if errs:
        print(f"check_dashboard: {len(errs)} problem(s):", file=sys.stderr)
        for e in errs:
            print(f"  {e}", file=sys.stderr)
        return 1
    n = len([p for p in all_panels(json.loads(texts[0])) if p.get("type") != "row"])
    print(f"check_dashboard: ok: {n} panels over {len(METRICS)} metrics; {PROM_LOCAL}, {PROM_K8S}"
          + (f"; {len(dumps)} metrics dump(s)" if dumps else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
