//! The master configuration's tests: defaults, layers, checks and upstream's flags.

use std::path::PathBuf;

use super::*;

fn load_flags(flags: &[(&str, &str)]) -> Result<LoadedMasterConfig, MasterConfigError> {
    MasterConfig::load(
        &MasterConfigSources {
            flags: flags
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        },
        &no_env,
    )
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn load_file(path: PathBuf) -> Result<LoadedMasterConfig, MasterConfigError> {
    MasterConfig::load(
        &MasterConfigSources {
            file: Some(path),
            ..Default::default()
        },
        &no_env,
    )
}

fn invalid_field(r: Result<LoadedMasterConfig, MasterConfigError>) -> &'static str {
    match r {
        Err(MasterConfigError::Invalid { field, .. }) => field,
        other => panic!("expected a validation error, got {other:?}"),
    }
}

fn yaml(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("master.yaml");
    std::fs::write(&path, text).expect("write");
    (dir, path)
}

#[test]
fn defaults_match_upstream_and_llm_d() {
    let c = MasterConfig::default();
    assert_eq!(c.rpc_port, 50051);
    assert_eq!(c.metrics_port, 9003);
    assert_eq!(c.rpc_address, "127.0.0.1");
    assert_eq!(c.default_kv_lease_ttl, 5000);
    assert_eq!(c.default_kv_soft_pin_ttl, 1_800_000);
    assert_eq!(c.eviction_ratio, 0.05);
    assert_eq!(c.eviction_high_watermark_ratio, 0.95);
    assert_eq!(c.client_ttl, 10);
    assert_eq!(c.cluster_id, "mooncake_cluster");
    assert_eq!(c.put_start_discard_timeout_sec, 30);
    assert_eq!(c.put_start_release_timeout_sec, 600);
    assert!(!c.enable_offload);
    c.validate().expect("defaults are valid");
    let loaded = MasterConfig::load(&MasterConfigSources::default(), &no_env).expect("load");
    assert_eq!(loaded.config, c);
    assert!(loaded.warnings.is_empty());
}

#[test]
fn llm_d_master_yaml_loads_with_warnings_for_ignored_keys() {
    let (_d, path) = yaml(
        "rpc_port: 50051\nmetrics_port: 9003\nhttp_metadata_server_port: 8080\n\
         default_kv_lease_ttl: 5000\ndefault_kv_soft_pin_ttl: 1800000\neviction_ratio: 0.05\n\
         eviction_high_watermark_ratio: 0.95\nroot_fs_dir: /data/mooncake-offload\n\
         cluster_id: mooncake_cluster\nenable_ha: false\netcd_endpoints: \"h1:2379;h2:2379\"\n",
    );
    let loaded = load_file(path).expect("load");
    assert_eq!(
        loaded.config,
        MasterConfig {
            etcd_endpoints: "h1:2379;h2:2379".into(),
            ..MasterConfig::default()
        }
    );
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
    assert!(loaded.warnings[0].contains("http_metadata_server_port"));
}

#[test]
fn layers_file_then_env_then_flags() {
    let (_d, path) = yaml("rpc_port: 1000\nmetrics_port: 1001\nclient_ttl: 3\n");
    let env = |name: &str| match name {
        "LUNAKV_MASTER_METRICS_PORT" => Some("2001".to_string()),
        "LUNAKV_MASTER_CLIENT_TTL" => Some("4".to_string()),
        "LUNAKV_MASTER_ADDR" => Some("ignored".to_string()),
        _ => None,
    };
    let loaded = MasterConfig::load(
        &MasterConfigSources {
            file: Some(path),
            flags: vec![("client_ttl".into(), "5".into())],
        },
        &env,
    )
    .expect("load");
    assert_eq!(loaded.config.rpc_port, 1000, "file beats default");
    assert_eq!(loaded.config.metrics_port, 2001, "env beats file");
    assert_eq!(loaded.config.client_ttl, 5, "flag beats env");
}

#[test]
fn ha_settings_are_checked_when_enabled() {
    let c = load_flags(&[
        ("enable_ha", "true"),
        ("etcd_endpoints", "etcd://h1:2379;h2:2379"),
    ])
    .expect("load")
    .config;
    assert!(c.enable_ha);
    assert_eq!(c.etcd().expect("endpoints").to_string(), "h1:2379;h2:2379");
    let e = load_flags(&[("enable_ha", "true")]).expect_err("no endpoints");
    assert!(e.to_string().contains("--etcd_endpoints="), "{e}");
    let e = load_flags(&[("enable_ha", "true"), ("etcd_endpoints", "h1:2379;;h2")])
        .expect_err("malformed");
    assert!(e.to_string().contains("etcd_endpoints"), "{e}");
    assert!(e.to_string().contains("h1:2379;h2:2379"), "{e}");
    let e = load_flags(&[
        ("enable_ha", "true"),
        ("etcd_endpoints", "h1:2379"),
        ("ha_backend_type", "redis"),
    ])
    .expect_err("redis");
    assert!(e.to_string().contains("only etcd"), "{e}");
    let e = load_flags(&[
        ("enable_ha", "true"),
        ("etcd_endpoints", "h1:2379"),
        ("rpc_address", "0.0.0.0"),
    ])
    .expect_err("wildcard");
    assert!(e.to_string().contains("--advertise_address"), "{e}");
}

#[test]
fn allocation_strategy_takes_upstreams_two_placements_and_names_the_rest() {
    assert_eq!(
        MasterConfig::default().allocation_strategy(),
        AllocationStrategy::Random
    );
    let c = load_flags(&[("allocation_strategy", "free_ratio_first")])
        .expect("load")
        .config;
    assert_eq!(c.allocation_strategy(), AllocationStrategy::FreeRatioFirst);
    for bad in ["cxl", "ssd_free_ratio_first", "Random"] {
        let e = load_flags(&[("allocation_strategy", bad)]).expect_err(bad);
        let msg = e.to_string();
        assert!(
            msg.contains("allocation_strategy")
                && msg.contains(bad)
                && msg.contains("free_ratio_first"),
            "{msg}"
        );
    }
}

#[test]
fn string_keys_stay_strings_from_env_and_flags() {
    let c = load_flags(&[("cluster_id", "123"), ("enable_offload", "true")])
        .expect("load")
        .config;
    assert_eq!(c.cluster_id, "123");
    assert!(c.enable_offload);
}

#[test]
fn unknown_key_is_an_error_with_suggestions() {
    let (_d, path) = yaml("rpc_prot: 50051\n");
    let err = load_file(path).expect_err("unknown key");
    let msg = err.to_string();
    assert!(msg.contains("\"rpc_prot\""), "{msg}");
    assert!(msg.contains("did you mean rpc_port"), "{msg}");
    let env = |name: &str| (name == "LUNAKV_MASTER_EVICTION_RATIO").then(|| "lots".to_string());
    let err = MasterConfig::load(&MasterConfigSources::default(), &env).expect_err("bad env value");
    let msg = err.to_string();
    assert!(
        msg.contains("LUNAKV_MASTER_EVICTION_RATIO") && msg.contains("lots"),
        "{msg}"
    );
    let err = load_flags(&[("zzz", "1")]).expect_err("unknown");
    assert!(err.to_string().contains("valid keys: rpc_port"), "{err}");
}

#[test]
fn bad_values_name_key_value_and_source() {
    let err = load_flags(&[("rpc_port", "fifty")]).expect_err("bad number");
    let msg = err.to_string();
    assert!(
        msg.contains("rpc_port") && msg.contains("fifty") && msg.contains("--rpc_port"),
        "{msg}"
    );
    let err = load_flags(&[("enable_offload", "\"false\"")]).expect_err("bad bool");
    assert!(err.to_string().contains("write true or false"), "{err}");
    let err = load_flags(&[("rpc_port", "70000")]).expect_err("port out of range");
    assert!(err.to_string().contains("rpc_port"), "{err}");
    let (_d, path) = yaml("client_ttl: [1]\n");
    let err = load_file(path).expect_err("type error");
    assert!(err.to_string().contains("client_ttl"), "{err}");
}

#[test]
fn malformed_and_non_mapping_files_are_errors() {
    let (_d, path) = yaml("rpc_port: [\n");
    let err = load_file(path.clone()).expect_err("bad yaml");
    assert!(matches!(err, MasterConfigError::Parse { .. }), "{err}");
    std::fs::write(&path, "- a\n- b\n").expect("write");
    let err = load_file(path.clone()).expect_err("list");
    assert!(err.to_string().contains("must be a mapping"), "{err}");
    std::fs::write(&path, "").expect("write");
    load_file(path).expect("an empty file is the defaults");
    let err = load_file(PathBuf::from("/nonexistent/master.yaml")).expect_err("missing file");
    assert!(
        err.to_string().contains("/nonexistent/master.yaml"),
        "{err}"
    );
}

#[test]
fn ratios_must_be_in_zero_one() {
    for bad in ["0", "1.5", "-0.1", "NaN"] {
        assert_eq!(
            invalid_field(load_flags(&[("eviction_ratio", bad)])),
            "eviction_ratio"
        );
        assert_eq!(
            invalid_field(load_flags(&[("eviction_high_watermark_ratio", bad)])),
            "eviction_high_watermark_ratio"
        );
    }
    load_flags(&[
        ("eviction_ratio", "1"),
        ("eviction_high_watermark_ratio", "1.0"),
    ])
    .expect("1 is allowed");
    let msg = load_flags(&[("eviction_ratio", "0")])
        .expect_err("zero")
        .to_string();
    assert!(
        msg.contains("eviction_ratio = 0") && msg.contains("(0, 1]"),
        "{msg}"
    );
}

#[test]
fn ttls_must_be_positive() {
    for field in [
        "default_kv_lease_ttl",
        "default_kv_soft_pin_ttl",
        "client_ttl",
        "put_start_discard_timeout_sec",
    ] {
        assert_eq!(invalid_field(load_flags(&[(field, "0")])), field);
    }
    // max_kv_soft_pin_ttl = 0 is caught either as non-positive or below the default.
    assert_eq!(
        invalid_field(load_flags(&[("max_kv_soft_pin_ttl", "0")])),
        "max_kv_soft_pin_ttl"
    );
    assert_eq!(
        invalid_field(load_flags(&[
            ("put_start_release_timeout_sec", "0"),
            ("put_start_discard_timeout_sec", "1")
        ])),
        "put_start_release_timeout_sec"
    );
}

#[test]
fn soft_pin_max_must_cover_default() {
    let msg = load_flags(&[("max_kv_soft_pin_ttl", "1000")])
        .expect_err("max < default")
        .to_string();
    assert!(
        msg.contains("max_kv_soft_pin_ttl = 1000") && msg.contains("1800000"),
        "{msg}"
    );
}

#[test]
fn release_timeout_must_cover_discard_timeout() {
    assert_eq!(
        invalid_field(load_flags(&[
            ("put_start_discard_timeout_sec", "60"),
            ("put_start_release_timeout_sec", "30")
        ])),
        "put_start_release_timeout_sec"
    );
    load_flags(&[
        ("put_start_discard_timeout_sec", "1"),
        ("put_start_release_timeout_sec", "1"),
    ])
    .expect("equal is fine");
}

#[test]
fn ports_and_address_are_checked() {
    assert_eq!(
        invalid_field(load_flags(&[
            ("rpc_port", "7000"),
            ("metrics_port", "7000")
        ])),
        "metrics_port"
    );
    load_flags(&[("rpc_port", "0"), ("metrics_port", "0")]).expect("ephemeral ports for tests");
    let msg = load_flags(&[("rpc_address", "localhost:1")])
        .expect_err("not an ip")
        .to_string();
    assert!(
        msg.contains("rpc_address") && msg.contains("0.0.0.0"),
        "{msg}"
    );
    load_flags(&[("rpc_address", "::1")]).expect("ipv6");
}

#[test]
fn cluster_id_and_data_dir_must_be_set() {
    assert_eq!(
        invalid_field(load_flags(&[("cluster_id", " ")])),
        "cluster_id"
    );
    assert_eq!(invalid_field(load_flags(&[("data_dir", "")])), "data_dir");
}

#[test]
fn offload_is_a_real_switch_and_promotion_needs_it() {
    let loaded =
        load_flags(&[("enable_offload", "true"), ("promotion_on_hit", "true")]).expect("load");
    assert!(loaded.config.enable_offload && loaded.config.promotion_on_hit);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let loaded = load_flags(&[("promotion_on_hit", "true")]).expect("load");
    assert!(loaded.warnings.iter().any(|w| w.contains("enable_offload")));
}

#[test]
fn promotion_admission_takes_upstreams_range_and_is_no_longer_ignored() {
    let c = load_flags(&[]).expect("defaults").config;
    assert_eq!(
        (c.promotion_admission_threshold, c.promotion_queue_limit),
        (2, 50_000)
    );
    let loaded = load_flags(&[
        ("promotion_admission_threshold", "1"),
        ("promotion_queue_limit", "8"),
    ])
    .expect("load");
    assert_eq!(loaded.config.promotion_admission_threshold, 1);
    assert_eq!(loaded.config.promotion_queue_limit, 8);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    for bad in ["0", "256"] {
        let msg = load_flags(&[("promotion_admission_threshold", bad)])
            .expect_err(bad)
            .to_string();
        assert!(
            msg.contains("promotion_admission_threshold") && msg.contains("255"),
            "{msg}"
        );
    }
    assert_eq!(
        invalid_field(load_flags(&[("promotion_queue_limit", "0")])),
        "promotion_queue_limit"
    );
}

#[test]
fn kv_event_settings_are_checked_only_when_enabled() {
    let loaded = load_flags(&[("kv_event_publisher_endpoint", "nonsense")]).expect("off");
    assert!(!loaded.config.enable_kv_event_publish);
    let loaded = load_flags(&[("enable_kv_event_publish", "true")]).expect("defaults");
    assert_eq!(loaded.config.kv_event_publisher_topic, "mooncake");
    assert_eq!(loaded.config.kv_event_publisher_max_batch_size, 50);
    let err = load_flags(&[
        ("enable_kv_event_publish", "true"),
        ("kv_event_publisher_endpoint", "127.0.0.1:19997"),
    ])
    .expect_err("no scheme");
    let msg = err.to_string();
    assert!(
        msg.contains("kv_event_publisher_endpoint") && msg.contains("tcp://"),
        "{msg}"
    );
    let err = load_flags(&[
        ("enable_kv_event_publish", "true"),
        ("kv_events_vllm_pods", "10.0.0.5:8000,pod-b"),
    ])
    .expect_err("pod without a port");
    assert!(err.to_string().contains("\"pod-b\""), "{err}");
    let err = load_flags(&[
        ("enable_kv_event_publish", "true"),
        ("kv_event_publisher_max_queue_size", "0"),
    ])
    .expect_err("empty queue");
    assert!(
        err.to_string()
            .contains("kv_event_publisher_max_queue_size")
    );
    let loaded = load_flags(&[("kv_event_publisher_auto_port", "false")]).expect("ignored");
    assert!(
        loaded
            .warnings
            .iter()
            .any(|w| w.contains("kv_event_publisher_auto_port"))
    );
}

#[test]
fn event_formats_default_to_todays_consumers_and_refuse_unknown_values() {
    let c = MasterConfig::default();
    assert_eq!(
        (
            c.kv_events_vllm_format.as_str(),
            c.kv_events_vllm_int_hashes,
            c.kv_events_vllm_medium_dram.as_str(),
            c.kv_events_vllm_medium_ssd.as_str(),
            c.kv_events_mooncake_format.as_str(),
        ),
        ("tagged", true, "CPU", "STORAGE", "rfc1527")
    );
    assert_eq!(
        (
            c.kv_events_emit_legacy_compat,
            c.kv_events_emit_object_key,
            c.kv_events_queue_capacity
        ),
        (true, true, 65536),
        "upstream main's defaults"
    );
    for (key, value, fix) in [
        ("kv_events_vllm_format", "map", "tagged"),
        ("kv_events_mooncake_format", "rfc", "rfc1527"),
        (
            "kv_events_vllm_served_model_name",
            "a=b,c",
            "key_model=served",
        ),
        ("kv_events_vllm_served_model_name", "org@model", "'@'"),
        ("kv_events_bind_endpoint", "0.0.0.0:5557", "tcp://"),
    ] {
        let err =
            load_flags(&[("enable_kv_event_publish", "true"), (key, value)]).expect_err(value);
        let msg = err.to_string();
        assert!(
            msg.contains(key) && msg.contains(value) && msg.contains(fix),
            "{msg}"
        );
    }
}

#[test]
fn served_model_names_apply_to_every_key_or_per_key_model() {
    assert_eq!(ServedModelNames::parse(" "), Ok(ServedModelNames::FromKey));
    let all = ServedModelNames::parse("Qwen/Qwen3-8B").expect("one name");
    assert_eq!(all.served("Qwen3-8B"), "Qwen/Qwen3-8B");
    let map = ServedModelNames::parse("Qwen3-8B=Qwen/Qwen3-8B, m = org/m").expect("pairs");
    assert_eq!(map.served("Qwen3-8B"), "Qwen/Qwen3-8B");
    assert_eq!(map.served("m"), "org/m");
    assert_eq!(
        map.served("other"),
        "other",
        "unlisted keys keep their model"
    );
    assert!(ServedModelNames::parse("=x").is_err());
}

#[test]
fn upstream_mains_enable_kv_events_key_works_in_master_yaml() {
    let (_dir, path) = yaml("enable_kv_events: true\nkv_events_backend_id: pool-a\n");
    let c = load_file(path).expect("loads").config;
    assert!(c.enable_kv_event_publish);
    assert_eq!(c.kv_events_backend_id, "pool-a");
}

/// Upstream main's event command line (mooncake-store-deployment-guide.md, "KV Cache
/// Event Publisher") starts lunakv-master with every flag taken, none ignored or refused.
#[test]
fn upstream_mains_event_flags_are_taken_with_their_values() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: MasterArgs,
    }
    let cli = Cli::parse_from([
        "mooncake_master",
        "--enable_kv_events",
        "--kv_events_bind_endpoint=tcp://0.0.0.0:5557",
        "--kv_events_backend_id=store-node-1",
        "--kv_events_emit_legacy_compat=false",
        "--kv_events_emit_object_key=true",
        "--kv_events_queue_capacity=0",
    ]);
    let s = cli.args.sources();
    let flags: Vec<(&str, &str)> = s.flags.iter().map(|(k, v)| (&**k, &**v)).collect();
    let loaded = load_flags(&flags).expect("starts");
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let c = loaded.config;
    assert!(c.enable_kv_event_publish);
    assert_eq!(
        c.kv_events_mooncake_endpoint(),
        ("kv_events_bind_endpoint", "tcp://0.0.0.0:5557")
    );
    assert_eq!(c.kv_events_backend_id, "store-node-1");
    assert!(!c.kv_events_emit_legacy_compat && c.kv_events_emit_object_key);
    assert_eq!(c.kv_events_queue_capacity, 0);
    assert_eq!(
        MasterConfig::default().kv_events_mooncake_endpoint(),
        ("kv_event_publisher_endpoint", "tcp://127.0.0.1:19997")
    );
}

#[test]
fn every_flag_of_upstreams_master_is_ours_or_judged() {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: MasterArgs,
    }
    // Every DEFINE_* of kvcache-ai/Mooncake mooncake-store/src/master.cpp at 3b5a594
    // (2026-08-22): each must be a lunakv flag (or alias) or in UPSTREAM_KEYS, so an
    // upstream command line never meets a bare "unexpected argument".
    const UPSTREAM: &[&str] = &[
        "allow_evict_soft_pinned_objects",
        "batch_oplog_retry_timeout_sec",
        "cluster_id",
        "config_path",
        "cxl_path",
        "cxl_size",
        "default_kv_lease_ttl",
        "default_kv_soft_pin_ttl",
        "dynamic_replication_heat_window_seconds",
        "dynamic_replication_mode",
        "enable_cxl",
        "enable_disk_eviction",
        "enable_ha",
        "enable_http_metadata_server",
        "enable_kv_events",
        "enable_metric_reporting",
        "enable_multi_tenants",
        "enable_offload",
        "enable_oplog",
        "enable_snapshot",
        "enable_snapshot_restore",
        "eviction_high_watermark_ratio",
        "eviction_ratio",
        "global_file_segment_size",
        "ha_backend_connstring",
        "ha_backend_type",
        "http_metadata_server_host",
        "http_metadata_server_port",
        "kv_events_additional_salt",
        "kv_events_backend_id",
        "kv_events_bind_endpoint",
        "kv_events_block_size",
        "kv_events_dp_rank",
        "kv_events_emit_legacy_compat",
        "kv_events_emit_object_key",
        "kv_events_lora_name",
        "kv_events_model_name",
        "kv_events_queue_capacity",
        "kv_events_tenant_id",
        "max_kv_soft_pin_ttl",
        "max_retry_attempts",
        "max_total_finished_tasks",
        "max_total_pending_tasks",
        "max_total_processing_tasks",
        "memory_allocator",
        "metrics_host",
        "metrics_port",
        "nof_eviction_high_watermark_ratio",
        "nof_eviction_ratio",
        "nof_heartbeat_interval_sec",
        "nof_heartbeat_probe_timeout_ms",
        "offload_cap_ratio",
        "offload_force_evict",
        "offload_on_evict",
        "offloading_queue_limit",
        "oplog_batch_max_entries",
        "oplog_poll_interval_ms",
        "pending_task_timeout_sec",
        "pod_name",
        "pod_namespace",
        "port",
        "processing_task_timeout_sec",
        "promotion_admission_threshold",
        "promotion_max_per_heartbeat",
        "promotion_on_hit",
        "promotion_queue_limit",
        "put_start_discard_timeout_sec",
        "put_start_release_timeout_sec",
        "root_fs_dir",
        "rpc_address",
        "rpc_conn_timeout_seconds",
        "rpc_enable_tcp_no_delay",
        "rpc_interface",
        "rpc_thread_num",
        "snapshot_backup_dir",
        "snapshot_catalog_backend_connstring",
        "snapshot_catalog_backend_type",
        "snapshot_catalog_store_connstring",
        "snapshot_catalog_store_type",
        "snapshot_child_timeout_seconds",
        "snapshot_interval_seconds",
        "snapshot_object_store_type",
        "snapshot_payload_backend_type",
        "snapshot_payload_store_type",
        "snapshot_retention_count",
        "tenant_quota_connector_type",
        "tenant_quota_connector_uri",
    ];
    let cmd = Cli::command();
    let ours: Vec<String> = cmd
        .get_arguments()
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().into_iter().flatten())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    let missing: Vec<&str> = UPSTREAM
        .iter()
        .copied()
        .filter(|f| !ours.iter().any(|o| o == f))
        .filter(|f| !UPSTREAM_KEYS.iter().any(|u| u.name == *f))
        .collect();
    assert!(
        missing.is_empty(),
        "upstream flags lunakv neither takes nor judges: {missing:?}"
    );
}

#[test]
fn args_become_the_flag_layer() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: MasterArgs,
    }
    let cli = Cli::parse_from([
        "m",
        "--config=/x.yaml",
        "--rpc_port=7",
        "--eviction_ratio=0.5",
        "--enable_offload",
        "--data_dir=/d",
    ]);
    let s = cli.args.sources();
    assert_eq!(s.file, Some(PathBuf::from("/x.yaml")));
    let flags: Vec<(&str, &str)> = s.flags.iter().map(|(k, v)| (&**k, &**v)).collect();
    assert_eq!(
        flags,
        [
            ("rpc_port", "7"),
            ("eviction_ratio", "0.5"),
            ("data_dir", "/d"),
            ("enable_offload", "true")
        ]
    );
    let c = load_flags(&flags).expect("load").config;
    assert_eq!((c.rpc_port, c.eviction_ratio), (7, 0.5));
    assert!(c.enable_offload);
}

#[test]
fn the_key_table_is_the_config_and_the_flags() {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: MasterArgs,
    }
    let serialized: Vec<String> = match serde_norway::to_value(MasterConfig::default()) {
        Ok(serde_norway::Value::Mapping(m)) => m
            .into_iter()
            .filter_map(|(k, _)| k.as_str().map(str::to_string))
            .collect(),
        other => panic!("{other:?}"),
    };
    let names: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
    assert_eq!(
        serialized, names,
        "the file and env keys are the table's, in its order"
    );
    let cmd = Cli::command();
    for key in KEYS {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key.name))
            .unwrap_or_else(|| panic!("--{} is a flag", key.name));
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        let default = MasterConfig::default_text(key.name).expect("every key has a default");
        match key.shown {
            crate::key_table::Shown::Value | crate::key_table::Shown::Note(_) => assert!(
                help.contains(&format!("[default: {default}")),
                "--{}: {help}",
                key.name
            ),
            // A described default stands for an empty value that falls back to something else.
            crate::key_table::Shown::Text(_) => assert_eq!(default, "", "--{}", key.name),
            crate::key_table::Shown::Hidden => assert!(!help.contains("[default:"), "{help}"),
        }
    }
}
