#!/usr/bin/env python3
"""The checks of check_k8s.py (see its docstring for what is checked): the binaries' and images' facts, kustomize
rendering, the Kubernetes object schema and OverlayCheck, which checks one rendered overlay. check_k8s.py holds the
command line and the self-test (mutations that each check must catch)."""

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

import yaml


KNOWN_KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "PersistentVolumeClaim",
               "PodMonitor"}
# Role of a main container = the binary its final command line runs.
ROLE_OF_BINARY = {"coordinator": "coordinator", "inference_rank": "inference", "cache_rank": "cache"}
# Ports each binary serves, by flag -> containerPort name.
PORT_FLAGS = {
    "coordinator": {"--port": "control", "--http-port": "http"},
    "inference_rank": {"--metrics-port": "metrics"},
    "cache_rank": {"--metrics-port": "metrics"},
}
HTTP_PORT_NAMES = {"http", "metrics"}  # ports that serve /health, /ready and /metrics
# Flags that must carry the same value on an inference rank and its cache rank, by device. On the GPU the pair hello
# carries the inference rank's budget, local window and page size to the cache rank, and the predictor's settings
# are the cache rank's alone, so only the model is given to both.
SHARED_SELECTION_FLAGS = {
    "cpu": ["--model", "--token-budget", "--local-window", "--sink-tokens", "--query-window", "--ridge-eps",
            "--gqa-rule", "--page-size"],
    "cuda": ["--model"],
}
# Flags a rank refuses by name on a device (it would ignore them): (binary, device) -> flags. Mirrors
# refuse_unused_flags in cache_rank/rank_flags.cpp and inference_rank/rank_flags.cpp (--serve, the form the
# manifests run), whose refusals tests/{cache_rank,inference_rank}/test_rank_flags.cpp check on the binaries.
REFUSED_FLAGS = {
    ("cache_rank", "cpu"): ["--gpu", "--hello-timeout-ms", "--selection-streams"],
    ("cache_rank", "cuda"): ["--token-budget", "--local-window", "--kv-pages", "--page-size", "--sink-tokens",
                             "--delta-transfer"],
    ("inference_rank", "cpu"): ["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat",
                                "--ignore-eos", "--random-weights", "--weights-seed", "--tokenizer", "--host-sampling",
                                "--no-cuda-graphs", "--gpu", "--gpu-link", "--delta-capacity", "--max-context-pages",
                                "--overlap-sample-every"],
    ("inference_rank", "cuda"): ["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat",
                                 "--ignore-eos", "--random-weights", "--weights-seed", "--tokenizer",
                                 "--host-sampling", "--query-window", "--ridge-eps", "--gqa-rule", "--predictor",
                                 "--successor-expand", "--overlap-sample-every"],
}
IDENTITY_FLAGS = ["--rank", "--world-size", "--num-inference", "--num-cache"]
LIBRARY_ENV = {"libucp": "UCX_", "libgomp": "OMP_"}  # a binary linking the library may be given <prefix>* env
ENV_SOURCE_DIRS = ["coordinator", "inference_rank", "cache_rank", "common", "transport", "kernels"]
ENTRYPOINT_SCRIPT = "deploy/docker/spade-entrypoint.sh"
DOCKERFILES = ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"]
IMAGE_PROGRAMS = ["coordinator", "inference_rank", "cache_rank", "make_demo_checkpoint", "spade_submit"]
MIN_KUSTOMIZE = (4, 5)  # components + replacements


class Fatal(Exception):
    """A problem that stops the check (missing tool, render failure): reported as one error."""


# ----------------------------------------------------------------------------------------------------------------
# small helpers

def parse_cpu(q, where):
    s = str(q)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", s)
    if not m:
        raise ValueError(f"{where}: cpu quantity '{s}' is not valid")
    v = float(m.group(1))
    return v / 1000 if m.group(2) else v


def parse_mem(q, where):
    s = str(q)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?", s)
    if not m:
        raise ValueError(f"{where}: memory quantity '{s}' is not valid")
    mult = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
            "Ti": 2**40, "Pi": 2**50}[m.group(2)]
    return float(m.group(1)) * mult


def parse_quantity(resource, q, where):
    if resource == "cpu":
        return parse_cpu(q, where)
    if resource in ("memory", "ephemeral-storage"):
        return parse_mem(q, where)
    s = str(q)
    if not re.fullmatch(r"\d+", s):
        raise ValueError(f"{where}: {resource} quantity '{s}' must be a whole number")
    return float(s)


def selector_matches(selector, labels):
    """Evaluates a LabelSelector (matchLabels + matchExpressions) or a plain map selector on labels."""
    if not selector:
        return False
    if "matchLabels" in selector or "matchExpressions" in selector:
        ml = selector.get("matchLabels") or {}
        exprs = selector.get("matchExpressions") or []
    else:
        ml, exprs = selector, []
    if not ml and not exprs:
        return False
    for k, v in ml.items():
        if labels.get(k) != v:
            return False
    for e in exprs:
        k, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(s, env, undefined):
    """The kubelet's $(VAR) expansion: defined references are replaced, $$ is a literal $, undefined references
    stay as written (and are recorded in `undefined`)."""
    def rep(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        if name in env:
            return env[name]
        undefined.add(name)
        return m.group(0)
    return VAR_REF.sub(rep, str(s))


def refs_in(s):
    return {m.group(1) for m in VAR_REF.finditer(str(s)) if m.group(1)}


# ----------------------------------------------------------------------------------------------------------------
# facts about the binaries, the entrypoint and the images (independent of the manifests)

class BinaryFacts:
    def __init__(self, name, path, source_env_names):
        self.name, self.path = name, path
        if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise Fatal(f"binary {name}: '{path}' is not an executable file")
        try:
            p = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Fatal(f"binary {name}: cannot run '{path} --help': {e}")
        if p.returncode != 0:
            raise Fatal(f"binary {name}: '{path} --help' exited {p.returncode}: {p.stderr.strip()[:300]}")
        self.flags = parse_cli11_help(p.stdout)
        if "--help" not in self.flags:
            raise Fatal(f"binary {name}: '{path} --help' printed no CLI11 option list")
        data = open(path, "rb").read()
        self.env_names = {n for n in source_env_names if (n.encode() + b"\0") in data}
        try:
            ldd = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=60).stdout
        except OSError:
            ldd = ""
        self.env_prefixes = {pre for lib, pre in LIBRARY_ENV.items() if lib in ldd}

    def reads_env(self, name):
        return name in self.env_names or any(name.startswith(p) for p in self.env_prefixes)


def parse_cli11_help(text):
    """{flag: takes_value} from CLI11 --help output ("  --token-budget INT:POSITIVE  ...")."""
    flags = {}
    for line in text.splitlines():
        m = re.match(r"^\s{1,8}(?:-\w,)?(--[A-Za-z0-9][\w-]*)(.*)$", line)
        if not m:
            continue
        rest = m.group(2)
        tm = re.match(r"^\s+([A-Z][A-Z0-9_]*(?::[A-Z0-9_]+)?)(?:[ =.]|$)", rest)
        flags[m.group(1)] = bool(tm) and tm.group(1) not in ("REQUIRED",) and not rest.strip().startswith("Excludes")
    return flags


def source_env_names(source_dir):
    names = set()
    pat = re.compile(r"\b(?:getenv|env)\(\s*\"([A-Z][A-Z0-9_]*)\"\s*\)")
    for d in ENV_SOURCE_DIRS:
        root = os.path.join(source_dir, d)
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f.endswith((".cpp", ".h", ".cc", ".hpp", ".cu", ".cuh")):
                    with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                        names.update(pat.findall(fh.read()))
    return names


def entrypoint_reads(path):
    """Env names the entrypoint documents on its '# Reads:' line; each must occur in the script body."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^# Reads:(.*)$", text, re.M)
    if not m:
        raise Fatal(f"{path}: no '# Reads: NAME ...' line documenting the environment it reads")
    names = m.group(1).split()
    body = "\n".join(l for l in text.splitlines() if not l.startswith("#"))
    missing = [n for n in names if not re.search(r"\$\{?" + re.escape(n) + r"\b", body)]
    if missing:
        raise Fatal(f"{path}: '# Reads:' lists {missing}, which the script never reads")
    return set(names)


class ImageFacts:
    """What the Dockerfiles install: bin dir, programs, entrypoint, user id; errors are collected."""

    def __init__(self, source_dir, binaries):
        self.errors = []
        self.bin_dir, self.uid, self.programs = None, None, set()
        seen = []
        for rel in DOCKERFILES:
            path = os.path.join(source_dir, rel)
            if not os.path.isfile(path):
                self.errors.append(f"{rel}: missing")
                continue
            seen.append(self.check_dockerfile(rel, open(path, encoding="utf-8").read(), source_dir))
        if seen:
            bins = {s[0] for s in seen}
            uids = {s[1] for s in seen}
            if len(bins) != 1 or len(uids) != 1:
                self.errors.append(f"Dockerfiles disagree on SPADE_BIN_DIR {bins} or user {uids}")
            self.bin_dir, self.uid = seen[0][0], seen[0][1]
            self.programs = set.intersection(*[s[2] for s in seen])
        self.check_runtime_packages(source_dir, binaries)
        self.errors = list(dict.fromkeys(self.errors))

    def check_dockerfile(self, rel, text, source_dir):
        e = self.errors
        joined = re.sub(r"\\\n", " ", text)
        m = re.search(r"^ENV\s.*\bSPADE_BIN_DIR=(\S+)", joined, re.M)
        bin_dir = m.group(1) if m else None
        if not bin_dir:
            e.append(f"{rel}: no ENV SPADE_BIN_DIR=<dir> (where the programs are installed)")
        m = re.search(r"^USER\s+(\d+)(?::(\d+))?\s*$", joined, re.M)
        uid = int(m.group(1)) if m else None
        if uid is None:
            e.append(f"{rel}: no numeric USER (Kubernetes runAsNonRoot needs a numeric user)")
        m = re.search(r"cmake --build \S+ --target ((?:[\w-]+ ?)+)", joined)
        targets = set(m.group(1).split()) if m else set()
        for t in IMAGE_PROGRAMS:
            if t not in targets:
                e.append(f"{rel}: cmake --build --target does not build {t}")
        want_cuda = "ON" if rel.endswith(".cuda") else "OFF"
        if f"-DSPADE_ENABLE_CUDA={want_cuda}" not in joined:
            e.append(f"{rel}: must configure with -DSPADE_ENABLE_CUDA={want_cuda}")
        if "-DSPADE_ENABLE_UCX=ON" not in joined:
            e.append(f"{rel}: must configure with -DSPADE_ENABLE_UCX=ON (the data plane between pods is UCX)")
        if not re.search(r"COPY deploy/scripts/setup_deps\.sh .*\n(?:.*\n)*?RUN \S*setup_deps\.sh --build-only", text):
            e.append(f"{rel}: the build stage must install the packages with deploy/scripts/setup_deps.sh "
                     "--build-only")
        deps = os.path.join(source_dir, "deploy/scripts/setup_deps.sh")
        if not os.path.isfile(deps) or "--build-only" not in open(deps, encoding="utf-8").read():
            e.append("deploy/scripts/setup_deps.sh has no --build-only mode: the image build stage, which has only "
                     "that script and no source tree, would also try to install the test tools (kubectl, nodejs, "
                     "npm ci in tests/coordinator/openai_client) and fail")
        if bin_dir and f"{bin_dir}/spade-entrypoint" not in joined:
            e.append(f"{rel}: does not install {bin_dir}/spade-entrypoint")
        if "spade-entrypoint.sh" not in joined:
            e.append(f"{rel}: does not install deploy/docker/spade-entrypoint.sh")
        if not re.search(r'^ENTRYPOINT \["/usr/bin/tini", "--"', joined, re.M) or " tini" not in joined:
            e.append(f"{rel}: tini must be installed and be PID 1 (ENTRYPOINT [\"/usr/bin/tini\", \"--\", ...])")
        if "runtime-packages.sh" not in joined:
            e.append(f"{rel}: runtime libraries must be resolved with deploy/docker/runtime-packages.sh")
        ign = os.path.join(source_dir, rel + ".dockerignore")
        if not os.path.isfile(ign) or not re.search(r"^build\*", open(ign).read(), re.M):
            e.append(f"{rel}.dockerignore: missing or does not exclude the build*/ trees from the context")
        programs = set(targets) | {"spade-entrypoint"}
        return bin_dir, uid, programs

    def check_runtime_packages(self, source_dir, binaries):
        script = os.path.join(source_dir, "deploy/docker/runtime-packages.sh")
        # A CUDA build's inference_rank and cache_rank link the CUDA runtime, cuBLASLt and NCCL (their --device cuda
        # paths). The image
        # that ships such binaries (Dockerfile.cuda) starts from nvidia/cuda's runtime image, which provides those
        # libraries, and says so with the same SPADE_RUNTIME_PROVIDED list; the CPU image builds without CUDA.
        provided = re.search(r'SPADE_RUNTIME_PROVIDED="([^"]*)"',
                             open(os.path.join(source_dir, "deploy/docker/Dockerfile.cuda")).read())
        env = dict(os.environ, SPADE_RUNTIME_PROVIDED=provided.group(1) if provided else "")
        p = subprocess.run([script] + binaries, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            first = (p.stderr.strip().splitlines() or ["(no message)"])[0]
            self.errors.append(f"deploy/docker/runtime-packages.sh failed on the built binaries: {first}")
            return
        pkgs = p.stdout.split()
        for want in ("libucx0", "libprotobuf32", "libspdlog1.10", "libfmt9", "libpcre2-8-0"):
            if want not in pkgs:
                self.errors.append(f"deploy/docker/runtime-packages.sh: {want} missing from {pkgs} "
                                   "(the binaries link it)")


# ----------------------------------------------------------------------------------------------------------------
# rendering

def kustomize_version(kubectl):
    try:
        p = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True,
                           timeout=120)
    except OSError as e:
        raise Fatal(f"cannot run kubectl '{kubectl}': {e} (install kubectl >= 1.24, which embeds kustomize v4.5+)")
    try:
        v = json.loads(p.stdout).get("kustomizeVersion", "")
    except json.JSONDecodeError:
        v = ""
    m = re.match(r"v(\d+)\.(\d+)", v)
    if not m or (int(m.group(1)), int(m.group(2))) < MIN_KUSTOMIZE:
        raise Fatal(f"kubectl '{kubectl}' embeds kustomize '{v or 'unknown'}'; these manifests need kustomize "
                    f">= v{MIN_KUSTOMIZE[0]}.{MIN_KUSTOMIZE[1]} (components, replacements): kubectl >= 1.24")
    return v


def render(kubectl, k8s_dir, overlay_rel):
    p = subprocess.run([kubectl, "kustomize", os.path.join(k8s_dir, overlay_rel)], capture_output=True, text=True,
                       timeout=300)
    if p.returncode != 0:
        raise Fatal(f"kubectl kustomize {overlay_rel} failed: {p.stderr.strip()[-800:]}")
    try:
        return [d for d in yaml.safe_load_all(p.stdout) if d is not None]
    except yaml.YAMLError as e:
        raise Fatal(f"kubectl kustomize {overlay_rel}: output is not YAML: {e}")


def kustomization_refs(path):
    with open(path, encoding="utf-8") as f:
        k = yaml.safe_load(f) or {}
    return k


def discover(k8s_dir):
    """[(label, overlay dir relative to k8s_dir, is_gpu)] with optional components added as extra overlays.
    The combined overlays are written under k8s_dir (a temporary copy)."""
    overlays_dir = os.path.join(k8s_dir, "overlays")
    if not os.path.isdir(overlays_dir):
        raise Fatal(f"{overlays_dir}: no overlays")
    overlays = sorted(d for d in os.listdir(overlays_dir)
                      if os.path.isfile(os.path.join(overlays_dir, d, "kustomization.yaml")))
    if not overlays:
        raise Fatal(f"{overlays_dir}: no overlay has a kustomization.yaml")
    used = set()
    for o in overlays:
        k = kustomization_refs(os.path.join(overlays_dir, o, "kustomization.yaml"))
        for c in k.get("components") or []:
            used.add(os.path.basename(os.path.normpath(c)))
    comp_dir = os.path.join(k8s_dir, "components")
    optional = sorted(c for c in (os.listdir(comp_dir) if os.path.isdir(comp_dir) else [])
                      if c not in used and os.path.isfile(os.path.join(comp_dir, c, "kustomization.yaml")))
    out = [(o, f"overlays/{o}", "gpu" in o) for o in overlays]
    for c in optional:
        for o in overlays:
            d = os.path.join(overlays_dir, f"zz-check-{o}-{c}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "kustomization.yaml"), "w") as f:
                yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                "resources": [f"../{o}"], "components": [f"../../components/{c}"]}, f)
            out.append((f"{o}+{c}", f"overlays/zz-check-{o}-{c}", "gpu" in o))
    return out


# ----------------------------------------------------------------------------------------------------------------
# field names (a typo in an optional field would otherwise vanish silently): the Kubernetes API fields of the kinds
# rendered here, as of Kubernetes 1.32. Values: the type of the field's value (a key of SCHEMA), "[T]" for a list
# of T, or None for a scalar / free-form map.

SCHEMA = {
    "ObjectMeta": {"name": None, "namespace": None, "labels": None, "annotations": None, "generateName": None,
                   "finalizers": None, "ownerReferences": None},
    "Namespace": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": None},
    "ConfigMap": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "data": None, "binaryData": None,
                  "immutable": None},
    "Secret": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "data": None, "stringData": None,
               "type": None, "immutable": None},
    "PersistentVolumeClaim": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": "PVCSpec"},
    "PVCSpec": {"accessModes": None, "selector": None, "resources": "VolumeResources", "volumeName": None,
                "storageClassName": None, "volumeMode": None, "dataSource": None, "dataSourceRef": None,
                "volumeAttributesClassName": None},
    "VolumeResources": {"requests": None, "limits": None},
    "Service": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": "ServiceSpec"},
    "ServiceSpec": {"ports": "[ServicePort]", "selector": None, "clusterIP": None, "clusterIPs": None, "type": None,
                    "externalIPs": None, "sessionAffinity": None, "loadBalancerIP": None,
                    "loadBalancerSourceRanges": None, "externalName": None, "externalTrafficPolicy": None,
                    "healthCheckNodePort": None, "publishNotReadyAddresses": None, "sessionAffinityConfig": None,
                    "ipFamilies": None, "ipFamilyPolicy": None, "allocateLoadBalancerNodePorts": None,
                    "loadBalancerClass": None, "internalTrafficPolicy": None, "trafficDistribution": None},
    "ServicePort": {"name": None, "protocol": None, "appProtocol": None, "port": None, "targetPort": None,
                    "nodePort": None},
    "Deployment": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": "DeploymentSpec"},
    "DeploymentSpec": {"replicas": None, "selector": "LabelSelector", "template": "PodTemplate", "strategy": None,
                       "minReadySeconds": None, "revisionHistoryLimit": None, "paused": None,
                       "progressDeadlineSeconds": None},
    "StatefulSet": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": "StatefulSetSpec"},
    "StatefulSetSpec": {"replicas": None, "selector": "LabelSelector", "template": "PodTemplate",
                        "volumeClaimTemplates": None, "serviceName": None, "podManagementPolicy": None,
                        "updateStrategy": None, "revisionHistoryLimit": None, "minReadySeconds": None,
                        "persistentVolumeClaimRetentionPolicy": None, "ordinals": None},
    "LabelSelector": {"matchLabels": None, "matchExpressions": None},
    "PodTemplate": {"metadata": "ObjectMeta", "spec": "PodSpec"},
    "PodSpec": {"volumes": "[Volume]", "initContainers": "[Container]", "containers": "[Container]",
                "ephemeralContainers": None, "restartPolicy": None, "terminationGracePeriodSeconds": None,
                "activeDeadlineSeconds": None, "dnsPolicy": None, "nodeSelector": None, "serviceAccountName": None,
                "serviceAccount": None, "automountServiceAccountToken": None, "nodeName": None,
                "hostNetwork": None, "hostPID": None, "hostIPC": None, "shareProcessNamespace": None,
                "securityContext": "PodSecurityContext", "imagePullSecrets": None, "hostname": None,
                "subdomain": None, "affinity": None, "schedulerName": None, "tolerations": "[Toleration]",
                "hostAliases": None, "priorityClassName": None, "priority": None, "dnsConfig": None,
                "readinessGates": None, "runtimeClassName": None, "enableServiceLinks": None,
                "preemptionPolicy": None, "overhead": None, "topologySpreadConstraints": None,
                "setHostnameAsFQDN": None, "os": None, "hostUsers": None, "schedulingGates": None,
                "resourceClaims": None, "resources": None},
    "PodSecurityContext": {"seLinuxOptions": None, "windowsOptions": None, "runAsUser": None, "runAsGroup": None,
                           "runAsNonRoot": None, "supplementalGroups": None, "supplementalGroupsPolicy": None,
                           "fsGroup": None, "sysctls": None, "fsGroupChangePolicy": None, "seccompProfile": None,
                           "appArmorProfile": None, "seLinuxChangePolicy": None},
    "Toleration": {"key": None, "operator": None, "value": None, "effect": None, "tolerationSeconds": None},
    "Volume": {"name": None, "emptyDir": "EmptyDir", "persistentVolumeClaim": "PVCSource", "configMap": None,
               "secret": "SecretVolume", "hostPath": None, "projected": None, "downwardAPI": None, "ephemeral": None,
               "csi": None, "nfs": None, "image": None},
    "EmptyDir": {"medium": None, "sizeLimit": None},
    "SecretVolume": {"secretName": None, "items": "[KeyToPath]", "defaultMode": None, "optional": None},
    "KeyToPath": {"key": None, "path": None, "mode": None},
    "PVCSource": {"claimName": None, "readOnly": None},
    "Container": {"name": None, "image": None, "command": None, "args": None, "workingDir": None,
                  "ports": "[ContainerPort]", "envFrom": None, "env": "[EnvVar]", "resources": "Resources",
                  "resizePolicy": None, "restartPolicy": None, "volumeMounts": "[VolumeMount]",
                  "volumeDevices": None, "livenessProbe": "Probe", "readinessProbe": "Probe",
                  "startupProbe": "Probe", "lifecycle": None, "terminationMessagePath": None,
                  "terminationMessagePolicy": None, "imagePullPolicy": None, "securityContext": "SecurityContext",
                  "stdin": None, "stdinOnce": None, "tty": None},
    "ContainerPort": {"name": None, "hostPort": None, "containerPort": None, "protocol": None, "hostIP": None},
    "EnvVar": {"name": None, "value": None, "valueFrom": "EnvVarSource"},
    "EnvVarSource": {"fieldRef": "FieldRef", "resourceFieldRef": "ResourceFieldRef", "configMapKeyRef": "KeyRef",
                     "secretKeyRef": "KeyRef"},
    "FieldRef": {"apiVersion": None, "fieldPath": None},
    "ResourceFieldRef": {"containerName": None, "resource": None, "divisor": None},
    "KeyRef": {"name": None, "key": None, "optional": None},
    "Resources": {"limits": None, "requests": None, "claims": None},
    "VolumeMount": {"name": None, "readOnly": None, "recursiveReadOnly": None, "mountPath": None, "subPath": None,
                    "mountPropagation": None, "subPathExpr": None},
    "Probe": {"exec": None, "httpGet": "HTTPGet", "tcpSocket": None, "grpc": None, "initialDelaySeconds": None,
              "timeoutSeconds": None, "periodSeconds": None, "successThreshold": None, "failureThreshold": None,
              "terminationGracePeriodSeconds": None},
    "HTTPGet": {"path": None, "port": None, "host": None, "scheme": None, "httpHeaders": None},
    "SecurityContext": {"capabilities": None, "privileged": None, "seLinuxOptions": None, "windowsOptions": None,
                        "runAsUser": None, "runAsGroup": None, "runAsNonRoot": None, "readOnlyRootFilesystem": None,
                        "allowPrivilegeEscalation": None, "procMount": None, "seccompProfile": None,
                        "appArmorProfile": None},
    "PodMonitor": {"apiVersion": None, "kind": None, "metadata": "ObjectMeta", "spec": "PodMonitorSpec"},
    "PodMonitorSpec": {"jobLabel": None, "podTargetLabels": None, "podMetricsEndpoints": "[PodMetricsEndpoint]",
                       "selector": "LabelSelector", "namespaceSelector": None, "sampleLimit": None,
                       "targetLimit": None, "labelLimit": None, "labelNameLengthLimit": None,
                       "labelValueLengthLimit": None, "attachMetadata": None, "scrapeProtocols": None,
                       "scrapeClass": None, "selectorMechanism": None, "fallbackScrapeProtocol": None,
                       "keepDroppedTargets": None, "nativeHistogramBucketLimit": None,
                       "nativeHistogramMinBucketFactor": None, "convertClassicHistogramsToNHCB": None,
                       "scrapeClassicHistograms": None, "bodySizeLimit": None},
    "PodMetricsEndpoint": {"port": None, "portNumber": None, "targetPort": None, "path": None, "scheme": None,
                           "params": None, "interval": None, "scrapeTimeout": None, "honorLabels": None,
                           "honorTimestamps": None, "trackTimestampsStaleness": None, "metricRelabelings": None,
                           "relabelings": None, "basicAuth": None, "bearerTokenSecret": None, "oauth2": None,
                           "authorization": None, "tlsConfig": None, "proxyUrl": None, "followRedirects": None,
                           "enableHttp2": None, "filterRunning": None, "noProxy": None,
                           "proxyFromEnvironment": None, "proxyConnectHeader": None},
}
VOLUME_SOURCES = [k for k in SCHEMA["Volume"] if k != "name"]


def unknown_fields(obj, typ, path, out):
    """Appends 'path: unknown field' for every key of obj not in SCHEMA[typ] (recursively)."""
    if typ.startswith("["):
        if isinstance(obj, list):
            for i, x in enumerate(obj):
                unknown_fields(x, typ[1:-1], f"{path}[{i}]", out)
        else:
            out.append(f"{path}: must be a list")
        return
    if not isinstance(obj, dict):
        out.append(f"{path}: must be a map")
        return
    fields = SCHEMA[typ]
    for k, v in obj.items():
        if k not in fields:
            out.append(f"{path}.{k}: unknown field of {typ} (a typo? the API server would reject it)")
        elif fields[k] is not None and v is not None:
            unknown_fields(v, fields[k], f"{path}.{k}", out)
    if typ == "Volume":
        srcs = [k for k in obj if k in VOLUME_SOURCES]
        if len(srcs) != 1:
            out.append(f"{path} ({obj.get('name')}): exactly one volume source needed, found {srcs}")


# ----------------------------------------------------------------------------------------------------------------
# the checks on one rendered overlay

class Ctx:
    def __init__(self, source_dir, binaries, entrypoint, entry_reads, image):
        self.source_dir, self.binaries, self.entrypoint = source_dir, binaries, entrypoint
        self.entry_reads, self.image = entry_reads, image


def pod_templates(docs):
    return [d for d in docs if d.get("kind") in ("Deployment", "StatefulSet")]


def containers_of(w):
    spec = ((w.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [(c, False) for c in spec.get("containers") or []] + [(c, True) for c in spec.get("initContainers") or []]


def pod_names(w):
    name = w["metadata"]["name"]
    n = w.get("spec", {}).get("replicas", 1)
    n = n if isinstance(n, int) else 0
    if w["kind"] == "StatefulSet":
        return [(f"{name}-{i}", i) for i in range(n)]
    return [(f"{name}-6d9c7b5f48-x{i}z", None) for i in range(n)]


class OverlayCheck:
    def __init__(self, label, docs, is_gpu, ctx):
        self.label, self.docs, self.is_gpu, self.ctx = label, docs, is_gpu, ctx
        self.errors = []
        self.by_kind = {}
        for d in docs:
            self.by_kind.setdefault(d.get("kind"), []).append(d)

    def err(self, where, msg):
        self.errors.append(f"[{self.label}] {where}: {msg}")

    def get(self, kind, name):
        for d in self.by_kind.get(kind, []):
            if d.get("metadata", {}).get("name") == name:
                return d
        return None

    # -- objects -------------------------------------------------------------------------------------------------
    def check_objects(self):
        for d in self.docs:
            kind, name = d.get("kind"), (d.get("metadata") or {}).get("name")
            if not d.get("apiVersion") or not kind or not name:
                self.err(f"{kind or '?'} {name or '?'}", "apiVersion, kind and metadata.name are required")
            elif kind not in KNOWN_KINDS:
                self.err(f"{kind} {name}", f"kind {kind} is not one this checker validates ({sorted(KNOWN_KINDS)})")
            else:
                out = []
                unknown_fields(d, kind, kind, out)
                for o in out:
                    self.err(f"{kind} {name}", o)

    # -- workloads ------------------------------------------------------------------------------------------------
    def check_workloads(self):
        ws = pod_templates(self.docs)
        if not ws:
            self.err("render", "no Deployment or StatefulSet")
        for w in ws:
            where = f"{w['kind']} {w['metadata']['name']}"
            spec = w.get("spec") or {}
            tmpl = spec.get("template") or {}
            labels = (tmpl.get("metadata") or {}).get("labels") or {}
            sel = spec.get("selector") or {}
            if not sel.get("matchLabels") and not sel.get("matchExpressions"):
                self.err(where, "spec.selector is empty")
            elif not selector_matches(sel, labels):
                self.err(where, f"spec.selector {sel} does not match the template labels {labels}")
            reps = spec.get("replicas", 1)
            if not isinstance(reps, int) or reps < 1:
                self.err(where, f"spec.replicas {reps!r} is not a positive integer")
            if w["kind"] == "StatefulSet":
                sn = spec.get("serviceName")
                svc = self.get("Service", sn) if sn else None
                if not sn:
                    self.err(where, "spec.serviceName is missing")
                elif not svc:
                    self.err(where, f"spec.serviceName '{sn}' names no Service in the render")
                else:
                    if (svc.get("spec") or {}).get("clusterIP") != "None":
                        self.err(where, f"governing Service '{sn}' is not headless (clusterIP: None)")
                    if not selector_matches((svc.get("spec") or {}).get("selector"), labels):
                        self.err(where, f"governing Service '{sn}' does not select this StatefulSet's pods")
                if (spec.get("updateStrategy") or {}).get("type") != "OnDelete":
                    self.err(where, "updateStrategy must be OnDelete (a rolling update replaces one rank at a time, "
                                    "and every replaced rank breaks the world it leaves)")
                if spec.get("podManagementPolicy") != "Parallel":
                    self.err(where, "podManagementPolicy must be Parallel (ranks are Ready only once the whole "
                                    "world has registered; OrderedReady would deadlock the rendezvous)")
            pspec = tmpl.get("spec") or {}
            if not pspec.get("containers"):
                self.err(where, "the pod template has no containers")
            vols = {v.get("name"): v for v in pspec.get("volumes") or []}
            for c, init in containers_of(w):
                self.check_container(w, c, init, vols, pspec)
            for v in vols.values():
                pvc = v.get("persistentVolumeClaim")
                if pvc and not self.get("PersistentVolumeClaim", pvc.get("claimName")):
                    self.err(where, f"volume '{v.get('name')}' uses PersistentVolumeClaim "
                                    f"'{pvc.get('claimName')}', which is not in the render")
                cm = v.get("configMap")
                if cm and not self.get("ConfigMap", cm.get("name")):
                    self.err(where, f"volume '{v.get('name')}' uses ConfigMap '{cm.get('name')}', not in the render")
            uid = (pspec.get("securityContext") or {}).get("runAsUser")
            if self.ctx.image.uid is not None and uid != self.ctx.image.uid:
                self.err(where, f"securityContext.runAsUser {uid} is not the image's user {self.ctx.image.uid}")
            if not (pspec.get("securityContext") or {}).get("runAsNonRoot"):
                self.err(where, "securityContext.runAsNonRoot must be true")

    def check_container(self, w, c, init, vols, pspec):
        where = f"{w['kind']} {w['metadata']['name']} {'initContainer' if init else 'container'} {c.get('name')}"
        image = c.get("image") or ""
        if not image:
            self.err(where, "image is missing")
        else:
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                self.err(where, f"image '{image}' needs an explicit version tag")
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for r in ("cpu", "memory"):
            if r not in req:
                self.err(where, f"resources.requests.{r} is missing")
        if "memory" not in lim:
            self.err(where, "resources.limits.memory is missing")
        for r in set(req) & set(lim):
            try:
                if parse_quantity(r, req[r], where) > parse_quantity(r, lim[r], where):
                    self.err(where, f"resources.requests.{r} {req[r]} exceeds limits.{r} {lim[r]}")
            except ValueError as e:
                self.err(where, str(e))
        mounts = c.get("volumeMounts") or []
        for m in mounts:
            if m.get("name") not in vols:
                self.err(where, f"volumeMount '{m.get('name')}' names no volume of the pod")
        if init:
            return
        ports = c.get("ports") or []
        names = {p.get("name"): p.get("containerPort") for p in ports if p.get("name")}
        numbers = {p.get("containerPort") for p in ports}
        for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
            pr = c.get(probe)
            if not pr:
                self.err(where, f"{probe} is missing")
                continue
            hg = pr.get("httpGet")
            if not hg:
                self.err(where, f"{probe} must be an httpGet probe")
                continue
            if hg.get("path") != path:
                self.err(where, f"{probe} path is {hg.get('path')!r}, expected {path}")
            port = hg.get("port")
            if isinstance(port, str) and not port.isdigit():
                if port not in names:
                    self.err(where, f"{probe} port '{port}' is not a declared containerPort name {sorted(names)}")
                elif port not in HTTP_PORT_NAMES:
                    self.err(where, f"{probe} port '{port}' is not an HTTP port ({sorted(HTTP_PORT_NAMES)})")
            elif int(port) not in numbers:
                self.err(where, f"{probe} port {port} is not a declared containerPort {sorted(numbers)}")
        shm = [m for m in mounts if m.get("mountPath") == "/dev/shm"]
        if not shm:
            self.err(where, "no volumeMount at /dev/shm")
        else:
            v = vols.get(shm[0].get("name")) or {}
            if (v.get("emptyDir") or {}).get("medium") != "Memory":
                self.err(where, f"/dev/shm volume '{shm[0].get('name')}' is not an emptyDir with medium Memory")

    # -- services -------------------------------------------------------------------------------------------------
    def selected_templates(self, selector):
        return [w for w in pod_templates(self.docs)
                if selector_matches(selector, ((w["spec"].get("template") or {}).get("metadata") or {})
                                    .get("labels") or {})]

    def check_services(self):
        for s in self.by_kind.get("Service", []):
            where = f"Service {s['metadata']['name']}"
            spec = s.get("spec") or {}
            sel = spec.get("selector")
            ws = self.selected_templates(sel)
            if not ws:
                self.err(where, f"selector {sel} selects no pod template in the render")
            for p in spec.get("ports") or []:
                tp = p.get("targetPort", p.get("port"))
                for w in ws:
                    ok = False
                    for c, init in containers_of(w):
                        if init:
                            continue
                        for cp in c.get("ports") or []:
                            if (isinstance(tp, str) and not tp.isdigit() and cp.get("name") == tp) or \
                                    (str(tp).isdigit() and cp.get("containerPort") == int(tp)):
                                ok = True
                    if not ok:
                        self.err(where, f"port '{p.get('name')}' targetPort {tp!r} is not a containerPort of "
                                        f"{w['kind']} {w['metadata']['name']}")

    # -- config maps ------------------------------------------------------------------------------------------------
    def configmap(self, name):
        cm = self.get("ConfigMap", name)
        return (cm.get("data") or {}) if cm else None

    # -- container command lines -----------------------------------------------------------------------------------
    def container_env(self, w, c, pod_name, ordinal, with_index_label, where):
        """The container's environment as the kubelet builds it; records errors for bad references."""
        labels = dict(((w["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {})
        if w["kind"] == "StatefulSet":
            labels["statefulset.kubernetes.io/pod-name"] = pod_name
            if with_index_label:
                labels["apps.kubernetes.io/pod-index"] = str(ordinal)
        env, undefined = {}, set()
        for e in c.get("env") or []:
            name = e.get("name")
            if "value" in e and "valueFrom" in e:
                self.err(where, f"env {name}: both value and valueFrom")
            if "valueFrom" in e:
                vf = e["valueFrom"]
                if "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    data = self.configmap(ref.get("name"))
                    if data is None:
                        self.err(where, f"env {name}: ConfigMap '{ref.get('name')}' is not in the render")
                        continue
                    if ref.get("key") not in data:
                        if not ref.get("optional"):
                            self.err(where, f"env {name}: ConfigMap '{ref.get('name')}' has no key "
                                            f"'{ref.get('key')}'")
                        continue
                    env[name] = str(data[ref["key"]])
                elif "fieldRef" in vf:
                    fp = vf["fieldRef"].get("fieldPath", "")
                    m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", fp)
                    if fp == "metadata.name":
                        env[name] = pod_name
                    elif fp == "metadata.namespace":
                        env[name] = w["metadata"].get("namespace", "default")
                    elif m:
                        env[name] = labels.get(m.group(1), "")
                    elif fp in ("status.podIP", "status.hostIP", "spec.nodeName", "spec.serviceAccountName",
                                "metadata.uid"):
                        env[name] = {"status.podIP": "10.244.0.17", "status.hostIP": "10.0.0.4"}.get(fp, "x")
                    else:
                        self.err(where, f"env {name}: fieldRef '{fp}' is not a supported downward API field")
                elif "resourceFieldRef" in vf:
                    rf = vf["resourceFieldRef"]
                    res = rf.get("resource", "")
                    kind, _, r = res.partition(".")
                    val = ((c.get("resources") or {}).get(kind) or {}).get(r)
                    if val is None:
                        self.err(where, f"env {name}: resourceFieldRef {res} but the container sets no {res}")
                        continue
                    try:
                        q = parse_quantity(r, val, where) / parse_quantity(r, rf.get("divisor", "1"), where)
                        env[name] = str(int(math.ceil(q)))
                    except ValueError as ex:
                        self.err(where, str(ex))
                elif "secretKeyRef" in vf:
                    env[name] = "secret"
                else:
                    self.err(where, f"env {name}: unsupported valueFrom {sorted(vf)}")
            else:
                env[name] = expand(e.get("value", ""), env, undefined)
        for ef in c.get("envFrom") or []:
            ref = (ef.get("configMapRef") or {}).get("name")
            data = self.configmap(ref) if ref else None
            if data is None:
                self.err(where, f"envFrom ConfigMap '{ref}' is not in the render")
            else:
                for k, v in data.items():
                    env.setdefault((ef.get("prefix") or "") + k, str(v))
        if undefined:
            self.err(where, f"env values reference undefined variables {sorted(undefined)}")
        return env

    def final_commands(self, w, c, init, where):
        """[(pod_name, ordinal, argv, env)] for every pod of the workload; argv[0] is the binary's basename."""
        cmd = list(c.get("command") or [])
        args = list(c.get("args") or [])
        if not cmd:
            self.err(where, "command is missing (the manifests must name the program they run)")
            return []
        if os.path.basename(cmd[0]) == "tini":
            if init:
                self.err(where, "init containers run their program directly, not through tini")
            if len(cmd) < 2 or cmd[1] != "--":
                self.err(where, "tini must be followed by '--'")
                return []
            cmd = cmd[2:]
        elif not init:
            self.err(where, "main containers must run under /usr/bin/tini (PID 1 ignores SIGTERM otherwise)")
        if not cmd:
            self.err(where, "command names no program after tini")
            return []
        prog = cmd[0]
        img = self.ctx.image
        if img.bin_dir and os.path.dirname(prog) != img.bin_dir:
            self.err(where, f"program {prog} is not in the image's bin dir {img.bin_dir}")
        if img.programs and os.path.basename(prog) not in img.programs:
            self.err(where, f"program {prog} is not installed by the Dockerfiles ({sorted(img.programs)})")
        out = []
        for with_label in (True, False):
            for pod_name, ordinal in pod_names(w):
                env = self.container_env(w, c, pod_name, ordinal, with_label, where)
                undefined = set()
                raw = [expand(a, env, undefined) for a in cmd + args]
                if undefined:
                    self.err(where, f"command/args reference undefined variables {sorted(undefined)} (the kubelet "
                                    "leaves $(VAR) as written)")
                if os.path.basename(prog) == "spade-entrypoint":
                    argv = self.run_entrypoint(raw[1:], env, f"{where} pod {pod_name}")
                    if argv is None:
                        continue
                else:
                    argv = [os.path.basename(prog)] + raw[1:]
                out.append((pod_name, ordinal, with_label, argv, env))
        return out

    def run_entrypoint(self, args, env, where):
        if "SPADE_ENTRYPOINT_DRY_RUN" in env:
            self.err(where, "SPADE_ENTRYPOINT_DRY_RUN must not be set in the manifests")
        penv = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        penv.update(env)
        penv["SPADE_ENTRYPOINT_DRY_RUN"] = "1"
        penv["SPADE_BIN_DIR"] = self.ctx.image.bin_dir or "/opt/spade/bin"
        p = subprocess.run([self.ctx.entrypoint] + args, env=penv, capture_output=True, timeout=60)
        if p.returncode != 0:
            self.err(where, f"spade-entrypoint {' '.join(args[:1])} failed: "
                            f"{p.stderr.decode(errors='replace').strip()}")
            return None
        argv = p.stdout.decode().split("\0")
        if argv and argv[-1] == "":
            argv.pop()
        if not argv:
            self.err(where, "spade-entrypoint printed no command")
            return None
        return [os.path.basename(argv[0])] + argv[1:]

    def quiet(self, fn):
        """Runs fn without recording its errors (they were reported for the first pod)."""
        saved = list(self.errors)
        try:
            return fn()
        finally:
            self.errors = saved

    def check_flags(self, argv, where):
        """Flags of argv against the binary's --help; returns {flag: value or True}."""
        b = self.ctx.binaries.get(argv[0])
        if b is None:
            self.err(where, f"runs '{argv[0]}', which is not one of the checked binaries {sorted(self.ctx.binaries)}")
            return {}
        vals, i = {}, 1
        while i < len(argv):
            a = argv[i]
            if not a.startswith("--"):
                self.err(where, f"argument {a!r} is not a flag ({argv[0]} takes no positional arguments)")
                i += 1
                continue
            flag, eq, inline = a.partition("=")
            if flag not in b.flags:
                self.err(where, f"flag {flag} is not in `{argv[0]} --help`")
                # Take a following non-flag token as its value, so one unknown flag is reported once.
                if eq:
                    vals[flag] = inline
                elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    vals[flag] = argv[i + 1]
                    i += 1
                else:
                    vals[flag] = True
                i += 1
                continue
            if b.flags[flag]:
                if eq:
                    v = inline
                elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    v = argv[i + 1]
                    i += 1
                else:
                    self.err(where, f"flag {flag} takes a value but none follows")
                    v = None
            else:
                if eq:
                    self.err(where, f"flag {flag} is a boolean flag but is given '={inline}'")
                v = True
            if flag in vals:
                self.err(where, f"flag {flag} is given twice")
            vals[flag] = v
            i += 1
        return vals

    def check_env_names(self, c, argv, env_names, where, uses_entrypoint):
        b = self.ctx.binaries.get(argv[0])
        used_in_cmd = set()
        for a in (c.get("command") or []) + (c.get("args") or []):
            used_in_cmd |= refs_in(a)
        for n in env_names:
            if n in used_in_cmd:
                continue
            if b is not None and b.reads_env(n):
                continue
            if uses_entrypoint and n in self.ctx.entry_reads:
                continue
            self.err(where, f"env {n} is read neither by {argv[0]} (source getenv/env(\"...\") in the binary, or a "
                            f"library it links) nor by the entrypoint, and not used in $(...) of the command")

    # -- everything about the programs the pods run ---------------------------------------------------------------
    def check_programs(self):
        world = []        # (rank, binary, workload, pod, with_label, identity flags)
        role_vals = {}    # role -> [flag values of pod 0]
        model_info = {}   # role -> (model dir, workload)
        for w in pod_templates(self.docs):
            pspec = w["spec"]["template"].get("spec") or {}
            vols = {v.get("name"): v for v in pspec.get("volumes") or []}
            writers = []  # (volume name, path) written by init containers
            main = []
            for c, init in containers_of(w):
                where = f"{w['kind']} {w['metadata']['name']} {'initContainer' if init else 'container'} " \
                        f"{c.get('name')}"
                runs = self.final_commands(w, c, init, where)
                if not runs:
                    continue
                uses_ep = "spade-entrypoint" in [os.path.basename(x) for x in (c.get("command") or [])[:3]]
                first = None
                for pod_name, ordinal, with_label, argv, env in runs:
                    pw = f"{where} (pod {pod_name}{'' if with_label else ', no pod-index label'})"
                    if first is None:
                        vals = self.check_flags(argv, where)  # the flags are the same in every pod
                        first = (argv, vals, env)
                        self.check_env_names(c, argv, list(env), where, uses_ep)
                    else:
                        vals = self.quiet(lambda: self.check_flags(argv, where))
                    if not init and argv[0] in ROLE_OF_BINARY:
                        ident = {f: vals.get(f) for f in IDENTITY_FLAGS}
                        try:
                            rank = int(ident["--rank"])
                        except (TypeError, ValueError):
                            self.err(pw, f"final command has no numeric --rank: {argv}")
                            continue
                        world.append((rank, argv[0], w, pod_name, with_label, ident, ordinal))
                if first is None:
                    continue
                argv, vals, env = first
                if init:
                    if "--out" in vals and isinstance(vals["--out"], str):
                        for m in c.get("volumeMounts") or []:
                            mp = m.get("mountPath", "").rstrip("/")
                            if vals["--out"] == mp or vals["--out"].startswith(mp + "/"):
                                if m.get("readOnly"):
                                    self.err(where, f"writes {vals['--out']} through a read-only mount")
                                writers.append((m.get("name"), vals["--out"]))
                    continue
                main.append((c, argv, vals, where))
                role = ROLE_OF_BINARY.get(argv[0])
                if role is None:
                    self.err(where, f"main container runs {argv[0]}, not coordinator/inference_rank/cache_rank")
                    continue
                role_vals.setdefault(role, []).append((vals, where, w, c, env))
                self.check_ports(c, argv[0], vals, where)
                self.check_annotations(w, c, where)
                self.check_startup_budget(c, vals, where)
                if role == "inference" and vals.get("--serve") is not True:
                    self.err(where, "inference_rank must run with --serve (a cluster rank)")
                if role == "coordinator" and w["kind"] == "Deployment":
                    if w["spec"].get("replicas", 1) != 1:
                        self.err(where, "the coordinator must run as exactly one replica")
                    if (w["spec"].get("strategy") or {}).get("type") != "Recreate":
                        self.err(where, "the coordinator Deployment must use strategy Recreate (a rolling update "
                                        "would run two coordinators)")
            for c, argv, vals, where in main:
                model = vals.get("--model")
                if not isinstance(model, str):
                    if argv[0] in ("coordinator", "inference_rank", "cache_rank"):
                        self.err(where, f"{argv[0]} is given no --model")
                    continue
                mount = None
                for m in c.get("volumeMounts") or []:
                    mp = m.get("mountPath", "").rstrip("/")
                    if model == mp or model.startswith(mp + "/"):
                        mount = m
                if not mount:
                    self.err(where, f"--model {model} is on no volume mount (the image has no checkpoint)")
                    continue
                v = vols.get(mount.get("name")) or {}
                if "emptyDir" in v and not any(n == mount.get("name") and p == model for n, p in writers):
                    self.err(where, f"--model {model} is on emptyDir '{mount.get('name')}' but no init container "
                                    "writes that directory")
                model_info.setdefault(ROLE_OF_BINARY.get(argv[0]), []).append((model, where))
        self.check_world(world)
        self.check_pairs(role_vals)
        self.check_refused(role_vals)
        self.check_master(role_vals)
        self.check_cluster_secret(role_vals)
        self.check_gpu(role_vals)

    def check_ports(self, c, binary, vals, where):
        ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
        served = set()
        for flag, pname in PORT_FLAGS.get(binary, {}).items():
            v = vals.get(flag)
            if v is None:
                self.err(where, f"{binary} is not given {flag} (containerPort '{pname}')")
                continue
            served.add(pname)
            if pname not in ports:
                self.err(where, f"{flag} {v} has no containerPort named '{pname}'")
            elif str(ports[pname]) != str(v):
                self.err(where, f"{flag} {v} != containerPort '{pname}' {ports[pname]}")
        for pname in ports:
            if pname not in served:
                self.err(where, f"containerPort '{pname}' is served by no flag of {binary}")

    def check_annotations(self, w, c, where):
        ann = (w["spec"]["template"].get("metadata") or {}).get("annotations") or {}
        if ann.get("prometheus.io/scrape") != "true":
            self.err(where, "pod template lacks annotation prometheus.io/scrape: \"true\"")
            return
        port = ann.get("prometheus.io/port")
        http = {str(p.get("containerPort")) for p in c.get("ports") or [] if p.get("name") in HTTP_PORT_NAMES}
        if port not in http:
            self.err(where, f"annotation prometheus.io/port {port!r} is not the port serving /metrics {sorted(http)}")
        if ann.get("prometheus.io/path", "/metrics") != "/metrics":
            self.err(where, f"annotation prometheus.io/path {ann.get('prometheus.io/path')!r} is not /metrics")

    def check_startup_budget(self, c, vals, where):
        sp = c.get("startupProbe") or {}
        try:
            rdv_ms = int(vals.get("--rendezvous-timeout-ms"))
        except (TypeError, ValueError):
            self.err(where, "no numeric --rendezvous-timeout-ms (the startup probe budget is checked against it)")
            return
        budget = sp.get("initialDelaySeconds", 0) + sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        if budget * 1000 <= rdv_ms:
            self.err(where, f"startupProbe allows {budget} s, not more than --rendezvous-timeout-ms {rdv_ms}: the "
                            "kubelet would kill a rank that is still legitimately waiting for the world")

    def check_world(self, world):
        if not world:
            self.err("world", "no coordinator/inference/cache process found")
            return
        for with_label in (True, False):
            entries = [x for x in world if x[4] == with_label]
            how = "pod-index label" if with_label else "pod name only"
            idents = {tuple(sorted((k, str(v)) for k, v in x[5].items() if k != "--rank")) for x in entries}
            if len(idents) != 1:
                self.err("world", f"processes disagree on --world-size/--num-inference/--num-cache ({how}): "
                                  f"{sorted(idents)}")
                continue
            ident = entries[0][5]
            try:
                W, N, M = int(ident["--world-size"]), int(ident["--num-inference"]), int(ident["--num-cache"])
            except (TypeError, ValueError):
                self.err("world", f"identity flags missing or not numeric: {ident}")
                continue
            if W != 1 + N + M or N < 1 or M < 1 or M % N != 0:
                self.err("world", f"world size {W} != 1 + {N} inference + {M} cache, or the cache ranks are not a "
                                  "multiple of the inference ranks")
            ranks = sorted(x[0] for x in entries)
            if ranks != list(range(W)):
                self.err("world", f"ranks of the pods ({how}) are {ranks}, expected 0..{W - 1} once each: check "
                                  "the StatefulSet replicas against SPADE_NUM_PAIRS / SPADE_NUM_CACHE")
            for rank, binary, w, pod, _, _, ordinal in entries:
                want = "coordinator" if rank == 0 else "inference_rank" if rank <= N else "cache_rank"
                if binary != want:
                    self.err("world", f"pod {pod} got rank {rank}, which the default role map gives to {want}, "
                                      f"but runs {binary}")
            for w in pod_templates(self.docs):
                if w["kind"] == "StatefulSet":
                    reps = w["spec"].get("replicas")
                    is_cache = "cache" in w["metadata"]["name"]
                    want, key = (M, "SPADE_NUM_CACHE") if is_cache else (N, "SPADE_NUM_PAIRS")
                    if reps != want:
                        self.err(f"StatefulSet {w['metadata']['name']}",
                                 f"replicas {reps} != the {want} {'cache' if is_cache else 'inference'} ranks the "
                                 f"ranks were given ({key})")

    def check_pairs(self, role_vals):
        inf, cache = role_vals.get("inference", []), role_vals.get("cache", [])
        if not inf or not cache:
            self.err("world", "needs an inference and a cache workload")
            return
        vi, wi = inf[0][0], inf[0][1]
        vc, wc = cache[0][0], cache[0][1]
        for f in SHARED_SELECTION_FLAGS["cuda" if self.is_gpu else "cpu"]:
            a, b = vi.get(f), vc.get(f)
            if a is None or b is None:
                self.err("pairing", f"{f} must be given to both ranks explicitly ({wi}: {a}, {wc}: {b})")
            elif str(a) != str(b):
                self.err("pairing", f"{f} differs: inference {a} vs cache {b} (they must match)")

    def check_master(self, role_vals):
        coord = role_vals.get("coordinator", [])
        if len(coord) != 1:
            self.err("world", f"expected one coordinator container, found {len(coord)}")
            return
        cvals, cwhere, cw, cc, _ = coord[0]
        ctl = {p.get("name"): p.get("containerPort") for p in cc.get("ports") or []}.get("control")
        for role in ("inference", "cache"):
            for vals, where, w, c, env in role_vals.get(role, []):
                addr = vals.get("--master-addr") or env.get("MASTER_ADDR")
                port = vals.get("--master-port") or env.get("MASTER_PORT")
                if not addr or not port:
                    self.err(where, "MASTER_ADDR and MASTER_PORT (or --master-addr/--master-port) must be set")
                    continue
                if str(port) != str(cvals.get("--port")):
                    self.err(where, f"MASTER_PORT {port} != coordinator --port {cvals.get('--port')}")
                name = str(addr).split(".")[0]
                svc = self.get("Service", name)
                ns = w["metadata"].get("namespace", "default")
                ok_forms = {name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"}
                if not svc or str(addr) not in ok_forms:
                    self.err(where, f"MASTER_ADDR {addr} is not the DNS name of a Service in the render")
                    continue
                sspec = svc.get("spec") or {}
                if not sspec.get("publishNotReadyAddresses"):
                    self.err(where, f"Service {name} (MASTER_ADDR) must set publishNotReadyAddresses: the "
                                    "coordinator is not Ready until the ranks have registered through it")
                if cw not in self.selected_templates(sspec.get("selector")):
                    self.err(where, f"Service {name} (MASTER_ADDR) does not select the coordinator pods")
                sp = [p for p in sspec.get("ports") or [] if str(p.get("port")) == str(port)]
                if not sp:
                    self.err(where, f"Service {name} has no port {port} (MASTER_PORT)")
                else:
                    tp = sp[0].get("targetPort", sp[0].get("port"))
                    if tp != "control" and str(tp) != str(ctl):
                        self.err(where, f"Service {name} port {port} targets {tp!r}, not the coordinator's control "
                                        f"port ({ctl})")

    def check_cluster_secret(self, role_vals):
        """Every Spade process reads the same cluster secret, from a file on a Secret volume of a Secret in the
        render that no other user may read (the binaries refuse such a file); the coordinator's control port and
        HTTP API listen beyond loopback (ranks, clients and probes come from other network namespaces)."""
        used = {}
        for role in ("coordinator", "inference", "cache"):
            for vals, where, w, c, env in role_vals.get(role, []):
                path = vals.get("--cluster-secret-file") or env.get("SPADE_CLUSTER_SECRET_FILE")
                if not isinstance(path, str) or not path:
                    self.err(where, "does not get the cluster secret (SPADE_CLUSTER_SECRET_FILE or "
                                    "--cluster-secret-file on a Secret volume): the coordinator would refuse it")
                    continue
                mounts = [m for m in c.get("volumeMounts") or []
                          if path.startswith(m.get("mountPath", "").rstrip("/") + "/")]
                if not mounts:
                    self.err(where, f"cluster secret file {path} is on no volume mount")
                    continue
                m = max(mounts, key=lambda x: len(x.get("mountPath", "")))
                vols = {v.get("name"): v for v in (w["spec"]["template"].get("spec") or {}).get("volumes") or []}
                sec = (vols.get(m.get("name")) or {}).get("secret")
                if not sec:
                    self.err(where, f"cluster secret file {path} is on volume '{m.get('name')}', which is not a "
                                    "Secret volume")
                    continue
                rel = path[len(m["mountPath"].rstrip("/")) + 1:]
                key, mode = rel, sec.get("defaultMode", 0o644)
                if sec.get("items"):
                    item = [i for i in sec["items"] if i.get("path") == rel]
                    if not item:
                        self.err(where, f"cluster secret file {path}: Secret volume '{m.get('name')}' projects no "
                                        f"item to {rel}")
                        continue
                    key, mode = item[0].get("key"), item[0].get("mode", mode)
                obj = self.get("Secret", sec.get("secretName"))
                if obj is None:
                    self.err(where, f"cluster secret: Secret '{sec.get('secretName')}' is not in the render")
                    continue
                if key not in (obj.get("data") or {}) and key not in (obj.get("stringData") or {}):
                    self.err(where, f"cluster secret: Secret '{sec.get('secretName')}' has no key '{key}'")
                if not isinstance(mode, int) or mode & 0o007:
                    self.err(where, f"cluster secret file {path} has mode {mode:04o}, readable by every user: the "
                                    "binaries refuse it (set the Secret volume's defaultMode to 0400 or 0440)")
                used[where] = (sec.get("secretName"), key)
        if len(set(used.values())) > 1:
            self.err("world", f"the processes read the cluster secret from different Secrets or keys "
                              f"{sorted(set(used.values()))}: they could not authenticate each other")
        for vals, where, w, c, env in role_vals.get("coordinator", []):
            for flag, what in (("--host", "the control port (the ranks connect through a Service)"),
                               ("--http-host", "the HTTP API (the Service and the kubelet's probes)")):
                host = vals.get(flag)
                if not isinstance(host, str) or host.startswith("127.") or host in ("localhost", "::1"):
                    self.err(where, f"{flag} {host or '(default 127.0.0.1)'}: {what} would listen on loopback, "
                                    "out of reach from other pods")

    def check_refused(self, role_vals):
        """A rank is given no flag that its device refuses (the pod would exit at start naming it)."""
        for role, binary in (("inference", "inference_rank"), ("cache", "cache_rank")):
            for vals, where, w, c, env in role_vals.get(role, []):
                device = "cuda" if str(vals.get("--device", "cpu")) == "cuda" else "cpu"
                for f in REFUSED_FLAGS[(binary, device)]:
                    if f in vals:
                        self.err(where, f"{f} is refused by {binary} --device {device} (it would ignore it); "
                                        "leave it out of this device's flags")
                if binary == "inference_rank" and device == "cuda" and str(vals.get("--sink-tokens", "0")) != "0":
                    self.err(where, f"--sink-tokens {vals['--sink-tokens']} is refused by inference_rank --device "
                                    "cuda (the GPU path has no sink tokens of its own): use 0")

    def check_gpu(self, role_vals):
        images = set()
        for w in pod_templates(self.docs):
            for c, init in containers_of(w):
                images.add(c.get("image"))
                where = f"{w['kind']} {w['metadata']['name']} container {c.get('name')}"
                res = c.get("resources") or {}
                req = (res.get("requests") or {}).get("nvidia.com/gpu")
                lim = (res.get("limits") or {}).get("nvidia.com/gpu")
                if not self.is_gpu:
                    if req is not None or lim is not None:
                        self.err(where, "a CPU overlay must not request nvidia.com/gpu")
                    continue
        want_device = "cuda" if self.is_gpu else "cpu"
        for role in ("inference", "cache"):
            for vals, where, w, c, env in role_vals.get(role, []):
                if str(vals.get("--device", "cpu")) != want_device:
                    self.err(where, f"--device {vals.get('--device', 'cpu (default)')}: a "
                                    f"{'GPU' if self.is_gpu else 'CPU'} overlay runs its ranks with --device "
                                    f"{want_device}")
        if self.is_gpu:
            for role in ("inference", "cache"):
                for vals, where, w, c, env in role_vals.get(role, []):
                    res = c.get("resources") or {}
                    lim = (res.get("limits") or {}).get("nvidia.com/gpu")
                    req = (res.get("requests") or {}).get("nvidia.com/gpu")
                    if lim is None or not str(lim).isdigit() or int(lim) < 1:
                        self.err(where, "a GPU overlay must set resources.limits nvidia.com/gpu >= 1")
                    elif req is not None and str(req) != str(lim):
                        self.err(where, f"nvidia.com/gpu requests {req} != limits {lim}")
            for vals, where, w, c, env in role_vals.get("coordinator", []):
                if "nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {}):
                    self.err(where, "the coordinator needs no GPU")
        want = "-cuda" if self.is_gpu else "-cpu"
        if len(images) != 1:
            self.err("images", f"all containers must run the same image, found {sorted(map(str, images))}")
        for im in images:
            if not str(im).endswith(want):
                self.err("images", f"image {im} should be the {want[1:]} image (tag ending in {want})")

    # -- config usage ---------------------------------------------------------------------------------------------
    def check_config_usage(self):
        used = {}
        for w in pod_templates(self.docs):
            for c, _ in containers_of(w):
                for e in c.get("env") or []:
                    ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                    if ref:
                        used.setdefault(ref.get("name"), set()).add(ref.get("key"))
                for ef in c.get("envFrom") or []:
                    ref = (ef.get("configMapRef") or {}).get("name")
                    if ref and self.configmap(ref) is not None:
                        used.setdefault(ref, set()).update(self.configmap(ref))
        for cm in self.by_kind.get("ConfigMap", []):
            name = cm["metadata"]["name"]
            for k in sorted(set(cm.get("data") or {}) - used.get(name, set())):
                self.err(f"ConfigMap {name}", f"key {k} is used by no container (a setting that does nothing)")

    # -- PodMonitor -------------------------------------------------------------------------------------------------
    def check_podmonitors(self):
        for pm in self.by_kind.get("PodMonitor", []):
            where = f"PodMonitor {pm['metadata']['name']}"
            if pm.get("apiVersion") != "monitoring.coreos.com/v1":
                self.err(where, f"apiVersion {pm.get('apiVersion')} is not monitoring.coreos.com/v1")
            spec = pm.get("spec") or {}
            ws = self.selected_templates(spec.get("selector"))
            if not ws:
                self.err(where, "selector selects no Spade pod template")
            scraped = {w["metadata"]["name"] for w in pod_templates(self.docs)
                       if ((w["spec"]["template"].get("metadata") or {}).get("annotations") or {})
                       .get("prometheus.io/scrape") == "true"}
            covered = set()
            for ep in spec.get("podMetricsEndpoints") or []:
                port = ep.get("port")
                hit = [w for w in ws if any(p.get("name") == port for c, init in containers_of(w) if not init
                                            for p in c.get("ports") or [])]
                if not hit:
                    self.err(where, f"podMetricsEndpoint port '{port}' is a containerPort of no selected pod")
                if ep.get("path", "/metrics") != "/metrics":
                    self.err(where, f"podMetricsEndpoint path {ep.get('path')!r} is not /metrics")
                covered |= {w["metadata"]["name"] for w in hit}
            for n in sorted(scraped - covered):
                self.err(where, f"does not scrape {n}, whose pods serve /metrics")

    def run(self):
        self.check_objects()
        self.check_workloads()
        self.check_services()
        self.check_programs()
        self.check_config_usage()
        self.check_podmonitors()
        return list(dict.fromkeys(self.errors))  # each distinct problem once, in order
