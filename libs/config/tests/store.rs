//! lunakv-store flags: upstream names and defaults, gflags-style booleans, every check; the
//! layers (file < env < flags) and their messages.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser};
use lunakv_config::layered::Sources;
use lunakv_config::store::{ENV_VARS, StoreArgs, StoreConfigError};
use lunakv_config::{ConfigError, ConfigWarning, HostPort, MasterAddress, Protocol, StoreConfig};

const GIB: u64 = 1 << 30;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    store: StoreArgs,
}

/// The layers the command line `args` names (the program name is added).
fn sources(args: &[&str]) -> Result<Sources, clap::Error> {
    let matches = Cli::command()
        .try_get_matches_from(std::iter::once("lunakv-store").chain(args.iter().copied()))?;
    Ok(Cli::from_arg_matches(&matches)?.store.sources(&matches))
}

/// Loads `args` over `env` and validates, as the binary does.
fn load(
    args: &[&str],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StoreConfig, StoreConfigError> {
    StoreConfig::load(&sources(args).expect("flags"), env).map(|l| l.config)
}

/// The flags alone, loaded but not validated (the checks are tested one by one below).
fn parse(args: &[&str]) -> Result<StoreConfig, clap::Error> {
    let s = sources(args)?;
    let names = lunakv_config::layered::Names {
        env: Some(ENV_VARS),
        aliases: &[],
    };
    Ok(lunakv_config::layered::load_named(
        &lunakv_config::store::SCHEMA,
        &names,
        None,
        &s.flags,
        &|_| None,
    )
    .expect("load")
    .config)
}

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn no_flags_equals_default() {
    let c = parse(&[]).unwrap();
    assert_eq!(c, StoreConfig::default());
    assert_eq!(c.master_server_address, "127.0.0.1:50051");
    assert_eq!(c.host, "127.0.0.1");
    assert_eq!(c.port, 50052);
    assert_eq!(c.global_segment_size, 4 * GIB);
    assert_eq!(c.protocol, Protocol::Tcp);
    assert_eq!(c.metadata_server, "P2PHANDSHAKE");
    assert!(!c.enable_offload);
    assert_eq!(c.cluster_id, "mooncake_cluster");
    assert_eq!(c.shm_socket, None);
    assert!(c.enable_shm);
    assert_eq!(c.metrics_port, 9004);
    assert_eq!(
        c.offload_file_storage_path,
        PathBuf::from("/data/file_storage")
    );
    assert_eq!(c.offload_total_size_limit_bytes, 2 << 40);
    assert_eq!(c.validate().unwrap(), vec![]);
}

#[test]
fn llm_d_daemonset_args_with_tcp() {
    let c = parse(&[
        "--master_server_address=mooncake-master-store.mooncake.svc.cluster.local:50051",
        "--host=10.1.2.3",
        "--port=50052",
        "--protocol=tcp",
        "--global_segment_size=40GB",
        "--enable_offload=true",
        "--metadata_server=P2PHANDSHAKE",
    ])
    .unwrap();
    assert_eq!(c.host, "10.1.2.3");
    assert_eq!(c.global_segment_size, 40 * GIB);
    assert!(c.enable_offload);
    assert!(matches!(c.master_address().unwrap(), MasterAddress::Direct(hp) if hp.port == 50051));
    // The SSD tier is implemented: offload is a plain switch, no warning.
    assert!(c.validate().unwrap().is_empty());
}

#[test]
fn space_separated_values_and_size_spellings() {
    let c = parse(&[
        "--port",
        "0",
        "--global_segment_size",
        "4 GB",
        "--metrics_port",
        "0",
    ])
    .unwrap();
    assert_eq!(
        (c.port, c.global_segment_size, c.metrics_port),
        (0, 4 * GIB, 0)
    );
    assert_eq!(
        parse(&["--global_segment_size=512MiB"])
            .unwrap()
            .global_segment_size,
        512 << 20
    );
    assert_eq!(
        parse(&["--global_segment_size=1073741824"])
            .unwrap()
            .global_segment_size,
        GIB
    );
    // Dashed aliases.
    assert_eq!(
        parse(&["--global-segment-size=1GB"])
            .unwrap()
            .global_segment_size,
        GIB
    );
}

#[test]
fn gflags_style_booleans() {
    let off = |args: &[&str]| parse(args).unwrap().enable_offload;
    assert!(off(&["--enable_offload"]));
    assert!(off(&["--enable_offload=true"]));
    assert!(off(&["--enable_offload=1"]));
    assert!(off(&["--enable_offload=yes"]));
    assert!(!off(&["--enable_offload=false"]));
    assert!(!off(&["--enable_offload=0"]));
    assert!(!parse(&["--enable_shm=false"]).unwrap().enable_shm);
    assert!(parse(&["--enable_shm"]).unwrap().enable_shm);
    // gflags booleans never take a separate value.
    assert!(parse(&["--enable_offload", "false"]).is_err());
    let e = parse(&["--enable_offload=maybe"]).unwrap_err().to_string();
    assert!(e.contains("maybe"), "{e}");
}

#[test]
fn bad_flag_values_are_explained() {
    let e = parse(&["--global_segment_size=40XB"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("invalid size \"40XB\": unknown unit \"XB\""),
        "{e}"
    );
    assert!(e.contains("--global_segment_size"), "{e}");
    let e = parse(&["--protocol=ib"]).unwrap_err().to_string();
    assert!(
        e.contains("protocol 'ib' is not a known protocol; use \"tcp\""),
        "{e}"
    );
    assert!(parse(&["--port=70000"]).is_err());
}

#[test]
fn rdma_is_a_valid_protocol_value_checked_by_the_binary() {
    // The device probe lives in lunakv-store (it needs lunakv-transfer); the config only parses.
    let c = parse(&["--protocol=rdma"]).unwrap();
    assert_eq!(c.protocol, Protocol::Rdma);
    assert!(c.validate().is_ok());
    assert!(parse(&["--protocol=carrier-pigeon"]).is_err());
}

#[test]
fn zero_segment_is_refused() {
    let e = parse(&["--global_segment_size=0"])
        .unwrap()
        .validate()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--global_segment_size '0' is invalid: a store-client must serve some memory; give the DRAM to serve, e.g. --global_segment_size=40GB"
    );
}

#[test]
fn host_checks() {
    let e = parse(&["--host="]).unwrap().validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "--host is not set: give the address to bind and advertise, e.g. --host=127.0.0.1 or --host=$(POD_IP)"
    );
    let e = parse(&["--host=10.0.0.5:50052"])
        .unwrap()
        .validate()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--host '10.0.0.5:50052' is invalid: a host is a name or an IP address, without a port; write e.g. --host=10.0.0.5 --port=50052"
    );
    assert!(parse(&["--host=::1"]).unwrap().validate().is_ok());
    assert!(
        parse(&["--host=store-0.store.svc"])
            .unwrap()
            .validate()
            .is_ok()
    );
}

#[test]
fn master_address_checks() {
    let c = parse(&["--master_server_address=etcd://10.0.0.1:2379;10.0.0.2:2379"]).unwrap();
    c.validate().expect("an etcd master address is accepted");
    assert_eq!(
        c.master_address().unwrap().to_string(),
        "etcd://10.0.0.1:2379;10.0.0.2:2379"
    );
    let c = parse(&["--etcd_endpoints=10.0.0.1:2379;10.0.0.2:2379"]).unwrap();
    assert_eq!(
        c.master_address().unwrap().to_string(),
        "etcd://10.0.0.1:2379;10.0.0.2:2379",
        "--etcd_endpoints overrides the master address"
    );
    let e = parse(&["--etcd_endpoints=10.0.0.1"])
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(matches!(e, ConfigError::InvalidEtcdEndpoints { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("--etcd_endpoints '10.0.0.1' is not a valid etcd endpoint list"),
        "{e}"
    );
    let e = parse(&["--master_server_address=10.0.0.1"])
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(matches!(e, ConfigError::InvalidAddress { .. }), "{e}");
    assert_eq!(
        parse(&["--master_server_address=[::1]:50051"])
            .unwrap()
            .master_address()
            .unwrap(),
        MasterAddress::Direct(HostPort {
            host: "::1".into(),
            port: 50051
        })
    );
}

#[test]
fn port_clash_and_cluster_id() {
    let e = parse(&["--port=9004"]).unwrap().validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "--metrics_port '9004' is invalid: it is also the transfer --port; use another port, e.g. --metrics_port=9004, or 0 for a free one"
    );
    assert!(
        parse(&["--port=0", "--metrics_port=0"])
            .unwrap()
            .validate()
            .is_ok()
    );
    let e = parse(&["--cluster_id="]).unwrap().validate().unwrap_err();
    assert!(matches!(&e, ConfigError::Missing { field, .. } if field == "--cluster_id"));
}

#[test]
fn metadata_server_other_than_p2p_warns() {
    let w = parse(&["--metadata_server=http://10.0.0.1:8080/metadata"])
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(
        w,
        vec![ConfigWarning::MetadataServerIgnored {
            field: "--metadata_server",
            value: "http://10.0.0.1:8080/metadata".into()
        }]
    );
}

#[test]
fn offload_env() {
    let c = load(
        &[],
        &env_of(&[
            (
                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
                "/data/mooncake-offload",
            ),
            ("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "536870912000"),
        ]),
    )
    .unwrap();
    assert_eq!(
        c.offload_file_storage_path,
        PathBuf::from("/data/mooncake-offload")
    );
    assert_eq!(c.offload_total_size_limit_bytes, 536_870_912_000);
    let c = load(
        &[],
        &env_of(&[("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "500GB")]),
    )
    .unwrap();
    assert_eq!(c.offload_total_size_limit_bytes, 500 * GIB);
    let e = load(
        &[],
        &env_of(&[("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "big")]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("(from environment variable MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES)")
            && e.contains("invalid size \"big\""),
        "{e}"
    );
}

#[test]
fn shm_socket_path() {
    let c = StoreConfig::default();
    assert_eq!(
        c.shm_socket_path(50052, &|_| None),
        PathBuf::from("/tmp/lunakv-store-mooncake_cluster-127.0.0.1-50052.sock")
    );
    assert_eq!(
        c.shm_socket_path(41234, &env_of(&[("XDG_RUNTIME_DIR", "/run/user/1000")])),
        PathBuf::from("/run/user/1000/lunakv-store-mooncake_cluster-127.0.0.1-41234.sock")
    );
    // Two stacks sharing a runtime directory: other cluster or other host, other socket.
    let other = parse(&["--cluster_id=team b", "--host=127.0.0.2"]).unwrap();
    assert_eq!(
        other.shm_socket_path(50052, &|_| None),
        PathBuf::from("/tmp/lunakv-store-team_b-127.0.0.2-50052.sock")
    );
    // A directory (the k8s hostPath) gets the generated name inside it.
    let c = parse(&["--shm_socket=/run/lunakv/"]).unwrap();
    assert_eq!(
        c.shm_socket_path(50052, &|_| None),
        PathBuf::from("/run/lunakv/lunakv-store-mooncake_cluster-127.0.0.1-50052.sock")
    );
    let c = parse(&["--shm_socket=/dev/shm/x.sock"]).unwrap();
    assert_eq!(
        c.shm_socket_path(1, &|_| None),
        PathBuf::from("/dev/shm/x.sock")
    );
}

#[test]
fn offload_drain_timeout() {
    assert_eq!(parse(&[]).unwrap().offload_drain_timeout_sec, 20);
    let c = parse(&["--offload_drain_timeout_sec=0"]).unwrap();
    assert_eq!(c.offload_drain_timeout_sec, 0);
    assert!(c.validate().is_ok());
    let c = parse(&["--offload-drain-timeout-sec", "45"]).unwrap();
    assert_eq!(c.offload_drain_timeout_sec, 45);
    assert!(parse(&["--offload_drain_timeout_sec=soon"]).is_err());
    // Instant + u64::MAX seconds would overflow: far too long is refused with the fix.
    let c = parse(&["--offload_drain_timeout_sec=18446744073709551615"]).unwrap();
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.starts_with("--offload_drain_timeout_sec '18446744073709551615' is invalid")
            && e.contains("terminationGracePeriodSeconds"),
        "{e}"
    );
}

#[test]
fn clap_defaults_and_env_attributes_are_the_loaders() {
    // --help shows clap's defaults and `[env: ...]`: they must be what the loader applies.
    let defaults = StoreConfig::default();
    let c = parse(&[]).unwrap();
    assert_eq!(c, defaults);
    let cmd = Cli::command();
    let from_clap: Vec<(String, String)> = cmd
        .get_arguments()
        .filter_map(|a| {
            let env = a.get_env()?.to_str()?.to_string();
            Some((a.get_id().to_string(), env))
        })
        .collect();
    for (key, var) in &from_clap {
        assert!(
            ENV_VARS.iter().any(|(k, v)| k == key && v == var),
            "--{key} shows [env: {var}] but the loader does not read it"
        );
    }
    // Every variable the loader reads has its flag's [env: ...], or is env-only.
    for (key, var) in ENV_VARS {
        let flag = cmd.get_arguments().find(|a| a.get_id() == *key);
        if let Some(flag) = flag {
            assert_eq!(flag.get_env().and_then(|e| e.to_str()), Some(*var), "{key}");
        }
    }
}

fn write_config(text: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.yaml");
    std::fs::write(&path, text).unwrap();
    let flag = format!("--config={}", path.display());
    (dir, flag)
}

#[test]
fn file_then_env_then_flags() {
    let (_dir, config) = write_config(
        "port: 50100\nbind_retry_sec: 5\ntransfer_max_conns: 10\nglobal_segment_size: 2GB\n\
         enable_offload: true\noffload_file_storage_path: /from/file\nprotocol: rdma\n",
    );
    let env = env_of(&[
        ("LUNAKV_BIND_RETRY_SEC", "6"),
        ("LUNAKV_TRANSFER_MAX_CONNS", "11"),
        ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "/from/env"),
    ]);
    let c = load(&[&config, "--transfer_max_conns=12"], &env).unwrap();
    assert_eq!(c.port, 50100, "the file beats the default");
    assert_eq!(c.global_segment_size, 2 * GIB);
    assert!(c.enable_offload);
    assert_eq!(c.protocol, Protocol::Rdma);
    assert_eq!(c.bind_retry_sec, 6, "env beats the file");
    assert_eq!(c.offload_file_storage_path, PathBuf::from("/from/env"));
    assert_eq!(c.transfer_max_conns, 12, "a flag beats env and the file");
    // A flag given with its default value still beats the file.
    let c = load(&[&config, "--port=50052"], &|_| None).unwrap();
    assert_eq!(c.port, 50052);
    // No file: the defaults, as before.
    assert_eq!(load(&[], &|_| None).unwrap(), StoreConfig::default());
}

#[test]
fn bad_layer_values_name_their_source() {
    let (_dir, config) = write_config("port: 70000\n");
    let e = load(&[&config], &|_| None).unwrap_err().to_string();
    assert!(
        e.starts_with("port = \"70000\" (from ") && e.contains("store.yaml)"),
        "{e}"
    );
    let (_dir, config) = write_config("global_segment_size: 40XB\n");
    let e = load(&[&config], &|_| None).unwrap_err().to_string();
    assert!(
        e.contains("global_segment_size = \"40XB\"")
            && e.contains("store.yaml")
            && e.contains("unknown unit \"XB\""),
        "{e}"
    );
    let (_dir, config) = write_config("prot: 1\n");
    let e = load(&[&config], &|_| None).unwrap_err().to_string();
    assert!(
        e.starts_with("unknown store config key \"prot\" in ") && e.contains("did you mean port"),
        "{e}"
    );
    // Upstream keys in the file are judged as on the command line.
    let (_dir, config) = write_config("tenant_id: team-a\n");
    let e = load(&[&config], &|_| None).unwrap_err().to_string();
    assert!(
        e.contains("tenant_id") && e.contains(lunakv_config::messages::TENANT_REFUSAL),
        "{e}"
    );
    let (_dir, config) = write_config("threads: 4\n");
    let w = StoreConfig::load(&sources(&[&config]).unwrap(), &|_| None)
        .unwrap()
        .warnings;
    assert!(w.iter().any(|w| w.contains("threads")), "{w:?}");
    // The store's own checks run on the merged result, with their flag-named messages.
    let (_dir, config) = write_config("global_segment_size: 0\n");
    let e = load(&[&config], &|_| None).unwrap_err();
    assert!(
        matches!(e, StoreConfigError::Invalid(ConfigError::Invalid { ref field, .. }) if field == "--global_segment_size"),
        "{e}"
    );
    let e = load(&["--config=/nonexistent/store.yaml"], &|_| None)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cannot read store config /nonexistent/store.yaml"),
        "{e}"
    );
}
