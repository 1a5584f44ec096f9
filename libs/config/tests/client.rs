//! mooncake_config.json: every check and message, env overrides, malformed input, defaults.

use std::collections::HashMap;
use std::io::Write;

use lunakv_config::client::{DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE};
use lunakv_config::{
    ConfigError, ConfigWarning, HostPort, Loaded, MasterAddress, Mode, MooncakeConfig, Protocol,
};

const GIB: u64 = 1 << 30;

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn write_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.flush().unwrap();
    f
}

fn load_str(text: &str) -> Result<Loaded<MooncakeConfig>, ConfigError> {
    let f = write_file(text);
    MooncakeConfig::load(f.path(), &no_env)
}

fn load_err(text: &str) -> ConfigError {
    load_str(text).expect_err("expected an error")
}

const MASTER: &str = r#""master_server_address": "127.0.0.1:50051""#;

#[test]
fn defaults_are_vllms() {
    let c = MooncakeConfig::default();
    assert_eq!(c.mode, Mode::Embedded);
    assert!(c.is_embedded());
    assert_eq!(c.global_segment_size, 4 * GIB);
    assert_eq!(c.local_buffer_size, 4 * GIB);
    assert_eq!(DEFAULT_GLOBAL_SEGMENT_SIZE, 4 * GIB);
    assert_eq!(DEFAULT_LOCAL_BUFFER_SIZE, 4 * GIB);
    assert_eq!(c.protocol, Protocol::Rdma);
    assert_eq!(c.metadata_server, "");
    assert_eq!(c.master_server_address, "");
    assert_eq!(c.device_name, "");
    assert_eq!(c.local_hostname, "");
    assert_eq!(c.tenant_id, "default");
    assert!(!c.enable_offload);
    assert!(c.enable_shm);
    assert_eq!(c.preferred_segment, None);

    // A file with only the master address gets the same defaults.
    let loaded = load_str(&format!("{{{MASTER}}}")).unwrap();
    assert_eq!(
        loaded.config,
        MooncakeConfig {
            master_server_address: "127.0.0.1:50051".into(),
            ..Default::default()
        }
    );
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn llm_d_cpu_config_parses() {
    let text = r#"{"mode":"embedded","metadata_server":"P2PHANDSHAKE","master_server_address":
        "mooncake-master-store.mooncake.svc.cluster.local:50051","global_segment_size":"80GB","local_buffer_size":
        "4GB","protocol":"rdma","device_name":"","enable_offload":false}"#;
    let Loaded { config, warnings } = load_str(text).unwrap();
    assert_eq!(config.global_segment_size, 80 * GIB);
    assert_eq!(config.local_buffer_size, 4 * GIB);
    assert_eq!(config.protocol, Protocol::Rdma);
    assert_eq!(
        config.master_address().unwrap(),
        MasterAddress::Direct(HostPort {
            host: "mooncake-master-store.mooncake.svc.cluster.local".into(),
            port: 50051
        })
    );
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn standalone_store_fs_config_parses() {
    let text = format!(
        r#"{{"mode":"standalone-store","global_segment_size":0,"local_buffer_size":"4 GB","enable_offload":true,"protocol":"tcp",{MASTER}}}"#
    );
    let Loaded { config, warnings } = load_str(&text).unwrap();
    assert_eq!(config.mode, Mode::StandaloneStore);
    assert!(!config.is_embedded());
    assert_eq!(config.global_segment_size, 0);
    assert!(config.enable_offload);
    assert!(warnings.is_empty(), "{warnings:?}");
}

// === the four vLLM checks, exact messages, in vLLM's order ===

#[test]
fn unknown_mode_exact_message() {
    let e = load_err(&format!(r#"{{"mode": "x", {MASTER}}}"#));
    assert!(matches!(&e, ConfigError::UnknownMode { mode } if mode == "x"));
    assert_eq!(e.to_string(), "unknown Mooncake mode: 'x'");
    // Mode is checked first, before the other checks (local_buffer_size is 0 here too).
    let e = load_err(r#"{"mode": "Embedded", "local_buffer_size": 0}"#);
    assert_eq!(e.to_string(), "unknown Mooncake mode: 'Embedded'");
}

#[test]
fn local_buffer_size_exact_message() {
    for v in ["0", "\"0\"", "\"0GB\""] {
        let e = load_err(&format!(r#"{{"local_buffer_size": {v}, {MASTER}}}"#));
        assert!(matches!(e, ConfigError::LocalBufferSizeZero));
        assert_eq!(e.to_string(), "local_buffer_size must be > 0");
    }
    // Checked before the mode pairing (global_segment_size is also wrong here).
    let e = load_err(r#"{"local_buffer_size": 0, "global_segment_size": 0}"#);
    assert_eq!(e.to_string(), "local_buffer_size must be > 0");
}

#[test]
fn embedded_requires_segment_exact_message() {
    let e = load_err(&format!(
        r#"{{"mode": "embedded", "global_segment_size": 0, {MASTER}}}"#
    ));
    assert!(matches!(e, ConfigError::EmbeddedRequiresSegment));
    assert_eq!(
        e.to_string(),
        "embedded mode requires global_segment_size > 0"
    );
    // Mode defaults to embedded.
    let e = load_err(&format!(r#"{{"global_segment_size": "0GB", {MASTER}}}"#));
    assert_eq!(
        e.to_string(),
        "embedded mode requires global_segment_size > 0"
    );
}

#[test]
fn standalone_requires_no_segment_exact_message() {
    let e = load_err(&format!(
        r#"{{"mode": "standalone-store", "global_segment_size": "80GB", {MASTER}}}"#
    ));
    assert!(
        matches!(e, ConfigError::StandaloneRequiresNoSegment { global_segment_size } if global_segment_size == 80 * GIB)
    );
    assert_eq!(
        e.to_string(),
        "standalone-store mode requires global_segment_size == 0"
    );
    // The default (4 GiB) counts as != 0.
    let e = load_err(&format!(r#"{{"mode": "standalone-store", {MASTER}}}"#));
    assert_eq!(
        e.to_string(),
        "standalone-store mode requires global_segment_size == 0"
    );
}

#[test]
fn vllm_checks_come_before_lunakvs() {
    // No master address, but the vLLM check fires first.
    let e = load_err(r#"{"mode": "standalone-store"}"#);
    assert_eq!(
        e.to_string(),
        "standalone-store mode requires global_segment_size == 0"
    );
}

// === MOONCAKE_CONFIG_PATH ===

#[test]
fn config_path_unset_exact_message() {
    let e = MooncakeConfig::load_from_env(&no_env).unwrap_err();
    assert!(matches!(
        e,
        ConfigError::EnvNotSet {
            var: "MOONCAKE_CONFIG_PATH"
        }
    ));
    assert_eq!(
        e.to_string(),
        "The environment variable 'MOONCAKE_CONFIG_PATH' is not set."
    );
    // Empty counts as unset.
    let e = MooncakeConfig::load_from_env(&env_of(&[("MOONCAKE_CONFIG_PATH", "")])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "The environment variable 'MOONCAKE_CONFIG_PATH' is not set."
    );
}

#[test]
fn config_path_set_loads_that_file() {
    let f = write_file(&format!(r#"{{"global_segment_size": "8GB", {MASTER}}}"#));
    let path = f.path().to_str().unwrap();
    let loaded = MooncakeConfig::load_from_env(&env_of(&[("MOONCAKE_CONFIG_PATH", path)])).unwrap();
    assert_eq!(loaded.config.global_segment_size, 8 * GIB);
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.json");
    let e = MooncakeConfig::load_file(&path).unwrap_err();
    assert!(matches!(&e, ConfigError::Io { path: p, .. } if p == &path));
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("cannot read config file {}: ", path.display())),
        "{msg}"
    );
    assert!(
        msg.ends_with("; check the path and its permissions"),
        "{msg}"
    );
}

// === enable_offload: what vLLM gets wrong ===

#[test]
fn enable_offload_string_false_is_an_error() {
    let e = load_err(&format!(r#"{{"enable_offload": "false", {MASTER}}}"#));
    assert!(
        matches!(&e, ConfigError::NotABool { field, value } if field == "enable_offload" && value == "\"false\"")
    );
    assert_eq!(
        e.to_string(),
        "enable_offload must be a JSON boolean, got \"false\": vLLM reads any non-empty string, even \"false\", \
         as true, so lunakv refuses it; write \"enable_offload\": true or \"enable_offload\": false, without quotes"
    );
    for v in ["\"true\"", "\"False\"", "\"\"", "\"0\"", "0", "1", "[]"] {
        let e = load_err(&format!(r#"{{"enable_offload": {v}, {MASTER}}}"#));
        assert!(
            matches!(&e, ConfigError::NotABool { value, .. } if value == v),
            "{v}: {e}"
        );
    }
    let e = load_err(&format!(r#"{{"enable_shm": "no", {MASTER}}}"#));
    assert!(matches!(&e, ConfigError::NotABool { field, .. } if field == "enable_shm"));
}

#[test]
fn enable_offload_booleans_and_null() {
    let get = |v: &str| {
        load_str(&format!(r#"{{"enable_offload": {v}, {MASTER}}}"#))
            .unwrap()
            .config
            .enable_offload
    };
    assert!(get("true"));
    assert!(!get("false"));
    assert!(!get("null"));
}

// === malformed and truncated JSON ===

#[test]
fn truncated_json_names_file_line_column() {
    let f = write_file("{\n  \"mode\": \"embedded\",\n  \"global_segment_size\": \"80GB\"\n");
    let e = MooncakeConfig::load_file(f.path()).unwrap_err();
    let ConfigError::Json {
        origin,
        line,
        column,
        truncated,
        ..
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(origin, &f.path().display().to_string());
    assert_eq!((*line, *column), (4, 0));
    assert!(truncated);
    assert_eq!(
        e.to_string(),
        format!(
            "{}: invalid JSON at line 4, column 0: EOF while parsing an object (the file ends early: is it empty or truncated?)",
            f.path().display()
        )
    );
}

#[test]
fn empty_file_is_truncated() {
    let e = load_err("");
    assert!(
        matches!(
            e,
            ConfigError::Json {
                truncated: true,
                line: 1,
                column: 0,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("EOF while parsing a value (the file ends early"),
        "{e}"
    );
}

#[test]
fn malformed_json_says_what_was_expected() {
    // A missing comma on line 2.
    let e = load_err("{\"mode\": \"embedded\"\n \"protocol\": \"tcp\"}");
    let ConfigError::Json {
        line,
        column,
        truncated,
        message,
        ..
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!((*line, *column), (2, 2));
    assert!(!truncated);
    assert_eq!(message, "expected `,` or `}`");
    assert!(
        e.to_string()
            .ends_with("invalid JSON at line 2, column 2: expected `,` or `}`"),
        "{e}"
    );
    // A trailing comma.
    let e = load_err("{\"mode\": \"embedded\",}");
    assert!(e.to_string().contains("trailing comma"), "{e}");
    // Not an object.
    let e = load_err("[1, 2]");
    assert!(matches!(&e, ConfigError::NotAnObject { found, .. } if found == "an array"));
    assert!(
        e.to_string()
            .contains("expected a JSON object at the top level"),
        "{e}"
    );
}

// === wrong types name the field ===

#[test]
fn wrong_types_name_the_field() {
    let e = load_err(&format!(r#"{{"protocol": 5, {MASTER}}}"#));
    assert_eq!(
        e.to_string(),
        "protocol: expected a string, got 5; write e.g. \"protocol\": \"tcp\""
    );
    let e = load_err(r#"{"master_server_address": ["a"]}"#);
    assert_eq!(
        e.to_string(),
        "master_server_address: expected a string, got [\"a\"]; write e.g. \"master_server_address\": \"127.0.0.1:50051\""
    );
    let e = load_err(&format!(r#"{{"mode": true, {MASTER}}}"#));
    assert!(
        matches!(&e, ConfigError::WrongType { field, .. } if field == "mode"),
        "{e}"
    );
    let e = load_err(&format!(r#"{{"global_segment_size": true, {MASTER}}}"#));
    assert_eq!(
        e.to_string(),
        "global_segment_size: expected a size (a byte count or a string like \"80GB\"), got true; write e.g. \"global_segment_size\": \"80GB\""
    );
}

#[test]
fn bad_sizes_name_field_and_value() {
    let e = load_err(&format!(r#"{{"global_segment_size": "80XB", {MASTER}}}"#));
    assert!(matches!(&e, ConfigError::InvalidSize { field, .. } if field == "global_segment_size"));
    assert!(
        e.to_string()
            .starts_with("global_segment_size: invalid size \"80XB\": unknown unit \"XB\""),
        "{e}"
    );
    assert!(e.to_string().contains("e.g. 4294967296, \"80GB\""), "{e}");
    let e = load_err(&format!(r#"{{"local_buffer_size": -1, {MASTER}}}"#));
    assert!(
        e.to_string()
            .starts_with("local_buffer_size: invalid size -1: sizes cannot be negative"),
        "{e}"
    );
}

#[test]
fn sizes_as_numbers_and_strings() {
    let get = |v: &str| {
        load_str(&format!(r#"{{"global_segment_size": {v}, {MASTER}}}"#))
            .unwrap()
            .config
            .global_segment_size
    };
    assert_eq!(get("1073741824"), GIB);
    assert_eq!(get("\"80GB\""), 80 * GIB);
    assert_eq!(get("\"4 GB\""), 4 * GIB);
    assert_eq!(get("\"512MiB\""), 512 << 20);
    assert_eq!(get("null"), 4 * GIB);
}

#[test]
fn unknown_protocol() {
    let e = load_err(&format!(r#"{{"protocol": "tpc", {MASTER}}}"#));
    assert_eq!(
        e.to_string(),
        "protocol 'tpc' is not a known protocol; use \"tcp\""
    );
}

// === lunakv's own checks ===

#[test]
fn master_address_required_and_host_port() {
    let e = load_err("{}");
    assert!(matches!(&e, ConfigError::Missing { field, .. } if field == "master_server_address"));
    assert_eq!(
        e.to_string(),
        "master_server_address is not set: set \"master_server_address\": \"127.0.0.1:50051\" (the lunakv-master's host:port) in mooncake_config.json, or MOONCAKE_MASTER"
    );
    let e = load_err(r#"{"master_server_address": "localhost"}"#);
    assert_eq!(
        e.to_string(),
        "master_server_address 'localhost' is not a host:port address: the port is missing; write it like \"127.0.0.1:50051\""
    );
    let e = load_err(r#"{"master_server_address": "etcd://10.0.0.1:2379;;10.0.0.2:2379"}"#);
    assert!(
        matches!(&e, ConfigError::InvalidEtcdEndpoints { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("etcd://h1:2379;h2:2379"), "{e}");
    let e = load_err(r#"{"master_server_address": "redis://10.0.0.1:6379"}"#);
    assert!(e.to_string().contains("use host:port"), "{e}");
}

// === unknown and ignored keys ===

#[test]
fn unknown_keys_warn_with_suggestions() {
    let f = write_file(&format!(
        r#"{{"global_segement_size": "80GB", "sglang_extra": 1, {MASTER}}}"#
    ));
    let Loaded { config, warnings } = MooncakeConfig::load_file(f.path()).unwrap();
    assert_eq!(
        config.global_segment_size,
        4 * GIB,
        "the typo is not applied"
    );
    let origin = f.path().display().to_string();
    assert_eq!(
        warnings,
        vec![
            ConfigWarning::UnknownKey {
                origin: origin.clone(),
                key: "global_segement_size".into(),
                did_you_mean: Some("global_segment_size")
            },
            ConfigWarning::UnknownKey {
                origin: origin.clone(),
                key: "sglang_extra".into(),
                did_you_mean: None
            },
        ]
    );
    assert_eq!(
        warnings[0].to_string(),
        format!(
            "{origin}: unknown key \"global_segement_size\" is ignored; did you mean \"global_segment_size\"?"
        )
    );
    assert_eq!(
        warnings[1].to_string(),
        format!("{origin}: unknown key \"sglang_extra\" is ignored (vLLM ignores it too)")
    );
}

#[test]
fn ssd_offload_keys_are_ignored_with_a_warning() {
    let w = load_str(&format!(
        r#"{{"enable_ssd_offload": true, "ssd_offload_path": "/x", {MASTER}}}"#
    ))
    .unwrap()
    .warnings;
    assert_eq!(
        w,
        vec![
            ConfigWarning::IgnoredSsdOffloadKey {
                key: "enable_ssd_offload".into()
            },
            ConfigWarning::IgnoredSsdOffloadKey {
                key: "ssd_offload_path".into()
            },
        ]
    );
    assert!(
        w[0].to_string()
            .contains("use \"mode\": \"standalone-store\" with \"enable_offload\": true")
    );
}

#[test]
fn vllm_offload_pairing_warnings() {
    let w = load_str(&format!(r#"{{"enable_offload": true, {MASTER}}}"#))
        .unwrap()
        .warnings;
    assert_eq!(
        w,
        vec![ConfigWarning::EmbeddedOffloadWithoutPreferredSegment]
    );
    assert!(
        w[0].to_string()
            .contains("SSD tier will only see puts that happen to land on the owner segment")
    );
    let f = write_file(&format!(r#"{{"enable_offload": true, {MASTER}}}"#));
    let env = env_of(&[("MOONCAKE_PREFERRED_SEGMENT", "10.0.0.5:50052")]);
    assert!(
        MooncakeConfig::load(f.path(), &env)
            .unwrap()
            .warnings
            .is_empty()
    );

    let w = load_str(&format!(
        r#"{{"mode": "standalone-store", "global_segment_size": 0, {MASTER}}}"#
    ))
    .unwrap()
    .warnings;
    assert_eq!(w, vec![ConfigWarning::StandaloneWithoutOffload]);
}

#[test]
fn foreign_metadata_server_warns() {
    let w = load_str(&format!(
        r#"{{"metadata_server": "etcd://10.0.0.1:2379", {MASTER}}}"#
    ))
    .unwrap()
    .warnings;
    assert!(
        matches!(&w[..], [ConfigWarning::MetadataServerIgnored { value, .. }] if value == "etcd://10.0.0.1:2379")
    );
    for ok in ["", "P2PHANDSHAKE"] {
        let w = load_str(&format!(r#"{{"metadata_server": "{ok}", {MASTER}}}"#))
            .unwrap()
            .warnings;
        assert!(w.is_empty());
    }
}

// === environment overrides ===

fn load_env(text: &str, pairs: &[(&str, &str)]) -> Result<Loaded<MooncakeConfig>, ConfigError> {
    let f = write_file(text);
    MooncakeConfig::load(f.path(), &env_of(pairs))
}

#[test]
fn env_overrides_every_field() {
    let loaded = load_env(
        "{}",
        &[
            ("MOONCAKE_MASTER", "10.0.0.1:50051"),
            ("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.7"),
            ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16GB"),
            ("MOONCAKE_LOCAL_BUFFER_SIZE", "1073741824"),
            ("MOONCAKE_PROTOCOL", "tcp"),
            ("MOONCAKE_DEVICE", "mlx5_0"),
            ("MOONCAKE_PREFERRED_SEGMENT", "10.0.0.5:50052"),
        ],
    )
    .unwrap();
    let c = loaded.config;
    assert_eq!(c.master_server_address, "10.0.0.1:50051");
    assert_eq!(c.local_hostname, "10.0.0.7");
    assert_eq!(c.metadata_server, "P2PHANDSHAKE");
    assert_eq!(c.global_segment_size, 16 * GIB);
    assert_eq!(c.local_buffer_size, GIB);
    assert_eq!(c.protocol, Protocol::Tcp);
    assert_eq!(c.device_name, "mlx5_0");
    assert_eq!(
        c.preferred_segment().unwrap(),
        Some(HostPort {
            host: "10.0.0.5".into(),
            port: 50052
        })
    );
    assert!(
        loaded.warnings.is_empty(),
        "nothing in the file was overridden: {:?}",
        loaded.warnings
    );
}

#[test]
fn env_over_file_is_reported() {
    let loaded = load_env(
        r#"{"master_server_address": "127.0.0.1:50051", "global_segment_size": "8GB", "protocol": "rdma"}"#,
        &[("MOONCAKE_MASTER", "10.0.0.1:50051"), ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16GB"), ("MOONCAKE_PROTOCOL", "tcp")],
    )
    .unwrap();
    assert_eq!(loaded.config.master_server_address, "10.0.0.1:50051");
    assert_eq!(loaded.config.global_segment_size, 16 * GIB);
    assert_eq!(loaded.config.protocol, Protocol::Tcp);
    assert_eq!(
        loaded.warnings[0],
        ConfigWarning::EnvOverride {
            var: "MOONCAKE_MASTER",
            field: "master_server_address",
            file_value: "127.0.0.1:50051".into(),
            env_value: "10.0.0.1:50051".into(),
        }
    );
    assert_eq!(
        loaded.warnings[0].to_string(),
        "MOONCAKE_MASTER=10.0.0.1:50051 overrides master_server_address \"127.0.0.1:50051\" from the config file"
    );
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings); // protocol was the default: no warning
}

#[test]
fn local_hostname_precedence() {
    let host = |file: &str, pairs: &[(&str, &str)]| {
        load_env(&format!("{{{file}{MASTER}}}"), pairs)
            .unwrap()
            .config
            .local_hostname
    };
    let file = r#""local_hostname": "file-host", "#;
    assert_eq!(host("", &[]), "");
    assert_eq!(host("", &[("VLLM_HOST_IP", "10.0.0.9")]), "10.0.0.9");
    assert_eq!(host(file, &[("VLLM_HOST_IP", "10.0.0.9")]), "file-host");
    assert_eq!(
        host(file, &[("MOONCAKE_LOCAL_HOSTNAME", "mc-host")]),
        "mc-host"
    );
    assert_eq!(
        host(
            file,
            &[
                ("MOONCAKE_LOCAL_HOSTNAME", "mc-host"),
                ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "req-host")
            ]
        ),
        "req-host"
    );
    assert_eq!(
        host(
            "",
            &[
                ("VLLM_HOST_IP", "10.0.0.9"),
                ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "req-host")
            ]
        ),
        "req-host"
    );
}

#[test]
fn env_values_are_checked_and_named() {
    let e = load_env(
        &format!("{{{MASTER}}}"),
        &[("MOONCAKE_GLOBAL_SEGMENT_SIZE", "lots")],
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("MOONCAKE_GLOBAL_SEGMENT_SIZE: invalid size \"lots\""),
        "{e}"
    );
    let e = load_env(&format!("{{{MASTER}}}"), &[("MOONCAKE_PROTOCOL", "ib")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "MOONCAKE_PROTOCOL 'ib' is not a known protocol; use \"tcp\""
    );
    let e = load_env(
        &format!("{{{MASTER}}}"),
        &[("MOONCAKE_PREFERRED_SEGMENT", "10.0.0.5")],
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "MOONCAKE_PREFERRED_SEGMENT '10.0.0.5' is not a host:port address: the port is missing; write it like \"10.0.0.5:50052\""
    );
    // Env values feed the same vLLM checks.
    let e = load_env(
        &format!("{{{MASTER}}}"),
        &[("MOONCAKE_LOCAL_BUFFER_SIZE", "0")],
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "local_buffer_size must be > 0");
    // An empty value counts as unset.
    let c = load_env(
        &format!("{{{MASTER}}}"),
        &[("MOONCAKE_GLOBAL_SEGMENT_SIZE", "")],
    )
    .unwrap()
    .config;
    assert_eq!(c.global_segment_size, 4 * GIB);
}

#[test]
fn lunakv_disable_shm() {
    let shm = |v: &str| {
        load_env(&format!("{{{MASTER}}}"), &[("LUNAKV_DISABLE_SHM", v)])
            .map(|l| l.config.enable_shm)
    };
    assert!(!shm("1").unwrap());
    assert!(!shm("true").unwrap());
    assert!(shm("0").unwrap());
    let e = shm("maybe").unwrap_err();
    assert_eq!(
        e.to_string(),
        "LUNAKV_DISABLE_SHM 'maybe' is invalid: not a boolean; set LUNAKV_DISABLE_SHM=1 to force tcp, or unset it"
    );
    assert!(
        !load_str(&format!(r#"{{"enable_shm": false, {MASTER}}}"#))
            .unwrap()
            .config
            .enable_shm
    );
}

// === building in code, and writing JSON back ===

#[test]
fn validate_a_struct_built_in_code() {
    let c = MooncakeConfig {
        master_server_address: "127.0.0.1:50051".into(),
        mode: Mode::StandaloneStore,
        global_segment_size: 0,
        enable_offload: true,
        protocol: Protocol::Tcp,
        ..Default::default()
    };
    assert_eq!(c.validate().unwrap(), vec![]);
    let bad = MooncakeConfig {
        local_buffer_size: 0,
        ..c
    };
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "local_buffer_size must be > 0"
    );
}

#[test]
fn json_round_trip() {
    let c = MooncakeConfig {
        master_server_address: "127.0.0.1:50051".into(),
        local_hostname: "127.0.0.1".into(),
        metadata_server: "P2PHANDSHAKE".into(),
        protocol: Protocol::Tcp,
        mode: Mode::StandaloneStore,
        global_segment_size: 0,
        enable_offload: true,
        ..Default::default()
    };
    let json = c.to_json_pretty();
    assert!(json.contains("\"mode\": \"standalone-store\""), "{json}");
    assert!(json.contains("\"protocol\": \"tcp\""), "{json}");
    assert!(json.contains("\"local_buffer_size\": 4294967296"), "{json}");
    let back = MooncakeConfig::from_json_str(&json, "round-trip").unwrap();
    assert_eq!(back.config, c);
    assert!(back.warnings.is_empty(), "{:?}", back.warnings);
}

#[test]
fn from_json_str_does_not_validate() {
    let l = MooncakeConfig::from_json_str(r#"{"local_buffer_size": 0}"#, "inline").unwrap();
    assert_eq!(l.config.local_buffer_size, 0);
    let e = MooncakeConfig::from_json_str("{", "inline").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("inline: invalid JSON at line 1, column 1: EOF while parsing an object"),
        "{e}"
    );
}
