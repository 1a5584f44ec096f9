//! Starts the master on 127.0.0.1:0 and drives it with the generated tonic client and plain
//! HTTP requests; also restarts it on the same data_dir, and runs the binary once.

use std::sync::Arc;
use std::time::Duration;

use lunakv_master::core::CoreConfig;
use lunakv_master::notifier::RecordingNotifier;
use lunakv_master::{Master, MasterConfig, RunningMaster, start_master};
use lunakv_meta::RedbMetaStore;
use lunakv_proto::master as pb;
use lunakv_proto::master::master_client::MasterClient;
use tokio::io::AsyncBufReadExt;
use tonic::transport::Channel;

fn config(dir: &std::path::Path) -> MasterConfig {
    MasterConfig {
        rpc_port: 0,
        metrics_port: 0,
        data_dir: dir.to_path_buf(),
        ..MasterConfig::default()
    }
}

async fn start(cfg: MasterConfig) -> (RunningMaster, Arc<RecordingNotifier>) {
    let notifier = Arc::new(RecordingNotifier::default());
    let meta = RedbMetaStore::open(cfg.data_dir.join("meta.redb")).expect("meta");
    let core_cfg = CoreConfig {
        client_ttl: Duration::from_secs(30),
        ..CoreConfig::from_master(&cfg)
    };
    let master = Master::with_core_config(cfg, core_cfg, Arc::new(meta), notifier.clone())
        .await
        .expect("open");
    (start_master(master).await.expect("start"), notifier)
}

async fn client(m: &RunningMaster) -> MasterClient<Channel> {
    MasterClient::connect(m.rpc_url()).await.expect("connect")
}

fn segment(name: &str, size: u64) -> pb::SegmentDescriptor {
    pb::SegmentDescriptor {
        name: name.into(),
        transfer_endpoint: name.into(),
        size,
        host_id: "host".into(),
        protocol: "tcp".into(),
        ..Default::default()
    }
}

async fn mount(
    c: &mut MasterClient<Channel>,
    name: &str,
    inventory: Vec<pb::InventoryItem>,
) -> pb::MountSegmentResponse {
    c.mount_segment(pb::MountSegmentRequest {
        client_id: "client-1".into(),
        cluster_id: "mooncake_cluster".into(),
        segment: Some(segment(name, 1 << 20)),
        inventory,
        inventory_follows: false,
        data_secret: Vec::new(),
    })
    .await
    .expect("mount")
    .into_inner()
}

async fn put(c: &mut MasterClient<Channel>, key: &str, size: u64) -> pb::PutStartResponse {
    c.put_start(pb::PutStartRequest {
        client_id: "client-1".into(),
        key: key.into(),
        size,
        config: None,
        group_id: String::new(),
    })
    .await
    .expect("put_start")
    .into_inner()
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let r = lunakv_http::HttpClient::default()
        .get(
            &format!("http://{addr}{path}"),
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("GET");
    (r.status.as_u16(), r.text())
}

#[tokio::test]
async fn grpc_round_trip_codes_and_admin_routes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (m, notifier) = start(config(dir.path())).await;
    let mut c = client(&m).await;

    let ping = c
        .ping(pb::PingRequest {
            client_id: "client-1".into(),
            touched_keys: vec![],
            ..Default::default()
        })
        .await
        .expect("ping")
        .into_inner();
    assert!(ping.remount_required, "unknown client");

    let out = mount(&mut c, "127.0.0.1:7001", vec![]).await;
    assert_eq!(out.accepted_objects, 0);

    // Put: start, visible only after end.
    let r = put(&mut c, "key-1", 1000).await;
    assert_eq!(r.code, 0, "{}", r.message);
    assert_eq!(r.replicas.len(), 1, "replica_num 0 means 1");
    assert_eq!(r.segments.len(), 1, "a single answer carries its own table");
    let seg = r.segments[r.replicas[0].segment as usize].clone();
    assert_eq!(seg.transfer_endpoint, "127.0.0.1:7001");
    let gen1 = r.generation;
    let miss = c
        .exist_key(pb::ExistKeyRequest {
            client_id: "client-1".into(),
            key: "key-1".into(),
        })
        .await
        .expect("exist")
        .into_inner();
    assert_eq!(miss.code, -704, "in progress = not found");
    assert_eq!(put(&mut c, "key-1", 1000).await.code, -705);
    let end = c
        .put_end(pb::PutEndRequest {
            client_id: "client-1".into(),
            key: "key-1".into(),
        })
        .await
        .expect("end")
        .into_inner();
    assert_eq!(end.code, 0);
    let loc = c
        .get_replica_list(pb::GetReplicaListRequest {
            client_id: "client-1".into(),
            key: "key-1".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!((loc.code, loc.generation, loc.size), (0, gen1, 1000));
    assert_eq!(loc.lease_ttl_ms, 5000);

    // Bad input is a per-item code, and the master keeps serving.
    assert_eq!(put(&mut c, "", 10).await.code, -400);
    let zero = put(&mut c, "z", 0).await;
    assert_eq!(zero.code, -600);
    assert!(zero.message.contains("size 0"), "{}", zero.message);
    assert_eq!(put(&mut c, &"k".repeat(5000), 10).await.code, -400);
    assert_eq!(put(&mut c, "huge", 1 << 30).await.code, -200);

    // Leased: remove refused unless forced; frees reach the owner first.
    let rm = c
        .remove(pb::RemoveRequest {
            client_id: "client-1".into(),
            key: "key-1".into(),
            force: false,
        })
        .await
        .expect("remove")
        .into_inner();
    assert_eq!(rm.code, -706);

    // Batches.
    let keys: Vec<String> = (0..4).map(|i| format!("b{i}")).collect();
    let started = c
        .batch_put_start(pb::BatchPutStartRequest {
            client_id: "client-1".into(),
            items: keys
                .iter()
                .map(|k| pb::PutStartItem {
                    key: k.clone(),
                    size: 100,
                    group_id: String::new(),
                })
                .collect(),
            config: None,
        })
        .await
        .expect("batch start")
        .into_inner();
    assert!(started.results.iter().all(|r| r.code == 0));
    let ended = c
        .batch_put_end(pb::BatchKeysRequest {
            client_id: "client-1".into(),
            keys: keys.clone(),
        })
        .await
        .expect("batch end")
        .into_inner();
    assert!(ended.results.iter().all(|r| r.code == 0));
    let mut with_missing = keys.clone();
    with_missing.push("missing".into());
    let exists = c
        .batch_exist_key(pb::BatchExistKeyRequest {
            client_id: "client-1".into(),
            keys: with_missing,
        })
        .await
        .expect("batch exist")
        .into_inner();
    let codes: Vec<i32> = exists.results.iter().map(|r| r.code).collect();
    assert_eq!(codes, [0, 0, 0, 0, -704]);
    let removed = c
        .batch_remove(pb::BatchRemoveRequest {
            client_id: "client-1".into(),
            keys: keys.clone(),
            force: true,
        })
        .await
        .expect("batch remove")
        .into_inner();
    assert!(removed.results.iter().all(|r| r.code == 0));
    assert_eq!(
        notifier.freed().len(),
        4,
        "every removed replica was freed by its owner"
    );

    // Cluster mismatch is a whole-call error naming both ids.
    let err = c
        .mount_segment(pb::MountSegmentRequest {
            client_id: "x".into(),
            cluster_id: "other".into(),
            segment: Some(segment("127.0.0.1:7002", 100)),
            inventory: vec![],
            inventory_follows: false,
            data_secret: Vec::new(),
        })
        .await
        .expect_err("mismatch");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("mooncake_cluster") && err.message().contains("other"));

    // Admin routes.
    let (status, body) = http_get(m.admin_addr, "/health").await;
    assert_eq!((status, body.as_str()), (200, "OK"));
    let (status, metrics) = http_get(m.admin_addr, "/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "master_allocated_bytes 1024",
        "master_total_capacity_bytes 1048576",
        "master_key_count 1",
        "master_active_clients 1",
        "master_evicted_key_count 0",
        "master_successful_evictions_total 0",
        "master_put_start_alloc_failures_total 0",
        "master_put_start_oversized_total 1",
        "master_put_start_requests_total 6",
        "master_put_start_failures_total 5",
        "master_batch_put_start_requests_total 1",
        "master_remove_failures_total 1",
        "master_mount_segment_failures_total 1",
        "master_ping_requests_total 1",
    ] {
        assert!(metrics.contains(name), "{name} missing in\n{metrics}");
    }
    let (status, segs) = http_get(m.admin_addr, "/get_all_segments").await;
    assert_eq!(status, 200);
    let segs: serde_json::Value = serde_json::from_str(&segs).expect("json");
    assert_eq!(segs[0]["name"], "127.0.0.1:7001");
    assert_eq!(segs[0]["size"], 1 << 20);
    assert_eq!(segs[0]["used"], 1024);
    let (status, q) = http_get(m.admin_addr, "/query_key?key=key-1").await;
    assert_eq!(status, 200);
    let q: serde_json::Value = serde_json::from_str(&q).expect("json");
    assert_eq!(q["generation"], gen1);
    assert_eq!(q["size"], 1000);
    assert_eq!(q["replicas"][0]["segment"], "127.0.0.1:7001");
    let (status, body) = http_get(m.admin_addr, "/query_key?key=nope").await;
    assert_eq!(status, 404);
    assert!(body.contains("not found"), "{body}");
    let (status, _) = http_get(m.admin_addr, "/metrics/summary").await;
    assert_eq!(status, 200);

    let all = c
        .remove_all(pb::RemoveAllRequest {
            client_id: "client-1".into(),
            force: true,
            ..Default::default()
        })
        .await
        .expect("remove all")
        .into_inner();
    assert_eq!(all.removed, 1);
    let status = c
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(status.segments.len(), 1);
    assert_eq!(status.key_count, 0);
    m.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn restart_bumps_epoch_and_rebuilds_from_inventory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (m, _) = start(config(dir.path())).await;
    let mut c = client(&m).await;
    mount(&mut c, "127.0.0.1:7001", vec![]).await;
    let r = put(&mut c, "kept", 100).await;
    let offset = r.replicas[0].offset;
    let gen1 = r.generation;
    m.shutdown().await.expect("shutdown");

    let (m, _) = start(config(dir.path())).await;
    let mut c = client(&m).await;
    let ping = c
        .ping(pb::PingRequest {
            client_id: "client-1".into(),
            touched_keys: vec![],
            ..Default::default()
        })
        .await
        .expect("ping")
        .into_inner();
    assert!(ping.remount_required, "a restarted master knows no client");
    assert_eq!(ping.view_version, (gen1 >> 32) + 1, "epoch bumped");
    let out = mount(
        &mut c,
        "127.0.0.1:7001",
        vec![pb::InventoryItem {
            key: "kept".into(),
            offset,
            size: 100,
            generation: gen1,
            ..Default::default()
        }],
    )
    .await;
    assert_eq!(out.accepted_objects, 1);
    let loc = c
        .get_replica_list(pb::GetReplicaListRequest {
            client_id: "client-1".into(),
            key: "kept".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!((loc.code, loc.generation), (0, gen1));
    let r = put(&mut c, "new", 100).await;
    assert!(
        r.generation >> 32 > gen1 >> 32,
        "new generations come from the new epoch"
    );
    m.shutdown().await.expect("shutdown");

    // The data_dir remembers its cluster.
    let cfg = MasterConfig {
        cluster_id: "other".into(),
        ..config(dir.path())
    };
    let err = Master::open(cfg).await.err().expect("cluster mismatch");
    assert!(err.to_string().contains("mooncake_cluster"), "{err}");
}

#[tokio::test]
async fn binary_prints_its_ports_and_drains_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lunakv-master"))
        .args(["--rpc_port", "0", "--metrics_port", "0", "--data_dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("listening line in time")
        .expect("read")
        .expect("a line");
    assert!(
        line.starts_with("lunakv-master listening rpc=127.0.0.1:"),
        "{line}"
    );
    let admin = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("admin="))
        .and_then(|a| a.parse().ok())
        .expect("admin address");
    assert_eq!(http_get(admin, "/health").await.1, "OK");
    let pid = child.id().expect("pid").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("exits after SIGTERM")
        .expect("wait");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn binary_rejects_bad_config_with_a_clear_message() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_lunakv-master"))
        .args([
            "--eviction_ratio",
            "2",
            "--rpc_port",
            "0",
            "--metrics_port",
            "0",
        ])
        .output()
        .await
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("eviction_ratio = 2") && err.contains("(0, 1]"),
        "{err}"
    );
}

#[tokio::test]
async fn a_segment_mounted_with_a_secret_gets_capabilities_that_verify_under_it() {
    use lunakv_transfer::cap::{RIGHT_READ, RIGHT_WRITE};
    use lunakv_transfer::{Capability, Grant, MountSecret};
    let dir = tempfile::tempdir().expect("tempdir");
    let (m, _) = start(config(dir.path())).await;
    let mut c = client(&m).await;
    let secret = MountSecret::generate();
    let name = "127.0.0.1:7101";
    c.mount_segment(pb::MountSegmentRequest {
        client_id: "client-1".into(),
        cluster_id: "mooncake_cluster".into(),
        segment: Some(segment(name, 1 << 20)),
        data_secret: secret.as_bytes().to_vec(),
        ..Default::default()
    })
    .await
    .expect("mount with a secret");
    let p = put(&mut c, "capped", 4096).await;
    assert_eq!(p.code, 0, "{}", p.message);
    let r = &p.replicas[0];
    assert!(
        p.segments
            .get(r.segment as usize)
            .is_some_and(|s| !format!("{s:?}").contains("secret")),
        "the secret never travels back"
    );
    let g = Grant {
        segment: name,
        generation: p.generation,
        offset: r.offset,
        len: 4096,
    };
    let w = Capability::from_slice(&r.capability).expect("a put placement carries a capability");
    w.verify(&secret, &g, RIGHT_READ | RIGHT_WRITE)
        .expect("read and write for the writer");
    c.put_end(pb::PutEndRequest {
        client_id: "client-1".into(),
        key: "capped".into(),
    })
    .await
    .expect("put_end");
    let l = c
        .get_replica_list(pb::GetReplicaListRequest {
            client_id: "client-2".into(),
            key: "capped".into(),
        })
        .await
        .expect("get_replica_list")
        .into_inner();
    let rd = Capability::from_slice(&l.replicas[0].capability).expect("a read capability");
    rd.verify(&secret, &g, RIGHT_READ).expect("read");
    assert!(
        rd.verify(&secret, &g, RIGHT_WRITE).is_err(),
        "a reader gets no write right"
    );

    // A secret that is not 32 bytes is refused, naming the field.
    let err = c
        .mount_segment(pb::MountSegmentRequest {
            client_id: "client-1".into(),
            cluster_id: "mooncake_cluster".into(),
            segment: Some(segment("127.0.0.1:7102", 1 << 20)),
            data_secret: vec![1; 5],
            ..Default::default()
        })
        .await
        .expect_err("a 5-byte secret");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("data_secret"), "{}", err.message());
}

/// A batch answer names each segment once, in one table, and every replica by its index
/// there: eight objects with two replicas each over two segments send two descriptors, not 16.
#[tokio::test]
async fn batch_answers_carry_one_segment_table() {
    let dir = tempfile::tempdir().expect("tmp");
    let (m, _) = start(config(dir.path())).await;
    let mut c = client(&m).await;
    mount(&mut c, "127.0.0.1:7101", vec![]).await;
    mount(&mut c, "127.0.0.1:7102", vec![]).await;
    let keys: Vec<String> = (0..8).map(|i| format!("tabled-{i}")).collect();
    let started = c
        .batch_put_start(pb::BatchPutStartRequest {
            client_id: "client-1".into(),
            items: keys
                .iter()
                .map(|k| pb::PutStartItem {
                    key: k.clone(),
                    size: 100,
                    group_id: String::new(),
                })
                .collect(),
            config: Some(pb::ReplicateConfig {
                replica_num: 2,
                ..Default::default()
            }),
        })
        .await
        .expect("batch put start")
        .into_inner();
    let names = |table: &[pb::SegmentDescriptor], replicas: &[pb::Replica]| -> Vec<String> {
        let mut n: Vec<String> = replicas
            .iter()
            .map(|r| table[r.segment as usize].name.clone())
            .collect();
        n.sort();
        n
    };
    let both = vec!["127.0.0.1:7101".to_owned(), "127.0.0.1:7102".to_owned()];
    assert_eq!(started.segments.len(), 2, "one descriptor per segment");
    for r in &started.results {
        assert_eq!(r.code, 0, "{}", r.message);
        assert!(
            r.segments.is_empty(),
            "results in a batch use the batch's table"
        );
        assert_eq!(names(&started.segments, &r.replicas), both);
    }
    let ended = c
        .batch_put_end(pb::BatchKeysRequest {
            client_id: "client-1".into(),
            keys: keys.clone(),
        })
        .await
        .expect("batch put end")
        .into_inner();
    assert!(ended.results.iter().all(|r| r.code == 0), "{ended:?}");
    let found = c
        .batch_get_replica_list(pb::BatchGetReplicaListRequest {
            client_id: "client-1".into(),
            keys: keys.clone(),
        })
        .await
        .expect("batch lookup")
        .into_inner();
    assert_eq!(found.segments.len(), 2, "one descriptor per segment");
    for l in &found.results {
        assert_eq!(l.code, 0, "{}", l.message);
        assert!(l.segments.is_empty());
        assert_eq!(names(&found.segments, &l.replicas), both);
    }
    // A single lookup carries its own table.
    let one = c
        .get_replica_list(pb::GetReplicaListRequest {
            client_id: "client-1".into(),
            key: keys[0].clone(),
        })
        .await
        .expect("lookup")
        .into_inner();
    assert_eq!(names(&one.segments, &one.replicas), both);
    m.shutdown().await.expect("shutdown");
}
