#!/usr/bin/env python3
"""Renders every Kubernetes overlay of deploy/k8s with `kubectl kustomize` and checks the objects, both as
Kubernetes objects and against the Spade binaries and images they run.

    check_k8s.py --source-dir DIR --kubectl PATH --coordinator BIN --inference-rank BIN --cache-rank BIN
                 --make-demo-checkpoint BIN [--self-test]

What is checked, per rendered overlay (deploy/k8s/overlays/*; an overlay whose name contains "gpu" is a GPU
overlay) and per overlay + optional component (a component no overlay includes, e.g. components/podmonitor):

  objects     every object has apiVersion/kind/metadata.name, and its kind is one this checker knows
  workloads   Deployment/StatefulSet selector matches the template labels; a StatefulSet's serviceName is a
              headless Service (clusterIP None) selecting its pods; StatefulSets use podManagementPolicy Parallel
              (a rank is Ready only once the world has met, OrderedReady would deadlock) and updateStrategy
              OnDelete (a rolling update breaks the world once per pod); the coordinator runs as one replica with
              the Recreate strategy
  containers  image with a tag; resources (requests cpu+memory, limits memory, requests <= limits); probes:
              startup + readiness httpGet /ready, liveness httpGet /health, on a declared containerPort, startup
              budget above the rendezvous deadline; volumeMounts name pod volumes; /dev/shm is an emptyDir with
              medium Memory; securityContext runs as the image's user
  binaries    every --flag of the final command line (after the kubelet's $(VAR) expansion and after running
              deploy/docker/spade-entrypoint.sh for every pod of the workload, in dry-run mode) is in the
              `--help` of that binary, value flags have values, booleans none; ports in flags equal the named
              containerPorts and every containerPort is served; env names are read by the binary (source
              getenv/env("NAME") calls whose string is in the binary), by a library it links (UCX_*, OMP_*), by
              the entrypoint, or used in $(VAR) of the command
  world       the ranks derived for all pods are exactly 0..W-1 with the default role map (coordinator 0,
              inference 1..N, cache N+1..2N), world size / counts agree everywhere, StatefulSet replicas == N,
              same ranks from the pod-index label and from the pod name
  secret      every coordinator, inference and cache process reads the same cluster secret (SPADE_CLUSTER_SECRET_FILE
              or --cluster-secret-file) from a Secret volume of a Secret in the render, whose file mode no other
              user can read (the binaries refuse it otherwise); the coordinator's --host and --http-host are not
              loopback addresses (ranks, clients and probes come from other pods)
  wiring      MASTER_ADDR names a Service that publishes not-ready addresses and reaches the coordinator's
              control port (= MASTER_PORT = coordinator --port); Service targetPorts exist in the selected pods;
              inference and cache ranks get the same model, and on the CPU the same selection settings (on the
              GPU the pair hello carries them); no rank is given a flag that its device refuses (REFUSED_FLAGS);
              the model directory is on a volume that something fills (an init container writing it, or a
              PersistentVolumeClaim that exists)
  config      every configMapKeyRef names an existing ConfigMap key; every key of spade-config is used
  gpu / cpu   a GPU overlay requests nvidia.com/gpu (requests == limits) on inference and cache containers, runs
              them with --device cuda and runs the -cuda image; a CPU overlay requests no GPU anywhere, runs the
              ranks with --device cpu (or no --device) and runs the -cpu image
  monitoring  prometheus.io/scrape/port/path annotations point at the port serving /metrics; a PodMonitor
              selects the Spade pods through named ports that exist
  images      deploy/docker/Dockerfile{,.cuda}: installs the build packages with setup_deps.sh --build-only (and
              that script has the mode), builds the binaries the manifests run, installs the entrypoint where the
              manifests call it, runs tini, uses the user id of the pods' securityContext; the runtime-package
              resolver works on the given binaries

--self-test: renders once, then applies mutations (to rendered objects and to a copy of the source tree) and
asserts that each one produces a new error of the expected kind. Exit status: 0 ok, 1 check failures, 2 usage.
"""
import argparse
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover
    sys.stderr.write("check_k8s: PyYAML is required (Debian package python3-yaml)\n")
    sys.exit(2)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k8s_checks import *  # noqa: E402,F401,F403 (the checks; this file is their command line and self-test)


# ----------------------------------------------------------------------------------------------------------------

def copy_k8s(source_dir, dest):
    """A copy of deploy/k8s to render. The cluster secret file that the base's secretGenerator reads is created by
    the operator and never committed: the copy gets a random one when the checkout has none."""
    src = os.path.join(source_dir, "deploy", "k8s")
    if not os.path.isdir(src):
        raise Fatal(f"{src}: not found")
    shutil.copytree(src, dest)
    secret = os.path.join(dest, "base", "cluster-secret")
    if not os.path.exists(secret):
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    return dest


def render_all(kubectl, k8s_copy):
    out = []
    for label, rel, is_gpu in discover(k8s_copy):
        out.append((label, render(kubectl, k8s_copy, rel), is_gpu))
    return out


def check_renders(renders, ctx):
    errors = []
    for label, docs, is_gpu in renders:
        errors += OverlayCheck(label, docs, is_gpu, ctx).run()
    return errors


def build_ctx(a):
    src = os.path.abspath(a.source_dir)
    env_names = source_env_names(src)
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= env_names:
        raise Fatal(f"{src}: found no getenv/env(\"RANK\"...) calls in the sources ({sorted(env_names)})")
    bins = {}
    for name, path in (("coordinator", a.coordinator), ("inference_rank", a.inference_rank),
                       ("cache_rank", a.cache_rank), ("make_demo_checkpoint", a.make_demo_checkpoint)):
        bins[name] = BinaryFacts(name, path, env_names)
    entry = os.path.join(src, ENTRYPOINT_SCRIPT)
    if not os.access(entry, os.X_OK):
        raise Fatal(f"{entry}: not an executable script")
    image = ImageFacts(src, [bins[n].path for n in bins])
    return Ctx(src, bins, entry, entrypoint_reads(entry), image)


# ----------------------------------------------------------------------------------------------------------------
# self-test

def find(docs, kind, name):
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"{kind} {name}")


def cont(docs, wname, cname, kind="StatefulSet"):
    w = find(docs, kind, wname)
    for c in w["spec"]["template"]["spec"].get("containers", []) + \
            w["spec"]["template"]["spec"].get("initContainers", []):
        if c["name"] == cname:
            return c
    raise KeyError(cname)


def set_arg(c, flag, value):
    i = c["args"].index(flag)
    c["args"][i + 1] = value


def cm_name(docs):
    return [d for d in docs if d["kind"] == "ConfigMap"][0]["metadata"]["name"]


def _m_selector(d):
    find(d, "StatefulSet", "spade-inference")["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/component"] = "inferense"


def _m_cache_replicas(d):
    find(d, "StatefulSet", "spade-cache")["spec"]["replicas"] = 2


def _m_ep_identity(d):
    cont(d, "spade-cache", "cache")["args"] += ["--rank", "3"]


def _m_cm_key(d):
    c = cont(d, "spade-inference", "inference")
    [e for e in c["env"] if e["name"] == "SPADE_TOKEN_BUDGET"][0]["valueFrom"]["configMapKeyRef"]["key"] = "NOPE"


def _m_cm_unused(d):
    [x for x in d if x["kind"] == "ConfigMap"][0]["data"]["SPADE_UNUSED_SETTING"] = "1"


def _m_init_removed(d):
    del find(d, "StatefulSet", "spade-cache")["spec"]["template"]["spec"]["initContainers"]


def _m_coord_replicas(d):
    find(d, "Deployment", "spade-coordinator")["spec"]["replicas"] = 2


def _m_coord_strategy(d):
    find(d, "Deployment", "spade-coordinator")["spec"]["strategy"] = {"type": "RollingUpdate"}


def _m_shm(d):
    for v in find(d, "StatefulSet", "spade-cache")["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "dshm":
            v["emptyDir"] = {}


def _m_env_unknown(d):
    cont(d, "spade-cache", "cache")["env"].append({"name": "SPADE_NOT_READ_BY_ANYONE", "value": "1"})


def _m_env_ucx_coord(d):
    cont(d, "spade-coordinator", "coordinator", "Deployment")["env"].append({"name": "UCX_TLS", "value": "tcp"})


def _m_svc_target(d):
    find(d, "Service", "spade-coordinator")["spec"]["ports"][0]["targetPort"] = "htp"


def _m_pnra(d):
    find(d, "Service", "spade-coordinator-control")["spec"]["publishNotReadyAddresses"] = False


def _m_master_addr(d):
    [x for x in d if x["kind"] == "ConfigMap"][0]["data"]["MASTER_ADDR"] = "spade-coordinatr-control"


def _m_budget(d):
    set_arg(cont(d, "spade-cache", "cache"), "--token-budget", "128")


def _m_undefined(d):
    cont(d, "spade-inference", "inference")["args"] += ["--top-k", "$(SPADE_TOP_K)"]


def _m_no_serve(d):
    cont(d, "spade-inference", "inference")["args"].remove("--serve")


def _m_bool_value(d):
    a = cont(d, "spade-inference", "inference")["args"]
    a.insert(a.index("--serve") + 1, "yes")


def _m_annotation(d):
    find(d, "StatefulSet", "spade-cache")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9090"


def _m_startup(d):
    cont(d, "spade-inference", "inference")["startupProbe"]["failureThreshold"] = 3


def _m_no_tini(d):
    c = cont(d, "spade-cache", "cache")
    c["command"] = c["command"][2:]


def _m_pvc(d):
    d[:] = [x for x in d if x["kind"] != "PersistentVolumeClaim"]


def _m_gpu_missing(d):
    c = cont(d, "spade-cache", "cache")
    for k in ("requests", "limits"):
        c["resources"][k].pop("nvidia.com/gpu", None)


def _m_gpu_on_cpu(d):
    cont(d, "spade-cache", "cache")["resources"]["limits"]["nvidia.com/gpu"] = "1"


def _m_image_tag(d):
    cont(d, "spade-cache", "cache")["image"] = "spade:latest"


def _m_podmonitor_port(d):
    find(d, "PodMonitor", "spade")["spec"]["podMetricsEndpoints"][1]["port"] = "metric"


def _m_readonly_model_writer(d):
    for m in cont(d, "spade-cache", "demo-model")["volumeMounts"]:
        m["readOnly"] = True


def _m_requests_over_limits(d):
    cont(d, "spade-cache", "cache")["resources"]["requests"]["memory"] = "64Gi"


def _m_run_as(d):
    find(d, "StatefulSet", "spade-cache")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0


def _m_kind(d):
    d.append({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "x"}})


def _m_no_secret_env(d):
    c = cont(d, "spade-cache", "cache")
    c["env"] = [e for e in c["env"] if e["name"] != "SPADE_CLUSTER_SECRET_FILE"]


def secret_volume(d, kind, name):
    return [v for v in find(d, kind, name)["spec"]["template"]["spec"]["volumes"] if v["name"] == "cluster-secret"][0]


def _m_secret_world_readable(d):
    secret_volume(d, "StatefulSet", "spade-inference")["secret"]["defaultMode"] = 0o644


def _m_secret_other(d):
    other = copy.deepcopy([x for x in d if x["kind"] == "Secret"][0])
    other["metadata"]["name"] = "another-secret"
    d.append(other)
    secret_volume(d, "StatefulSet", "spade-cache")["secret"]["secretName"] = "another-secret"


def _m_secret_missing(d):
    d[:] = [x for x in d if x["kind"] != "Secret"]


def _m_control_loopback(d):
    a = cont(d, "spade-coordinator", "coordinator", "Deployment")["args"]
    del a[a.index("--host"):a.index("--host") + 2]


# (name, overlay label, mutate rendered docs, or (file, old, new) to edit in a source copy, expected error regex)
RENDER_MUTATIONS = [
    ("selector does not match template labels", "cpu", _m_selector, r"spec\.selector .* does not match"),
    ("StatefulSet serviceName unknown", "cpu",
     lambda d: find(d, "StatefulSet", "spade-cache")["spec"].update(serviceName="nope"), r"serviceName 'nope' names no"),
    ("governing Service not headless", "cpu",
     lambda d: find(d, "Service", "spade-cache")["spec"].pop("clusterIP"), r"not headless"),
    ("OrderedReady pod management", "cpu",
     lambda d: find(d, "StatefulSet", "spade-inference")["spec"].update(podManagementPolicy="OrderedReady"),
     r"podManagementPolicy must be Parallel"),
    ("rolling update of the ranks", "cpu",
     lambda d: find(d, "StatefulSet", "spade-cache")["spec"].update(updateStrategy={"type": "RollingUpdate"}),
     r"updateStrategy must be OnDelete"),
    ("container without image", "cpu", lambda d: cont(d, "spade-cache", "cache").pop("image"), r"image is missing"),
    ("image :latest", "cpu", _m_image_tag, r"explicit version tag"),
    ("container without resources", "cpu", lambda d: cont(d, "spade-inference", "inference").pop("resources"),
     r"resources\.requests\.cpu is missing"),
    ("requests above limits", "cpu", _m_requests_over_limits, r"requests\.memory .* exceeds"),
    ("readiness probe on undeclared port", "cpu",
     lambda d: cont(d, "spade-cache", "cache")["readinessProbe"]["httpGet"].update(port="metricz"),
     r"readinessProbe port 'metricz' is not a declared"),
    ("liveness probe missing", "cpu", lambda d: cont(d, "spade-cache", "cache").pop("livenessProbe"),
     r"livenessProbe is missing"),
    ("liveness probe wrong path", "cpu",
     lambda d: cont(d, "spade-inference", "inference")["livenessProbe"]["httpGet"].update(path="/ready"),
     r"livenessProbe path"),
    ("startup budget below rendezvous deadline", "cpu", _m_startup, r"startupProbe allows"),
    ("Service targetPort not in pods", "cpu", _m_svc_target, r"targetPort 'htp' is not a containerPort"),
    ("/dev/shm not memory-backed", "cpu", _m_shm, r"/dev/shm volume .* medium Memory"),
    ("GPU requested in CPU overlay", "cpu", _m_gpu_on_cpu, r"CPU overlay must not request nvidia\.com/gpu"),
    ("GPU missing in GPU overlay", "gpu", _m_gpu_missing, r"GPU overlay must set resources\.limits nvidia"),
    ("GPU claim missing", "gpu", _m_pvc, r"PersistentVolumeClaim 'spade-model', which is not in the render"),
    ("unknown flag", "cpu", lambda d: cont(d, "spade-cache", "cache")["args"].extend(["--no-such-flag", "1"]),
     r"flag --no-such-flag is not in `cache_rank --help`"),
    ("boolean flag with a value", "cpu", _m_bool_value, r"argument 'yes' is not a flag"),
    ("inference without --serve", "cpu", _m_no_serve, r"must run with --serve"),
    ("metrics port != containerPort", "cpu",
     lambda d: set_arg(cont(d, "spade-cache", "cache"), "--metrics-port", "9999"), r"--metrics-port 9999 !="),
    ("coordinator --port != control port", "cpu",
     lambda d: cont(d, "spade-coordinator", "coordinator", "Deployment")["ports"][1].update(containerPort=29501),
     r"--port 29500 != containerPort 'control'"),
    ("env not read by anyone", "cpu", _m_env_unknown, r"env SPADE_NOT_READ_BY_ANYONE is read neither"),
    ("UCX env on the coordinator (no UCX there)", "cpu", _m_env_ucx_coord, r"env UCX_TLS is read neither by coord"),
    ("undefined $(VAR) in args", "cpu", _m_undefined, r"undefined variables \['SPADE_TOP_K'\]"),
    ("configMapKeyRef to a missing key", "cpu", _m_cm_key, r"has no key 'NOPE'"),
    ("unused config key", "cpu", _m_cm_unused, r"key SPADE_UNUSED_SETTING is used by no container"),
    ("replicas != SPADE_NUM_PAIRS", "cpu", _m_cache_replicas, r"(ranks of the pods|replicas 2 != )"),
    ("identity flag in args", "cpu", _m_ep_identity, r"the rank identity is derived"),
    ("selection settings differ between ranks", "cpu", _m_budget, r"--token-budget differs"),
    ("GPU cache rank given a flag the hello carries", "gpu",
     lambda d: cont(d, "spade-cache", "cache")["args"].extend(["--kv-pages", "64"]),
     r"--kv-pages is refused by cache_rank --device cuda"),
    ("GPU inference rank given the cache rank's predictor flag", "gpu",
     lambda d: cont(d, "spade-inference", "inference")["args"].extend(["--query-window", "4"]),
     r"--query-window is refused by inference_rank --device cuda"),
    ("GPU inference rank given sink tokens", "gpu",
     lambda d: set_arg(cont(d, "spade-inference", "inference"), "--sink-tokens", "4"),
     r"--sink-tokens 4 is refused by inference_rank --device cuda"),
    ("CPU cache rank given a GPU cache rank's flag", "cpu",
     lambda d: cont(d, "spade-cache", "cache")["args"].extend(["--selection-streams", "1"]),
     r"--selection-streams is refused by cache_rank --device cpu"),
    ("control Service hides not-ready coordinator", "cpu", _m_pnra, r"must set publishNotReadyAddresses"),
    ("MASTER_ADDR names no Service", "cpu", _m_master_addr, r"MASTER_ADDR spade-coordinatr-control is not"),
    ("model emptyDir nobody fills", "cpu", _m_init_removed, r"no init container writes"),
    ("demo model written through read-only mount", "cpu", _m_readonly_model_writer, r"through a read-only mount"),
    ("two coordinators", "cpu", _m_coord_replicas, r"exactly one replica"),
    ("coordinator rolling update", "cpu", _m_coord_strategy, r"strategy Recreate"),
    ("prometheus port annotation wrong", "cpu", _m_annotation, r"prometheus\.io/port '9090'"),
    ("no tini", "cpu", _m_no_tini, r"must run under /usr/bin/tini"),
    ("runs as root", "cpu", _m_run_as, r"runAsUser 0 is not the image's user"),
    ("unknown kind", "cpu", _m_kind, r"kind CronJob is not one"),
    ("cache rank without the cluster secret", "cpu", _m_no_secret_env, r"does not get the cluster secret"),
    ("world-readable cluster secret", "cpu", _m_secret_world_readable, r"has mode 0644, readable by every user"),
    ("ranks read different cluster secrets", "cpu", _m_secret_other, r"different Secrets or keys"),
    ("cluster Secret missing from the render", "gpu", _m_secret_missing, r"Secret '.*' is not in the render"),
    ("coordinator control port on loopback", "cpu", _m_control_loopback, r"--host \(default 127\.0\.0\.1\)"),
    ("field name typo", "cpu",
     lambda d: cont(d, "spade-inference", "inference").update(readinesProbe={"httpGet": {"path": "/ready"}}),
     r"readinesProbe: unknown field of Container"),
    ("nested field typo", "gpu",
     lambda d: find(d, "StatefulSet", "spade-cache")["spec"]["template"]["spec"]["tolerations"][0].update(efect="x"),
     r"tolerations\[0\]\.efect: unknown field of Toleration"),
    ("volume with two sources", "cpu",
     lambda d: find(d, "StatefulSet", "spade-cache")["spec"]["template"]["spec"]["volumes"][0].update(
         persistentVolumeClaim={"claimName": "x"}), r"exactly one volume source needed"),
    ("PodMonitor port wrong", "cpu+podmonitor", _m_podmonitor_port, r"podMetricsEndpoint port 'metric'"),
]

SOURCE_MUTATIONS = [
    ("base containerPort edited in the source", "base/cache.yaml", "containerPort: 8080", "containerPort: 8081",
     r"--metrics-port 8080 != containerPort 'metrics' 8081"),
    ("overlay references a missing file", "overlays/cpu/kustomization.yaml", "- namespace.yaml",
     "- namespace-missing.yaml", r"kubectl kustomize overlays/cpu failed"),
    ("scaled without the pair-count component", "overlays/cpu/kustomization.yaml", "  - ../../components/pair-count\n",
     "configMapGenerator:\n  - name: spade-config\n    behavior: merge\n    literals: [SPADE_NUM_PAIRS=2, SPADE_NUM_CACHE=2]\n",
     r"ranks of the pods .* expected 0\.\.4"),
    ("non-numeric pair count", "base/spade.env", "SPADE_NUM_PAIRS=1", "SPADE_NUM_PAIRS=zero",
     r"kubectl kustomize overlays/\w+ failed: .*cannot decode !!str `zero` as a !!int"),
    ("pod identity from the wrong downward-API field", "base/cache.yaml", "fieldPath: metadata.name}",
     "fieldPath: metadata.namespace}", r"POD_NAME='spade' has no -<ordinal> suffix"),
    ("GPU overlay left on the CPU device", "overlays/gpu/kustomization.yaml", "      - SPADE_DEVICE=cuda\n", "",
     r"--device cpu: a GPU overlay runs its ranks with --device cuda"),
]


DOCKER_MUTATIONS = [
    ("image build installs the test tools too", "deploy/docker/Dockerfile", "setup_deps.sh --build-only",
     "setup_deps.sh", r"setup_deps\.sh --build-only"),
    ("image does not build make_demo_checkpoint", "deploy/docker/Dockerfile", " make_demo_checkpoint spade_submit",
     " spade_submit", r"does not build make_demo_checkpoint"),
    ("image runs as root", "deploy/docker/Dockerfile.cuda", "USER 10001:10001", "USER 0", r"disagree on .* user"),
    ("no tini as PID 1", "deploy/docker/Dockerfile", 'ENTRYPOINT ["/usr/bin/tini", "--", ', "ENTRYPOINT [",
     r"tini must be installed and be PID 1"),
    ("CPU image built with CUDA", "deploy/docker/Dockerfile", "-DSPADE_ENABLE_CUDA=OFF", "-DSPADE_ENABLE_CUDA=ON",
     r"Dockerfile: must configure with -DSPADE_ENABLE_CUDA=OFF"),
    ("build trees in the context", "deploy/docker/Dockerfile.cuda.dockerignore", "\nbuild*\n", "\n",
     r"does not exclude the build"),
    ("runtime package resolver broken", "deploy/docker/runtime-packages.sh", 'owner["$file"]=',
     'owner["$file.nope"]=', r"runtime-packages\.sh failed on the built binaries: .* belongs to no package"),
]


def self_test(a, ctx):
    failures = []
    with tempfile.TemporaryDirectory(prefix="spade-k8s-selftest-") as tmp:
        base_copy = copy_k8s(ctx.source_dir, os.path.join(tmp, "k8s"))
        renders = render_all(a.kubectl, base_copy)
        baseline = set(check_renders(renders, ctx))
        print(f"self-test: baseline has {len(baseline)} error(s) (each mutation must add a new one)")
        by_label = {label: (docs, g) for label, docs, g in renders}
        for name, label, mutate, pattern in RENDER_MUTATIONS:
            if label not in by_label:
                failures.append(f"{name}: no render '{label}' to mutate")
                continue
            docs = copy.deepcopy(by_label[label][0])
            try:
                mutate(docs)
            except (KeyError, ValueError, IndexError) as e:
                failures.append(f"{name}: mutation could not be applied ({e!r}); the manifests changed shape")
                continue
            new = set(OverlayCheck(label, docs, by_label[label][1], ctx).run()) - baseline
            hit = [e for e in new if re.search(pattern, e)]
            print(f"  {'caught' if hit else 'MISSED'}: {name}" + (f"  <- {hit[0]}" if hit else ""))
            if not hit:
                failures.append(f"{name}: no new error matching /{pattern}/ (new errors: {sorted(new)[:3]})")
        for name, rel, old, new_text, pattern in SOURCE_MUTATIONS:
            d = copy_k8s(ctx.source_dir, os.path.join(tmp, f"src-{len(name)}-{abs(hash(name)) % 10**6}"))
            path = os.path.join(d, rel)
            text = open(path, encoding="utf-8").read()
            if old not in text:
                failures.append(f"{name}: '{old}' not found in {rel}; the manifests changed shape")
                continue
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new_text, 1))
            try:
                errs = set(check_renders(render_all(a.kubectl, d), ctx))
            except Fatal as e:
                errs = {str(e)}
            new = errs - baseline
            hit = [e for e in new if re.search(pattern, e)]
            print(f"  {'caught' if hit else 'MISSED'}: {name} (source copy)" + (f"  <- {hit[0]}" if hit else ""))
            if not hit:
                failures.append(f"{name}: no new error matching /{pattern}/ (new errors: {sorted(new)[:3]})")
        # The documented way to scale (a configMapGenerator merge of SPADE_NUM_PAIRS and SPADE_NUM_CACHE) must pass
        # every check: 3 pairs, and 2 inference ranks with 2 cache ranks (layer shards) each.
        for inf_n, cache_n in ((3, 3), (2, 4)):
            d = copy_k8s(ctx.source_dir, os.path.join(tmp, f"scaled-{inf_n}-{cache_n}"))
            with open(os.path.join(d, "overlays/cpu/kustomization.yaml"), "a", encoding="utf-8") as f:
                f.write("configMapGenerator:\n  - name: spade-config\n    behavior: merge\n"
                        f"    literals: [SPADE_NUM_PAIRS={inf_n}, SPADE_NUM_CACHE={cache_n}]\n")
            scaled = [r for r in render_all(a.kubectl, d) if r[0] == "cpu"]
            new = set(check_renders(scaled, ctx)) - baseline
            reps = {x["metadata"]["name"]: x["spec"]["replicas"] for x in scaled[0][1] if x["kind"] == "StatefulSet"}
            if new or reps != {"spade-inference": inf_n, "spade-cache": cache_n}:
                failures.append(f"scaling to {inf_n} inference + {cache_n} cache ranks: replicas {reps}, new errors "
                                f"{sorted(new)[:3]}")
            else:
                print(f"  ok: SPADE_NUM_PAIRS={inf_n} SPADE_NUM_CACHE={cache_n} renders {inf_n} + {cache_n} rank pods "
                      f"with ranks 0..{inf_n + cache_n} and passes")
        # The image checks.
        for name, rel, old, new_text, pattern in DOCKER_MUTATIONS:
            src = os.path.join(tmp, f"docker-{abs(hash(name)) % 10**8}")
            shutil.copytree(os.path.join(ctx.source_dir, "deploy"), os.path.join(src, "deploy"))
            path = os.path.join(src, rel)
            text = open(path, encoding="utf-8").read()
            if old not in text:
                failures.append(f"{name}: '{old}' not found in {rel}; the Dockerfiles changed shape")
                continue
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new_text, 1))
            errs = set(ImageFacts(src, [b.path for b in ctx.binaries.values()]).errors) - set(ctx.image.errors)
            hit = [e for e in errs if re.search(pattern, e)]
            print(f"  {'caught' if hit else 'MISSED'}: {name}" + (f"  <- {hit[0]}" if hit else ""))
            if not hit:
                failures.append(f"{name}: no new error matching /{pattern}/ (new errors: {sorted(errs)[:3]})")
    # The entrypoint must refuse what it cannot map, independently of the manifests.
    for env, args, pattern in [
        ({"SPADE_NUM_PAIRS": "2", "POD_NAME": "spade-cache-2"}, ["cache"], r"out of range"),
        ({"SPADE_NUM_PAIRS": "2", "POD_NAME": "spade-cache-1", "SPADE_POD_INDEX": "0"}, ["cache"], r"disagrees"),
        ({"SPADE_NUM_PAIRS": "1"}, ["inference"], r"needs a pod index"),
        ({"SPADE_NUM_PAIRS": "1", "POD_NAME": "x-0"}, ["router"], r"unknown role"),
        ({"SPADE_NUM_PAIRS": "2", "SPADE_NUM_CACHE": "3", "POD_NAME": "spade-cache-0"}, ["cache"],
         r"not a multiple of SPADE_NUM_PAIRS"),
        ({"SPADE_NUM_PAIRS": "2", "SPADE_NUM_CACHE": "4", "POD_NAME": "spade-inference-2"}, ["inference"],
         r"out of range for SPADE_NUM_PAIRS=2"),
    ]:
        penv = dict(env, PATH=os.environ.get("PATH", ""), SPADE_ENTRYPOINT_DRY_RUN="1")
        p = subprocess.run([ctx.entrypoint] + args, env=penv, capture_output=True, text=True)
        ok = p.returncode == 2 and re.search(pattern, p.stderr)
        print(f"  {'caught' if ok else 'MISSED'}: entrypoint {args} {env}")
        if not ok:
            failures.append(f"entrypoint {args} {env}: expected exit 2 and /{pattern}/, got {p.returncode} "
                            f"{p.stderr.strip()}")
    p = subprocess.run([ctx.entrypoint, "cache"], capture_output=True, text=True,
                       env={"PATH": os.environ.get("PATH", ""), "SPADE_ENTRYPOINT_DRY_RUN": "1",
                            "SPADE_NUM_PAIRS": "3", "POD_NAME": "spade-cache-2"})
    argv = p.stdout.split("\0")
    if p.returncode != 0 or argv[1:9] != ["--rank", "6", "--world-size", "7", "--num-inference", "3",
                                          "--num-cache", "3"]:
        failures.append(f"entrypoint cache #2 of 3 pairs: expected rank 6 of 7, got {argv} ({p.stderr.strip()})")
    else:
        print("  ok: entrypoint maps cache #2 of 3 pairs to rank 6 of world size 7")
    p = subprocess.run([ctx.entrypoint, "cache"], capture_output=True, text=True,
                       env={"PATH": os.environ.get("PATH", ""), "SPADE_ENTRYPOINT_DRY_RUN": "1",
                            "SPADE_NUM_PAIRS": "2", "SPADE_NUM_CACHE": "4", "POD_NAME": "spade-cache-3"})
    argv = p.stdout.split("\0")
    if p.returncode != 0 or argv[1:9] != ["--rank", "6", "--world-size", "7", "--num-inference", "2",
                                          "--num-cache", "4"]:
        failures.append(f"entrypoint cache #3 of 2 x 2 shards: expected rank 6 of 7, got {argv} ({p.stderr.strip()})")
    else:
        print("  ok: entrypoint maps cache #3 of 2 inference ranks x 2 shards to rank 6 of world size 7")
    if failures:
        print("self-test FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    n = len(RENDER_MUTATIONS) + len(SOURCE_MUTATIONS) + len(DOCKER_MUTATIONS) + 6
    print(f"self-test passed: {n} mutations caught, entrypoint mapping and scaling verified")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-dir", required=True, help="repository root (deploy/k8s, deploy/docker, sources)")
    ap.add_argument("--kubectl", default="kubectl", help="kubectl with kustomize >= v4.5")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--inference-rank", required=True)
    ap.add_argument("--cache-rank", required=True)
    ap.add_argument("--make-demo-checkpoint", required=True)
    ap.add_argument("--self-test", action="store_true", help="check that the checker catches mutations")
    a = ap.parse_args()
    try:
        kv = kustomize_version(a.kubectl)
        ctx = build_ctx(a)
        if a.self_test:
            return self_test(a, ctx)
        with tempfile.TemporaryDirectory(prefix="spade-k8s-check-") as tmp:
            renders = render_all(a.kubectl, copy_k8s(ctx.source_dir, os.path.join(tmp, "k8s")))
            errors = list(ctx.image.errors) + check_renders(renders, ctx)
    except Fatal as e:
        print(f"check_k8s: error: {e}", file=sys.stderr)
        return 1
    labels = ", ".join(f"{l} ({len(d)} objects)" for l, d, _ in renders)
    if errors:
        print(f"check_k8s: {len(errors)} problem(s) in {labels}:", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    print(f"check_k8s: ok: {labels}; kustomize {kv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
