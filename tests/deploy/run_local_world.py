#!/usr/bin/env python3
"""Runs the pods of a rendered overlay (default: deploy/k8s/overlays/cpu) as local processes, the way the kubelet
would, and checks that they work: the real entrypoint and binaries, the probes the manifests declare, the OpenAI API
behind the coordinator Service, and the /metrics the dashboard reads.

    run_local_world.py --source-dir DIR --kubectl PATH --promtool PATH --coordinator BIN --inference-rank BIN
                       --cache-rank BIN --make-demo-checkpoint BIN [--overlay cpu] [--pairs N] [--keep]

Per pod (every replica of every Deployment/StatefulSet): its volumes are fresh directories (a Secret volume holds
the rendered Secret's items with their modes, as the kubelet projects them; paths under a volumeMount's mountPath in
command/args and env values are rewritten to them), each containerPort gets a free local port (the binaries' port
flags are rewritten to it, and their listen addresses to 127.0.0.1: pods have their own IPs in a cluster, here they
share 127.0.0.1), and MASTER_ADDR / MASTER_PORT point at the coordinator's control port. The environment is built from the manifest
(ConfigMap keys, downward API, resource fields) exactly as check_k8s.py resolves it, and the containers' command
lines run unchanged otherwise: init containers to completion, then the main containers through
deploy/docker/spade-entrypoint.sh (SPADE_BIN_DIR = the built binaries).

Then: every pod's startupProbe must pass within its budget (capped by --startup-timeout), then its readinessProbe
and livenessProbe; GET /v1/models lists the served model name; POST /v1/completions (a prompt longer than the
sparse threshold, so decoding goes sparse) and /v1/chat/completions return choices; every pod's /metrics (the
prometheus.io/port and path annotations) passes `promtool check metrics`, together they contain every metric of the
dashboard list with its type (check_dashboard.py), the coordinator reports ranks 1..2N up, and the counters moved
(tokens generated, bytes sent and received on the data plane, layer packs selected). Finally SIGTERM (as on pod
deletion) must stop every process within terminationGracePeriodSeconds, and no process may have used more memory
than its container's limits.memory.
Exit status: 0 ok, 1 failure (the rank logs are printed), 2 usage.
"""
import argparse
import base64
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_dashboard as cd  # noqa: E402
import check_k8s as ck  # noqa: E402

ROLE_BINARY = {"coordinator": "coordinator", "inference": "inference_rank", "cache": "cache_rank"}
# Listen-address flags, rewritten to 127.0.0.1 (the pods' own addresses in a cluster).
LISTEN_FLAGS = {"coordinator": ["--host", "--http-host"], "inference_rank": ["--metrics-host"],
                "cache_rank": ["--metrics-host"]}


class Failure(Exception):
    pass


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def child_setup():
    """In each started process: its own process group (killed as a whole), and SIGKILL when this script dies,
    whatever kills it (a ctest timeout included), so no rank outlives the test."""
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http(method, port, path, body=None, timeout=10):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return None, str(e)


class Pod:
    def __init__(self, w, name, ordinal, root, oc):
        self.w, self.name, self.ordinal, self.oc = w, name, ordinal, oc
        self.spec = w["spec"]["template"]["spec"]
        self.dir = os.path.join(root, "pods", name)
        self.mounts = {}  # container name -> [(mountPath, host dir)]
        vols = {}
        for v in self.spec.get("volumes") or []:
            vols[v["name"]] = os.path.join(self.dir, "volumes", v["name"])
            os.makedirs(vols[v["name"]], exist_ok=True)
            if "secret" in v:
                self.project_secret(v["secret"], vols[v["name"]])
        for c, _ in ck.containers_of(w):
            self.mounts[c["name"]] = sorted(((m["mountPath"].rstrip("/"), vols[m["name"]])
                                             for m in c.get("volumeMounts") or [] if m.get("name") in vols),
                                            key=lambda x: -len(x[0]))
        self.main = self.spec["containers"][0]
        self.ports = {}  # name and number -> local port
        for p in self.main.get("ports") or []:
            local = free_port()
            self.ports[p.get("name")] = local
            self.ports[p["containerPort"]] = local
            self.ports[str(p["containerPort"])] = local
        self.proc = None
        self.log = os.path.join(root, "logs", f"{name}.log")

    def project_secret(self, sec, host_dir):
        """Writes the items of the rendered Secret into host_dir with their modes, as the kubelet does."""
        obj = self.oc.get("Secret", sec.get("secretName"))
        if obj is None:
            raise Failure(f"{self.name}: Secret '{sec.get('secretName')}' is not in the render")
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
        items = sec.get("items") or [{"key": k, "path": k} for k in data]
        for it in items:
            if it["key"] not in data:
                raise Failure(f"{self.name}: Secret '{sec.get('secretName')}' has no key '{it['key']}'")
            dest = os.path.join(host_dir, it["path"])
            with open(dest, "wb") as f:
                f.write(data[it["key"]])
            os.chmod(dest, it.get("mode", sec.get("defaultMode", 0o644)))

    def path(self, cname, s):
        for mp, host in self.mounts.get(cname, []):
            if s == mp or s.startswith(mp + "/"):
                return host + s[len(mp):]
        return s


def build_world(a, ctx, docs, label, root):
    oc = ck.OverlayCheck(label, docs, "gpu" in label, ctx)
    pods = []
    for w in ck.pod_templates(docs):
        for name, ordinal in ck.pod_names(w):
            pods.append(Pod(w, name, ordinal, root, oc))
    coord = [p for p in pods if "coordinator" in (p.main.get("command") or [])]
    if len(coord) != 1:
        raise Failure(f"expected one coordinator pod, found {[p.name for p in coord]}")
    return pods, coord[0]


def command_of(pod, c, env_over, bin_dir):
    """argv (with volume paths and ports rewritten) and env for container c of pod."""
    env = pod.oc.container_env(pod.w, c, pod.name, pod.ordinal, True, f"{pod.name}/{c['name']}")
    env.update({k: v for k, v in env_over.items() if k in env})
    undefined = set()
    raw = [ck.expand(x, env, undefined) for x in (c.get("command") or []) + (c.get("args") or [])]
    if undefined:
        raise Failure(f"{pod.name}/{c['name']}: undefined variables {sorted(undefined)}")
    if os.path.basename(raw[0]) == "tini":
        raw = raw[2:]
    prog = os.path.basename(raw[0])
    argv = [os.path.join(bin_dir, prog)] + [pod.path(c["name"], x) for x in raw[1:]]
    if prog == "spade-entrypoint":
        binary = ROLE_BINARY.get(argv[1])
        for flag, pname in ck.PORT_FLAGS.get(binary, {}).items():
            if flag in argv:
                i = argv.index(flag)
                argv[i + 1] = str(pod.ports[pname])
        for flag in LISTEN_FLAGS.get(binary, []):
            if flag in argv:
                argv[argv.index(flag) + 1] = "127.0.0.1"
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SPADE_BIN_DIR": bin_dir,
                "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "error")}
    full_env.update({k: pod.path(c["name"], v) for k, v in env.items()})  # e.g. SPADE_CLUSTER_SECRET_FILE
    return argv, full_env


def wait_probe(pod, probe_name, deadline):
    pr = pod.main.get(probe_name) or {}
    hg = pr.get("httpGet") or {}
    port = pod.ports.get(hg.get("port"))
    if port is None:
        raise Failure(f"{pod.name}: {probe_name} port {hg.get('port')!r} has no local port")
    last = None
    while True:
        if pod.proc.poll() is not None:
            raise Failure(f"{pod.name} exited with status {pod.proc.returncode} while waiting for its {probe_name}")
        code, body = http("GET", port, hg.get("path", "/"), timeout=pr.get("timeoutSeconds", 1))
        if code is not None and 200 <= code < 400:
            return
        last = (code, body[:200])
        if time.time() > deadline:
            raise Failure(f"{pod.name}: {probe_name} GET {hg.get('path')} on port {hg.get('port')} did not succeed "
                          f"in time (last: {last})")
        time.sleep(0.5)


def metrics_value(text, name, labels=None):
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels and any(lab.get(k) != v for k, v in labels.items()):
            continue
        total += float(m.group(3))
        found = True
    return total if found else None


def run(a):
    ctx = ck.build_ctx(a)
    root = tempfile.mkdtemp(prefix="spade-local-world-")
    os.makedirs(os.path.join(root, "logs"))
    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir)
    for name, b in ctx.binaries.items():
        os.symlink(os.path.abspath(b.path), os.path.join(bin_dir, name))
    os.symlink(ctx.entrypoint, os.path.join(bin_dir, "spade-entrypoint"))
    pods = []
    try:
        k8s = ck.copy_k8s(ctx.source_dir, os.path.join(root, "k8s"))
        if a.pairs:
            # Scale the way docs/DEPLOY.md says: a configMapGenerator merge of SPADE_NUM_PAIRS and SPADE_NUM_CACHE.
            with open(os.path.join(k8s, "overlays", a.overlay, "kustomization.yaml"), "a") as f:
                f.write("configMapGenerator:\n  - name: spade-config\n    behavior: merge\n"
                        f"    literals: [SPADE_NUM_PAIRS={a.pairs}, SPADE_NUM_CACHE={a.pairs}]\n")
        renders = ck.render_all(a.kubectl, k8s)
        match = [r for r in renders if r[0] == a.overlay]
        if not match:
            raise Failure(f"no overlay '{a.overlay}' ({[r[0] for r in renders]})")
        label, docs, _ = match[0]
        pods, coord = build_world(a, ctx, docs, label, root)
        over = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(coord.ports["control"])}
        # Init containers, then the main containers of every pod.
        for p in pods:
            for c in p.spec.get("initContainers") or []:
                argv, env = command_of(p, c, over, bin_dir)
                r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300,
                                   preexec_fn=child_setup)
                if r.returncode != 0:
                    raise Failure(f"{p.name} init container {c['name']} exited {r.returncode}: {r.stderr.strip()}")
        t0 = time.time()
        for p in pods:
            argv, env = command_of(p, p.main, over, bin_dir)
            with open(p.log, "w") as log:
                log.write("$ " + " ".join(argv) + "\n")
                log.flush()
                p.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=child_setup)
        print(f"started {len(pods)} pods: " + ", ".join(p.name for p in pods))
        for p in pods:
            sp = p.main.get("startupProbe") or {}
            budget = sp.get("initialDelaySeconds", 0) + sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
            wait_probe(p, "startupProbe", t0 + min(budget, a.startup_timeout))
        print(f"startup probes passed after {time.time() - t0:.1f} s")
        for p in pods:
            for probe in ("readinessProbe", "livenessProbe"):
                wait_probe(p, probe, time.time() + 10)
        print("readiness and liveness probes pass on every pod")
        # The API, through the port the coordinator Service targets.
        svc = ck.find(docs, "Service", "spade-coordinator")
        api = coord.ports[svc["spec"]["ports"][0]["targetPort"]]
        served = coord.oc.container_env(coord.w, coord.main, coord.name, None, True, "coordinator") \
            .get("SPADE_SERVED_MODEL_NAME")
        code, body = http("GET", api, "/v1/models")
        if code != 200 or served not in [m.get("id") for m in json.loads(body).get("data", [])]:
            raise Failure(f"GET /v1/models: {code} {body[:300]} (expected the served model name {served!r})")
        prompt = "Once upon a time, in a land far away, " * 12
        code, body = http("POST", api, "/v1/completions",
                          {"model": served, "prompt": prompt, "max_tokens": 48, "temperature": 0}, timeout=300)
        if code != 200:
            raise Failure(f"POST /v1/completions: {code} {body[:300]}")
        resp = json.loads(body)
        if not isinstance(resp.get("choices", [{}])[0].get("text"), str):
            raise Failure(f"POST /v1/completions: no choices[0].text in {body[:300]}")
        code, body = http("POST", api, "/v1/chat/completions",
                          {"model": served, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16},
                          timeout=300)
        if code != 200 or "choices" not in json.loads(body):
            raise Failure(f"POST /v1/chat/completions: {code} {body[:300]}")
        print(f"API: /v1/models lists {served}; /v1/completions and /v1/chat/completions answered")
        # /metrics of every pod, where the annotations say.
        dumps = []
        for p in pods:
            ann = (p.w["spec"]["template"].get("metadata") or {}).get("annotations") or {}
            port = p.ports.get(ann.get("prometheus.io/port"))
            if port is None:
                raise Failure(f"{p.name}: annotation prometheus.io/port {ann.get('prometheus.io/port')!r} is not a "
                              "containerPort of the pod (Prometheus would scrape nothing)")
            code, body = http("GET", port, ann.get("prometheus.io/path", "/metrics"))
            if code != 200:
                raise Failure(f"{p.name}: GET {ann.get('prometheus.io/path')} on {ann.get('prometheus.io/port')}: "
                              f"{code} {body[:200]}")
            path = os.path.join(root, f"{p.name}.prom")
            with open(path, "w") as f:
                f.write(body)
            dumps.append((f"{p.name} /metrics", body))
        errs = cd.check_dumps(dumps, set(cd.METRICS), a.promtool)
        coord_dump = dumps[pods.index(coord)][1]
        world = 1 + int(over_num_pairs(coord)) + int(over_num_cache(coord))
        for r in range(1, world):  # the coordinator reports the ranks that register with it
            if metrics_value(coord_dump, "spade_rank_up", {"rank": str(r)}) != 1:
                errs.append(f"coordinator: spade_rank_up{{rank=\"{r}\"}} is not 1")
        everything = "\n".join(d for _, d in dumps)
        for name, labels in [("spade_generation_tokens_total", None), ("spade_prompt_tokens_total", None),
                             ("spade_time_to_first_token_seconds_count", None),
                             ("spade_transfer_bytes_total", {"direction": "send"}),
                             ("spade_transfer_bytes_total", {"direction": "recv"}),
                             ("spade_selection_time_seconds_count", None)]:
            v = metrics_value(everything, name, labels)
            if not v:
                errs.append(f"metrics: {name}{labels or ''} is {v} after two requests (expected > 0)")
        if errs:
            raise Failure("metrics:\n  " + "\n  ".join(errs))
        print(f"metrics: {len(dumps)} /metrics outputs pass promtool and contain all {len(cd.METRICS)} metrics")
        # A pod restart (docs/DEPLOY.md, "Failures and restarts"): SIGKILL cache pod 0, start its container again with
        # the same command and environment (same ordinal, so the same index and rank); the coordinator admits it as a
        # replacement, the pair re-handshakes and sparse decoding resumes on the new process.
        cache0 = next(p for p in pods if p.name.startswith("spade-cache-") and p.ordinal == 0)
        os.killpg(cache0.proc.pid, signal.SIGKILL)
        cache0.proc.wait()
        t_kill = time.time()
        while True:  # the coordinator reports the dead rank (readiness stays 200: degraded)
            code, body = http("GET", api, "/ready")
            if code == 200 and "degraded" in body:
                break
            if time.time() > t_kill + 30:
                raise Failure(f"coordinator /ready after killing {cache0.name}: {code} {body[:300]} (expected degraded)")
            time.sleep(0.2)
        argv, env = command_of(cache0, cache0.main, over, bin_dir)
        with open(cache0.log, "a") as log:
            log.write("$ (restart) " + " ".join(argv) + "\n")
            log.flush()
            cache0.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_setup)
        sp = cache0.main.get("startupProbe") or {}
        wait_probe(cache0, "startupProbe",
                   time.time() + min(sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3), a.startup_timeout))
        while True:  # whole again: plain 200 "ready"
            code, body = http("GET", api, "/ready")
            if code == 200 and "degraded" not in body:
                break
            if time.time() > t_kill + 60:
                raise Failure(f"coordinator /ready after restarting {cache0.name}: {code} {body[:300]} (still degraded)")
            time.sleep(0.2)
        for _ in range(int(over_num_pairs(coord))):  # round robin: one request reaches every pair
            code, body = http("POST", api, "/v1/completions",
                              {"model": served, "prompt": prompt, "max_tokens": 48, "temperature": 0}, timeout=300)
            if code != 200:
                raise Failure(f"POST /v1/completions after the restart of {cache0.name}: {code} {body[:300]}")
        ann = (cache0.w["spec"]["template"].get("metadata") or {}).get("annotations") or {}
        code, body = http("GET", cache0.ports.get(ann.get("prometheus.io/port")), "/metrics")
        updates = metrics_value(body, "spade_cache_pack_updates_total") if code == 200 else None
        if not updates:
            raise Failure(f"{cache0.name} after its restart: spade_cache_pack_updates_total is {updates} after a "
                          "request past the sparse threshold per pair (sparse decoding did not resume)")
        print(f"pod restart: {cache0.name} killed, restarted with the same environment, rejoined "
              f"({time.time() - t_kill:.1f} s); the next request decoded sparsely ({updates:.0f} pack updates)")
        # Peak memory of every process against its container's memory limit (the kubelet would OOM-kill it).
        peaks = []
        for p in pods:
            hwm = None
            try:
                with open(f"/proc/{p.proc.pid}/status") as f:
                    m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
                    hwm = int(m.group(1)) * 1024 if m else None
            except OSError:
                pass
            limit = ((p.main.get("resources") or {}).get("limits") or {}).get("memory")
            if hwm is None or limit is None:
                raise Failure(f"{p.name}: cannot compare peak memory {hwm} with limits.memory {limit}")
            lim = ck.parse_mem(limit, p.name)
            peaks.append(f"{p.name} {hwm / 2**20:.0f} MiB of {limit}")
            if hwm > lim:
                raise Failure(f"{p.name}: peak resident memory {hwm / 2**20:.0f} MiB exceeds limits.memory {limit}")
        print("peak memory: " + ", ".join(peaks))
        # Pod deletion: SIGTERM, then the grace period.
        for p in pods:
            os.killpg(p.proc.pid, signal.SIGTERM)
        for p in pods:
            grace = p.spec.get("terminationGracePeriodSeconds", 30)
            try:
                p.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                raise Failure(f"{p.name} did not exit within terminationGracePeriodSeconds={grace} after SIGTERM")
        print("SIGTERM stopped every process within its grace period")
        return 0
    finally:
        for p in pods:
            if p.proc and p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.proc.wait()
        if sys.exc_info()[0] is not None:
            for p in pods:
                if os.path.exists(p.log):
                    print(f"----- {p.name} (last lines) -----", file=sys.stderr)
                    with open(p.log, errors="replace") as f:
                        print("".join(f.readlines()[-25:]), file=sys.stderr)
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def over_num_pairs(coord):
    env = coord.oc.container_env(coord.w, coord.main, coord.name, None, True, "coordinator")
    return env.get("SPADE_NUM_PAIRS", "0")


def over_num_cache(coord):
    env = coord.oc.container_env(coord.w, coord.main, coord.name, None, True, "coordinator")
    return env.get("SPADE_NUM_CACHE", over_num_pairs(coord))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--inference-rank", required=True)
    ap.add_argument("--cache-rank", required=True)
    ap.add_argument("--make-demo-checkpoint", required=True)
    ap.add_argument("--overlay", default="cpu", help="overlay to run (must not need a GPU or a claim)")
    ap.add_argument("--pairs", type=int, default=0, help="scale the overlay to this many pairs first (0: as is)")
    ap.add_argument("--startup-timeout", type=float, default=180, help="cap on the startup probe budget (s)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, volumes, dumps)")
    a = ap.parse_args()
    # SIGTERM/SIGHUP (ctest, a closed terminal) unwind like an error, so the processes are stopped and logs shown.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: (_ for _ in ()).throw(Failure(f"interrupted by signal {signum}")))
    try:
        ck.kustomize_version(a.kubectl)
        return run(a)
    except (Failure, ck.Fatal) as e:
        print(f"run_local_world: FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
