//! `lunakv doctor`: proves that the pool works end to end, not just that every pod is Ready
//! (upstream llm-d warns an all-Ready cluster does not prove the Store works).
//!
//! One row per check, `pass` / `fail` / `skip`; every failure carries its fix. A check whose
//! input was not given (`--bootstrap`, `--sidecar-args` with `--kv-transfer-config`, ...) is
//! `skip` with the reason. Exit status: 0 when nothing failed, 1 when a check failed, 2 when
//! doctor itself could not run (bad arguments). docs/DOCTOR.md explains each check.

use std::path::PathBuf;
use std::process::ExitCode;

use lunakv_config::MooncakeConfig;
use serde::Serialize;

use crate::args::DoctorArgs;
use crate::output::print_json;

mod check;
mod cluster;
mod http;
mod offload;
mod pd;
mod security;

pub use check::{Check, EXIT_CHECK_FAILED, Outcome};
use cluster::{
    MasterError, Purpose, check_key_consistency, check_master, check_protocol, check_store_clients,
};
use offload::{check_offload_config, check_offload_write};
use pd::{check_bootstrap, check_connectors, check_vllm_stats};
use security::{Unanswered, check_security};

#[derive(Debug, Serialize)]
struct Report<'a> {
    ok: bool,
    master: &'a str,
    checks: &'a [Check],
}

/// Runs every check and prints the table (or one JSON object).
pub fn run(
    a: &DoctorArgs,
    master_flag: &Option<String>,
    config: &Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut checks = Vec::new();
    // The engine config is an input to check, not a reason to stop: a bad file is a failed row.
    let loaded = match config {
        None => None,
        Some(p) => match MooncakeConfig::load(p, &|_: &str| None::<String>) {
            Ok(l) => Some(l),
            Err(e) => {
                checks.push(Check::fail(
                    "engine_config",
                    format!("{}: {e}", p.display()),
                    "fix the engine's mooncake_config.json (the file MOONCAKE_CONFIG_PATH names) \
                     as the message says",
                ));
                None
            }
        },
    };
    match (&loaded, config) {
        (Some(l), Some(p)) => {
            let e = &l.config;
            let seen = format!(
                "{}: valid, mode {}, enable_offload={}",
                p.display(),
                e.mode.as_str(),
                e.enable_offload
            );
            // The other commands keep quiet about how the engine's pool is set up (they only
            // make requests); this is where its connector's warnings belong.
            checks.push(if l.warnings.is_empty() {
                Check::pass("engine_config", seen)
            } else {
                let ws: Vec<String> = l.warnings.iter().map(ToString::to_string).collect();
                Check::warn(
                    "engine_config",
                    format!("{seen}; {}", ws.join("; ")),
                    "change mooncake_config.json as each warning says (the engine's connector \
                     logs the same at startup), or keep it if that is the setup you want",
                )
            })
        }
        (None, None) => checks.push(Check::skip(
            "engine_config",
            "no --config (the engine's mooncake_config.json) given",
        )),
        _ => {}
    }
    let engine = loaded.map(|l| l.config);
    let usable_config = if engine.is_some() {
        config.clone()
    } else {
        None
    };
    let target = crate::target::resolve_cli(master_flag, &usable_config)?;

    let (client, status) = match crate::cmd::kv::connect(&target) {
        Ok(c) => {
            let s = c.cluster_status().map_err(MasterError::Status);
            (Some(c), s)
        }
        Err(e) => (None, Err(MasterError::Connect(e))),
    };

    let purpose = Purpose::of(a);
    checks.push(check_master(&target, &status, &purpose));
    let (client, status) = match (client, status) {
        (Some(c), Ok(s)) => (Some(c), Some(s)),
        _ => (None, None),
    };
    checks.push(check_store_clients(a, status.as_ref()));
    checks.push(check_protocol(status.as_ref()));
    checks.push(check_offload_write(a, client.as_ref(), status.as_ref()));
    checks.push(check_offload_config(
        engine.as_ref(),
        config,
        status.as_ref(),
    ));
    checks.push(check_bootstrap(a));
    checks.push(check_connectors(a));
    checks.push(check_vllm_stats(a));
    checks.push(check_key_consistency(client.as_ref()));
    let anonymous = client.as_ref().map(|c| {
        c.master_refuses_anonymous()
            .map_err(|e| Unanswered(e.to_string()))
    });
    // What the master's RPC port requires, asked in plaintext: also when this doctor could not
    // connect (a master with mTLS refuses a doctor without a certificate).
    let rpc_addr = client
        .as_ref()
        .map(|c| c.master_addr())
        .or_else(|| (!target.master.trim().starts_with("etcd://")).then(|| target.master.clone()));
    let tls = rpc_addr.map(|a| {
        lunakv_master_client::probe_master_tls(&a, std::time::Duration::from_secs(5))
            .map_err(|e| Unanswered(e.to_string()))
    });
    checks.push(check_security(
        &target.master,
        &lunakv_config::process_env,
        anonymous.as_ref(),
        tls.as_ref(),
    ));

    let failed = checks.iter().any(|c| c.status == Outcome::Fail);
    if json {
        print_json(&Report {
            ok: !failed,
            master: &target.master,
            checks: &checks,
        })?;
    } else {
        print!("{}", render(&target.master, &checks));
    }
    Ok(if failed {
        ExitCode::from(EXIT_CHECK_FAILED)
    } else {
        ExitCode::SUCCESS
    })
}

fn render(master: &str, checks: &[Check]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "lunakv doctor: master {master}\n");
    let w = checks
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(o, "{:<w$}  RESULT  DETAIL", "CHECK");
    for c in checks {
        let _ = writeln!(o, "{:<w$}  {:<6}  {}", c.name, c.status.as_str(), c.detail);
        if let Some(f) = &c.fix {
            let _ = writeln!(o, "{:<w$}          fix: {f}", "");
        }
    }
    let failed = checks.iter().filter(|c| c.status == Outcome::Fail).count();
    let _ = writeln!(
        o,
        "\n{}",
        if failed == 0 {
            match checks.iter().filter(|c| c.status == Outcome::Warn).count() {
                0 => "all checks passed (or were skipped)".to_string(),
                n => format!("all checks passed (or were skipped), {n} warning(s)"),
            }
        } else {
            format!("{failed} check(s) failed")
        }
    );
    o
}

#[cfg(test)]
mod tests {
    use super::check::UNSHARED_MESSAGE;
    use super::*;

    #[test]
    fn table_shows_each_failure_with_its_fix() {
        let checks = vec![
            Check::pass("master", "ok"),
            Check::fail("bootstrap", "down", "start it"),
            Check::skip("connectors", "no input"),
        ];
        let t = render("m:1", &checks);
        let line = |name: &str| {
            t.lines()
                .find(|l| l.starts_with(name))
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_default()
        };
        assert_eq!(line("bootstrap"), "bootstrap fail down", "{t}");
        assert_eq!(line("connectors"), "connectors skip no input", "{t}");
        // The fix sits on the line after its failure.
        let after = t.lines().skip_while(|l| !l.starts_with("bootstrap")).nth(1);
        assert_eq!(after.map(str::trim), Some("fix: start it"), "{t}");
        assert!(t.contains("1 check(s) failed"), "{t}");
    }

    fn doctor_args(vllm_args: Option<&str>, kv: Option<&str>, version: Option<&str>) -> DoctorArgs {
        DoctorArgs {
            store: vec![],
            offload_dir: None,
            bootstrap: None,
            sidecar_args: None,
            kv_transfer_config: kv.map(str::to_string),
            vllm_args: vllm_args.map(str::to_string),
            vllm_version: version.map(str::to_string),
            stale_ping_ms: 5000,
        }
    }

    #[test]
    fn vllm_stats_warns_on_multiconnector_with_mooncake_and_stats_on() {
        let multi = r#"{"kv_connector":"MultiConnector","kv_role":"kv_producer","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"},{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}]}}"#;
        let serve = format!("vllm serve Qwen/Qwen3-0.6B --port=8000 --kv-transfer-config={multi}");
        // Stats on, vLLM 0.32.0: a warning naming the issue, with the flag as the fix.
        let c = check_vllm_stats(&doctor_args(Some(&serve), None, Some("0.32.0")));
        assert_eq!(c.status, Outcome::Warn, "{c:?}");
        assert!(
            c.detail.contains("vLLM issue #43828") && c.detail.contains("0.32.0"),
            "{c:?}"
        );
        assert!(
            c.fix
                .as_deref()
                .unwrap_or_default()
                .contains("--disable-log-stats")
        );
        // The flag avoids it.
        let c = check_vllm_stats(&doctor_args(
            Some(&format!("{serve} --disable-log-stats")),
            None,
            None,
        ));
        assert_eq!(c.status, Outcome::Pass, "{c:?}");
        // Only the JSON: cannot tell whether stats are on.
        let c = check_vllm_stats(&doctor_args(None, Some(multi), None));
        assert_eq!(c.status, Outcome::Skip, "{c:?}");
        assert!(c.detail.contains("--vllm-args"), "{c:?}");
        // Not the affected composition.
        let store_only = r#"{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}"#;
        let c = check_vllm_stats(&doctor_args(
            Some(&format!("--kv-transfer-config={store_only}")),
            None,
            Some("0.32.0"),
        ));
        assert_eq!(c.status, Outcome::Pass, "{c:?}");
        // No input at all, and bad input.
        assert_eq!(
            check_vllm_stats(&doctor_args(None, None, None)).status,
            Outcome::Skip
        );
        assert_eq!(
            check_vllm_stats(&doctor_args(Some(&serve), None, Some("latest"))).status,
            Outcome::Fail
        );
    }

    #[test]
    fn security_row_names_what_protects_the_control_plane() {
        let none = |_: &str| None::<String>;
        let (open, guarded) = (Ok(false), Ok(true));
        assert_eq!(
            check_security("127.0.0.1:50051", &none, Some(&open), None).status,
            Outcome::Pass
        );
        let stranger = check_security("lunakv-master.lunakv.svc:50051", &none, Some(&open), None);
        assert_eq!(stranger.status, Outcome::Warn);
        let fix = stranger.fix.as_deref().unwrap_or("");
        assert!(
            fix.contains("NetworkPolicies") && fix.contains("LUNAKV_AUTH_TOKEN"),
            "{fix}"
        );
        let ok = check_security(
            "lunakv-master.lunakv.svc:50051",
            &none,
            Some(&guarded),
            None,
        );
        assert_eq!(ok.status, Outcome::Pass, "{}", ok.detail);
        assert!(ok.detail.contains("capabilities"), "{}", ok.detail);
        // This doctor has the token but the master does not ask for it: started without it.
        let with_token =
            |k: &str| (k == "LUNAKV_AUTH_TOKEN").then(|| "doctor-token-0123456789".to_string());
        let mismatch = check_security("10.0.0.7:50051", &with_token, Some(&open), None);
        assert_eq!(mismatch.status, Outcome::Warn);
        assert!(
            mismatch.detail.contains("started without it"),
            "{}",
            mismatch.detail
        );
        // A master doctor did not reach is not checked, wherever it would listen.
        for addr in ["10.0.0.7:50051", "127.0.0.1:50051", "localhost:50051"] {
            let unknown = check_security(addr, &none, None, None);
            assert_eq!(unknown.status, Outcome::Skip, "{addr}: {unknown:?}");
            assert!(
                unknown.detail.contains("could not be checked")
                    && !unknown.detail.contains("loopback"),
                "{addr}: {}",
                unknown.detail
            );
        }
        // ...and a refused plaintext probe (nothing listens) changes nothing.
        let refused = Err(Unanswered("connection refused".to_string()));
        assert_eq!(
            check_security("127.0.0.1:50051", &none, None, Some(&refused)).status,
            Outcome::Skip
        );
        let short = |k: &str| (k == "LUNAKV_AUTH_TOKEN").then(|| "short".to_string());
        assert_eq!(
            check_security("10.0.0.7:50051", &short, Some(&guarded), None).status,
            Outcome::Fail
        );

        let plain = check_security("etcd://e1:2379;e2:2379", &none, Some(&guarded), None);
        assert_eq!(plain.status, Outcome::Warn);
        assert!(
            plain
                .fix
                .as_deref()
                .unwrap_or("")
                .contains("LUNAKV_ETCD_CACERT"),
            "{:?}",
            plain.fix
        );

        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let pem = pem.display().to_string();
        let ca_only = |k: &str| (k == "LUNAKV_ETCD_CACERT").then(|| pem.clone());
        let anon = check_security("etcd://e1:2379", &ca_only, Some(&guarded), None);
        assert_eq!(anon.status, Outcome::Warn);
        assert!(anon.detail.contains("no identity"), "{}", anon.detail);
        let with_user = |k: &str| match k {
            "LUNAKV_ETCD_CACERT" => Some(pem.clone()),
            "LUNAKV_ETCD_USER" => Some("lunakv:Hunter2-not-in-any-path".into()),
            _ => None,
        };
        let ok = check_security("etcd://e1:2379", &with_user, Some(&guarded), None);
        assert_eq!(ok.status, Outcome::Pass, "{}", ok.detail);
        // The password is distinctive on purpose: the detail holds a random temp path,
        // and a short password like "pw" turns up in those by chance.
        assert!(
            ok.detail.contains("etcd user lunakv") && !ok.detail.contains("Hunter2"),
            "{}",
            ok.detail
        );
        // etcd secured, the master open to strangers: still a warning.
        assert_eq!(
            check_security("etcd://e1:2379", &with_user, Some(&open), None).status,
            Outcome::Warn
        );
        let broken = |k: &str| (k == "LUNAKV_ETCD_CACERT").then(|| "/nonexistent.pem".to_string());
        assert_eq!(
            check_security("etcd://e1:2379", &broken, Some(&guarded), None).status,
            Outcome::Fail
        );
    }

    #[test]
    fn the_engines_connectors_say_whether_a_store_is_expected() {
        let pd = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
        assert_eq!(
            Purpose::of(&doctor_args(None, Some(pd), None)),
            Purpose::PdOnly(vec!["MooncakeConnector".into()])
        );
        // From the command line too, which wins over --kv-transfer-config.
        let serve = format!("vllm serve m --kv-transfer-config={pd}");
        let store = r#"{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}"#;
        assert!(matches!(
            Purpose::of(&doctor_args(Some(&serve), Some(store), None)),
            Purpose::PdOnly(_)
        ));
        // A MultiConnector is what it wraps.
        let multi_pd = r#"{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector"},{"kv_connector":"NixlConnector"}]}}"#;
        assert!(matches!(
            Purpose::of(&doctor_args(None, Some(multi_pd), None)),
            Purpose::PdOnly(_)
        ));
        // The store, a connector that may use it, nothing said, or unreadable: a store is
        // expected, so a missing one still fails.
        let multi_store = r#"{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector"},{"kv_connector":"MooncakeStoreConnector"}]}}"#;
        let lmcache = r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#;
        for kv in [
            Some(store),
            Some(multi_store),
            Some(lmcache),
            None,
            Some("{not json"),
        ] {
            assert_eq!(
                Purpose::of(&doctor_args(None, kv, None)),
                Purpose::Store,
                "{kv:?}"
            );
        }
    }

    #[test]
    fn the_message_is_the_masters() {
        assert_eq!(
            UNSHARED_MESSAGE,
            "instances never share a block: PYTHONHASHSEED or hash algorithm differs"
        );
    }
}
