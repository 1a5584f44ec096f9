//! mTLS on the master's and the bootstrap's gRPC ports, and per-client identities (issue 18,
//! item 1; docs/SECURITY.md, "mTLS and identities"), with real binaries on loopback and
//! certificates from a test CA:
//! - a store and the CLI with certificates from the pool's CA work, over gRPC and quick calls,
//!   with the files named by LUNAKV_TLS_* or by the tls_* keys of mooncake_config.json;
//! - a client without a certificate, with one from another CA, or with an expired one is
//!   refused, and both its error and the master's log name the certificate and why;
//! - quick calls go inside the TLS session and refuse the same strangers;
//! - a certificate replaced on disk is served without a restart;
//! - identities: one client cannot unmount another's segment or end or revoke its put, and only
//!   an admin identity may RemoveAll;
//! - the bootstrap's gRPC port: a registration with a certificate works, one without is refused.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lunakv_config::tls::TlsPaths;
use lunakv_proto::bootstrap::bootstrap_client::BootstrapClient;
use lunakv_proto::master as pb;
use lunakv_proto::master::master_client::MasterClient;
use lunakv_proto::quick;
use lunakv_tests::tls::{TestCa, served_certificate};
use lunakv_tests::{Master, Store, child_env, cli, doctor_row, pattern, wait_until};
use lunakv_tls::ClientTls;
use prost::Message;
use tonic::transport::{Channel, Endpoint};

/// The pool's CA, another CA, and the files of each party's certificate in one directory.
struct Pki {
    dir: tempfile::TempDir,
    ca: TestCa,
    other: TestCa,
    ca_file: PathBuf,
}

/// `(cert, key)` paths.
type Files = (PathBuf, PathBuf);

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new();
        let ca_file = ca.write_ca(dir.path(), "ca.crt");
        Pki {
            dir,
            ca,
            other: TestCa::named("another CA"),
            ca_file,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A server certificate (localhost, 127.0.0.1) from the pool's CA, written as `name`.
    fn server(&self, name: &str) -> Files {
        self.ca
            .issue("127.0.0.1".parse().unwrap())
            .write(self.path(), name)
    }

    /// A client certificate for `cn` from the pool's CA, written as `cn`.
    fn client(&self, cn: &str) -> Files {
        self.ca.issue_client(cn).write(self.path(), cn)
    }

    /// The environment of a process with `files` and the pool's CA.
    fn env(&self, files: &Files) -> Vec<(String, String)> {
        vec![
            ("LUNAKV_TLS_CERT".into(), files.0.display().to_string()),
            ("LUNAKV_TLS_KEY".into(), files.1.display().to_string()),
            (
                "LUNAKV_TLS_CACERT".into(),
                self.ca_file.display().to_string(),
            ),
        ]
    }

    /// A master's environment: a server certificate from the pool's CA, the CA, and `extra`.
    fn master_env(&self, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = self.env(&self.server("master"));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    /// A master started with `env` (see [`Pki::master_env`]).
    fn start_master(&self, env: &[(String, String)]) -> Master {
        let _env = child_env(&refs(env));
        Master::start(&self.path().join("data"), &[])
    }

    /// A master with the pool's server certificate and CA, plus `extra` variables.
    fn master(&self, extra: &[(&str, &str)]) -> Master {
        self.start_master(&self.master_env(extra))
    }

    /// A store-client on `addr` whose certificate names `cn`.
    fn store(&self, addr: &str, cn: &str) -> Store {
        let _env = child_env(&refs(&self.env(&self.client(cn))));
        Store::start(addr, "64MB", &[])
    }

    /// `lunakv put key` of `value` through the CLI with `env`; it must succeed.
    fn put(&self, addr: &str, key: &str, value: &[u8], env: &[(String, String)]) {
        let file = self.path().join(format!("value-{key}"));
        std::fs::write(&file, value).unwrap();
        let put = cli(addr, &["put", key, &file.display().to_string()], &refs(env));
        assert!(put.status.success(), "{}", stderr(&put));
    }

    /// Only the CA: TLS, no client certificate.
    fn ca_only(&self) -> Vec<(String, String)> {
        vec![(
            "LUNAKV_TLS_CACERT".into(),
            self.ca_file.display().to_string(),
        )]
    }
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, s)| (k.as_str(), s.as_str())).collect()
}

/// A client's TLS from `env`, as every lunakv client reads it.
fn client_tls(env: &[(String, String)]) -> ClientTls {
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let paths = TlsPaths::client_from_env(&get).expect("client paths");
    ClientTls::from_paths(&paths)
        .expect("client TLS")
        .expect("TLS on")
}

async fn channel(addr: &str, env: &[(String, String)]) -> Result<Channel, String> {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector(client_tls(env).connector(Duration::from_secs(5)))
        .await
        .map_err(|e| {
            lunakv_tls::TlsFailure::in_chain(&e).map_or_else(|| e.to_string(), |f| f.to_string())
        })
}

async fn master_client(addr: &str, env: &[(String, String)]) -> MasterClient<Channel> {
    MasterClient::new(channel(addr, env).await.expect("connect"))
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The CLI's `get` of `key` with `env`: refused, and its message.
fn refused_get(addr: &str, key: &str, env: &[(String, String)]) -> String {
    let o = cli(addr, &["get", key], &refs(env));
    let text = stderr(&o);
    assert!(!o.status.success() && o.stdout.is_empty(), "{text}");
    text
}

/// One quick-call frame on `stream` (magic first) and its answer: `Ok` body, or the status.
fn quick_exists<S: Read + Write>(stream: &mut S, key: &str) -> std::io::Result<Result<(), String>> {
    let body = pb::BatchExistKeyRequest {
        client_id: "quick-test".into(),
        keys: vec![key.into()],
    }
    .encode_to_vec();
    stream.write_all(quick::MAGIC)?;
    stream.write_all(&quick::encode_request(
        quick::Method::BatchExistKey,
        b"",
        &body,
    ))?;
    stream.flush()?;
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix)?;
    let mut answer = vec![0u8; quick::answer_len(prefix).unwrap()];
    stream.read_exact(&mut answer)?;
    Ok(match quick::decode_response(&answer).unwrap() {
        quick::Response::Ok(_) => Ok(()),
        st @ quick::Response::Status { .. } => Err(st.to_string()),
    })
}

fn tcp(addr: &str) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

#[test]
fn a_master_with_mtls_serves_certified_clients_and_refuses_strangers_naming_the_certificate() {
    let pki = Pki::new();
    let master = pki.master(&[]);
    assert!(
        master.proc.output().contains("tls=mtls"),
        "{}",
        master.proc.output()
    );
    let addr = master.addr();
    let _store = pki.store(&addr, "store");

    // A client with a certificate from the pool's CA: put and get, by quick calls and by gRPC.
    let alice = pki.env(&pki.client("alice"));
    let value = pattern(11, 8192);
    pki.put(&addr, "tls-k", &value, &alice);
    let got = cli(&addr, &["get", "tls-k"], &refs(&alice));
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(got.stdout, value);
    let quick_calls = master.metric("master_quick_calls_total").unwrap_or(0.0);
    assert!(
        quick_calls >= 1.0,
        "the CLI's master calls went as quick calls inside TLS"
    );
    let mut grpc_only = alice.clone();
    grpc_only.push(("LUNAKV_QUICK_CALLS".into(), "0".into()));
    let got = cli(&addr, &["get", "tls-k"], &refs(&grpc_only));
    assert_eq!(got.stdout, value, "{}", stderr(&got));
    // An engine's files as tls_* keys of its mooncake_config.json (relative to the file), with
    // no LUNAKV_TLS_* set: what a vLLM pod may use instead of the variables.
    let config = pki.path().join("mooncake_config.json");
    std::fs::write(
        &config,
        serde_json::json!({
            "mode": "standalone-store",
            "master_server_address": addr,
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 0,
            "local_buffer_size": "16MB",
            "protocol": "tcp",
            "tls_cert": "alice.crt",
            "tls_key": "alice.key",
            "tls_cacert": "ca.crt",
        })
        .to_string(),
    )
    .unwrap();
    let got = cli(
        &addr,
        &["get", "tls-k"],
        &[("MOONCAKE_CONFIG_PATH", &config.display().to_string())],
    );
    assert_eq!(got.stdout, value, "{}", stderr(&got));

    // Plaintext: refused, naming the variables to set.
    let text = refused_get(&addr, "tls-k", &[]);
    assert!(
        text.contains("requires mTLS") && text.contains("LUNAKV_TLS_CERT"),
        "{text}"
    );
    // TLS without a client certificate.
    let text = refused_get(&addr, "tls-k", &pki.ca_only());
    assert!(
        text.contains("requires a client certificate") && text.contains("LUNAKV_TLS_CERT"),
        "{text}"
    );
    // A certificate from another CA: the message names its file and subject.
    let mallory_files = pki
        .other
        .issue_client("mallory")
        .write(pki.path(), "mallory");
    let mallory = pki.env(&mallory_files);
    let text = refused_get(&addr, "tls-k", &mallory);
    assert!(
        text.contains(&mallory_files.0.display().to_string())
            && text.contains("CN=mallory")
            && text.contains("not issued by a CA the server trusts"),
        "{text}"
    );
    // An expired certificate from the right CA.
    let old_files = pki.ca.issue_client_expired("old").write(pki.path(), "old");
    let text = refused_get(&addr, "tls-k", &pki.env(&old_files));
    assert!(
        text.contains(&old_files.0.display().to_string())
            && text.contains("CN=old")
            && text.contains("expired"),
        "{text}"
    );
    // The master's log names each refused certificate and why.
    let logged = wait_until(Duration::from_secs(10), || {
        let out = master.proc.output();
        (out.contains("CN=mallory")
            && out.contains("not issued by the CA in")
            && out.contains("CN=old")
            && out.contains("it has expired")
            && out.contains("presented no client certificate"))
        .then_some(())
    });
    assert!(logged.is_some(), "{}", master.proc.output());

    // Quick calls: in the clear they are refused by name; inside TLS a certified client is
    // answered and a stranger's session is refused.
    let plain = quick_exists(&mut tcp(&addr), "tls-k").expect("an answer");
    let refusal = plain.expect_err("a plaintext quick call is refused");
    assert!(
        refusal.contains("requires mTLS") && refusal.contains("LUNAKV_TLS_CERT"),
        "{refusal}"
    );
    let mut s = client_tls(&alice)
        .handshake_blocking(&addr, tcp(&addr))
        .expect("handshake");
    quick_exists(&mut s, "tls-k")
        .expect("an answer")
        .expect("a certified quick call is answered");
    let e = client_tls(&mallory)
        .handshake_blocking(&addr, tcp(&addr))
        .expect_err("the master refuses a stranger's quick session");
    let text = lunakv_tls::TlsFailure::of(&e)
        .expect("explained")
        .to_string();
    assert!(text.contains("CN=mallory"), "{text}");
    let before = master.metric("master_quick_calls_total").unwrap_or(0.0);
    assert!(
        before >= quick_calls + 1.0,
        "the certified quick call was answered as one"
    );

    // `lunakv doctor`'s security row: mTLS on and this client's certificate named; a doctor
    // without one is told what to set; a client with TLS against a plaintext master is told
    // that the two disagree.
    let row = doctor_security(&addr, &alice);
    assert_eq!(row["status"], "pass", "{row}");
    let detail = row["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("mTLS") && detail.contains("\"alice\""),
        "{row}"
    );
    let row = doctor_security(&addr, &[]);
    assert_eq!(row["status"], "warn", "{row}");
    assert!(
        row["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("presents none"),
        "{row}"
    );
    let plain = Master::start(&pki.path().join("plain"), &[]);
    let row = doctor_security(&plain.addr(), &alice);
    assert_eq!(row["status"], "warn", "{row}");
    assert!(
        row["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("serves plaintext"),
        "{row}"
    );
}

/// The `security` row of `lunakv --json doctor` against `addr` with `env`.
fn doctor_security(addr: &str, env: &[(String, String)]) -> serde_json::Value {
    doctor_row(addr, &refs(env), "security")
}

#[test]
fn certificates_replaced_on_disk_are_used_without_a_restart() {
    let pki = Pki::new();
    let first = pki.ca.issue("127.0.0.1".parse().unwrap());
    let master_files = first.write(pki.path(), "master");
    // The master's own copy of the CA for client certificates, swapped below.
    let clients_ca = pki.ca.write_ca(pki.path(), "clients-ca.crt");
    let master = {
        let mut env = pki.env(&master_files);
        env[2].1 = clients_ca.display().to_string();
        let _env = child_env(&refs(&env));
        Master::start(&pki.path().join("data"), &[])
    };
    let alice = pki.ca.issue_client("alice");
    let served = served_certificate(master.rpc, pki.ca.roots(), Some(&alice)).expect("served");
    assert_eq!(served, first.der);

    // No wait for the clock: the files are renamed into place, so the watcher sees a new
    // inode whatever the mtime granularity.
    let second = pki.ca.issue("127.0.0.1".parse().unwrap());
    second.write(pki.path(), "master");
    let reloaded = wait_until(Duration::from_secs(15), || {
        let c = served_certificate(master.rpc, pki.ca.roots(), Some(&alice)).ok()?;
        (c == second.der).then_some(())
    });
    assert!(reloaded.is_some(), "the new certificate was never served");

    // The CA for client certificates too: once its file holds another CA, that CA's clients
    // are admitted and the old one's refused.
    let alice = pki.env(&alice.write(pki.path(), "alice"));
    let mallory = pki.env(
        &pki.other
            .issue_client("mallory")
            .write(pki.path(), "mallory"),
    );
    assert!(status_ok(&master.addr(), &alice));
    assert!(!status_ok(&master.addr(), &mallory));
    let tmp = pki.path().join(".clients-ca.tmp");
    std::fs::write(&tmp, pki.other.ca_pem()).unwrap();
    std::fs::rename(&tmp, &clients_ca).unwrap();
    let swapped = wait_until(Duration::from_secs(15), || {
        (status_ok(&master.addr(), &mallory) && !status_ok(&master.addr(), &alice)).then_some(())
    });
    assert!(swapped.is_some(), "{}", master.proc.output());
}

/// Whether a GetClusterStatus with the TLS of `env` succeeds.
fn status_ok(addr: &str, env: &[(String, String)]) -> bool {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let Ok(ch) = channel(addr, env).await else {
            return false;
        };
        MasterClient::new(ch)
            .get_cluster_status(pb::GetClusterStatusRequest {})
            .await
            .is_ok()
    })
}

#[test]
fn identities_own_their_mounts_and_puts_and_only_an_admin_identity_removes_all() {
    let pki = Pki::new();
    let master = pki.master(&[("LUNAKV_ADMIN_IDENTITIES", "ops")]);
    let addr = master.addr();
    let _store = pki.store(&addr, "store-a");
    let (alice, bob, ops) = (
        pki.env(&pki.client("alice")),
        pki.env(&pki.client("bob")),
        pki.env(&pki.client("ops")),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut a = master_client(&addr, &alice).await;
        let mut b = master_client(&addr, &bob).await;
        let mut o = master_client(&addr, &ops).await;

        // Bob names the store's segment and client id, as GetClusterStatus shows them.
        let status = b
            .get_cluster_status(pb::GetClusterStatusRequest {})
            .await
            .expect("status")
            .into_inner();
        let seg = &status.segments[0];
        let name = seg.segment.as_ref().unwrap().name.clone();
        let e = b
            .unmount_segment(pb::UnmountSegmentRequest {
                client_id: seg.client_id.clone(),
                segment_name: name.clone(),
                instance_id: String::new(),
            })
            .await
            .expect_err("bob unmounts store-a's segment");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(
            e.message().contains("\"store-a\"") && e.message().contains("\"bob\""),
            "{}",
            e.message()
        );

        // Alice reserves a key; bob can neither end nor revoke it; alice ends it.
        let r = a
            .put_start(pb::PutStartRequest {
                client_id: "alice-client".into(),
                key: "alices".into(),
                size: 4096,
                ..Default::default()
            })
            .await
            .expect("put start")
            .into_inner();
        assert_eq!(r.code, 0, "{}", r.message);
        let e = b
            .put_end(pb::PutEndRequest {
                client_id: "alice-client".into(),
                key: "alices".into(),
            })
            .await
            .expect_err("bob ends alice's put");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("\"alice\""), "{}", e.message());
        let e = b
            .batch_put_revoke(pb::BatchKeysRequest {
                client_id: "alice-client".into(),
                keys: vec!["alices".into()],
            })
            .await
            .expect_err("bob revokes alice's put");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let r = a
            .put_end(pb::PutEndRequest {
                client_id: "alice-client".into(),
                key: "alices".into(),
            })
            .await
            .expect("alice ends her put")
            .into_inner();
        assert_eq!(r.code, 0, "{}", r.message);

        // RemoveAll: not for bob, for the admin identity.
        let all = || pb::RemoveAllRequest {
            client_id: "x".into(),
            force: true,
            ..Default::default()
        };
        let e = b.remove_all(all()).await.expect_err("bob removes all");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(
            e.message().contains("LUNAKV_ADMIN_IDENTITIES") && e.message().contains("\"bob\""),
            "{}",
            e.message()
        );
        let still = a
            .exist_key(pb::ExistKeyRequest {
                client_id: "alice-client".into(),
                key: "alices".into(),
            })
            .await
            .expect("exists")
            .into_inner();
        assert_eq!(still.code, 0, "a refused RemoveAll removed alice's object");
        let removed = o
            .remove_all(all())
            .await
            .expect("ops removes all")
            .into_inner();
        assert!(removed.removed >= 1, "{removed:?}");
        // And the admin identity may unmount anyone's segment.
        o.unmount_segment(pb::UnmountSegmentRequest {
            client_id: "ops-client".into(),
            segment_name: name,
            instance_id: String::new(),
        })
        .await
        .expect("ops unmounts store-a's segment");
    });
}

#[test]
fn the_bootstrap_grpc_port_takes_registrations_with_a_certificate_only() {
    let pki = Pki::new();
    let server = pki.server("bootstrap");
    let b = {
        let _env = child_env(&refs(&pki.env(&server)));
        lunakv_tests::pd::Bootstrap::start(
            "127.0.0.1".parse().unwrap(),
            0,
            &["--probe-workers=false"],
        )
    };
    assert!(b.proc.output().contains("tls=mtls"), "{}", b.proc.output());
    let addr = b.grpc.to_string();
    let reg = || lunakv_proto::bootstrap::RegisterRequest {
        worker: Some(lunakv_proto::bootstrap::Worker {
            engine_id: "E".into(),
            dp_rank: 0,
            tp_rank: 0,
            pp_rank: 0,
            addr: "tcp://127.0.0.1:1".into(),
        }),
        lease_ttl_ms: 5000,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let alice = pki.env(&pki.client("alice"));
        let mut c = BootstrapClient::new(channel(&addr, &alice).await.expect("connect"));
        c.register(reg()).await.expect("a certified registration");

        // No client certificate: refused at the handshake, the message says what to set.
        let refused = channel(&addr, &pki.ca_only())
            .await
            .expect_err("connected without a certificate");
        assert!(
            refused.contains("requires a client certificate")
                && refused.contains("LUNAKV_TLS_CERT"),
            "{refused}"
        );

        // Plaintext: health answers (the kubelet's probe), a registration is refused by name.
        let plain = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("plaintext connects");
        let mut h = tonic_health::pb::health_client::HealthClient::new(plain.clone());
        h.check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect("health over plaintext");
        let e = BootstrapClient::new(plain)
            .register(reg())
            .await
            .expect_err("a plaintext registration");
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        assert!(
            e.message().contains("lunakv-bootstrap requires mTLS")
                && e.message().contains("LUNAKV_TLS_CERT"),
            "{}",
            e.message()
        );
    });
    let logged = wait_until(Duration::from_secs(10), || {
        b.proc
            .output()
            .contains("presented no client certificate")
            .then_some(())
    });
    assert!(logged.is_some(), "{}", b.proc.output());
}

/// mTLS without a pool token still closes the forged-inventory route (docs/SECURITY.md,
/// "Verified inventories"): a caller with a good certificate mounts a segment of its own whose
/// inventory claims another engine's key at a higher generation; the master rejects the entry
/// for want of its placement proof, and after a master restart the genuine owner's entries,
/// which carry their proofs, are all indexed again.
#[test]
fn with_mtls_a_certified_callers_forged_inventory_is_rejected() {
    let pki = Pki::new();
    let master_env = pki.master_env(&[]);
    let mut master = pki.start_master(&master_env);
    let addr = master.addr();
    let _store = pki.store(&addr, "store");
    let alice = pki.env(&pki.client("alice"));
    let value = pattern(21, 8192);
    pki.put(&addr, "victim", &value, &alice);

    let mallory = pki.env(&pki.client("mallory"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let resp = rt.block_on(async {
        let mut m = master_client(&addr, &mallory).await;
        let loc = m
            .get_replica_list(pb::GetReplicaListRequest {
                client_id: String::new(),
                key: "victim".into(),
            })
            .await
            .expect("locate")
            .into_inner();
        assert_eq!(loc.code, 0, "{}", loc.message);
        m.mount_segment(pb::MountSegmentRequest {
            client_id: "mallory-client".into(),
            cluster_id: "mooncake_cluster".into(),
            segment: Some(pb::SegmentDescriptor {
                name: "127.0.0.1:9".into(),
                transfer_endpoint: "127.0.0.1:9".into(),
                size: 1 << 20,
                host_id: "elsewhere".into(),
                protocol: "tcp".into(),
                instance_id: "mallory".into(),
                ..Default::default()
            }),
            inventory: vec![pb::InventoryItem {
                key: "victim".into(),
                offset: 0,
                size: value.len() as u64,
                generation: loc.generation + (1 << 40),
                kind: pb::ReplicaKind::Memory as i32,
                proof: vec![0x5A; 16],
            }],
            ..Default::default()
        })
        .await
        .expect("a certified caller may mount")
        .into_inner()
    });
    assert_eq!(
        (resp.accepted_objects, resp.rejected_generations.len()),
        (0, 1)
    );
    assert_eq!(master.metric("master_inventory_unproven_total"), Some(1.0));
    let got = cli(&addr, &["get", "victim"], &refs(&alice));
    assert_eq!(got.stdout, value, "{}", stderr(&got));

    // The genuine entry, after a restart, proves itself.
    {
        let _env = child_env(&refs(&master_env));
        master.restart();
    }
    let got = wait_until(Duration::from_secs(30), || {
        let o = cli(&addr, &["get", "victim"], &refs(&alice));
        o.status.success().then_some(o.stdout)
    })
    .expect("the owner's proven entry is indexed after the restart");
    assert_eq!(got, value);
    assert_eq!(master.metric("master_inventory_unproven_total"), Some(0.0));
}

/// GET `url` with lunakv's HTTP client and the TLS of `env` (`None`: no TLS), with
/// `authorization` when given: (status, body), or the error's text.
fn admin_get(
    url: &str,
    env: Option<&[(String, String)]>,
    authorization: Option<&str>,
) -> Result<(u16, String), String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = lunakv_http::HttpClient::with_tls(Duration::from_secs(5), env.map(client_tls));
        let mut req = lunakv_http::request(hyper::Method::GET, url, bytes::Bytes::new())
            .map_err(|e| e.to_string())?;
        if let Some(a) = authorization {
            req.headers_mut()
                .insert(hyper::header::AUTHORIZATION, a.parse().unwrap());
        }
        let r = client
            .send(req, Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())?;
        Ok((r.status.as_u16(), r.text()))
    })
}

#[test]
fn with_admin_tls_the_admin_port_serves_https_and_admits_an_admin_certificate_or_the_token() {
    const ADMIN: &str = "admin-token-0123456789";
    let pki = Pki::new();
    let master = pki.master(&[
        ("LUNAKV_ADMIN_TLS", "1"),
        ("LUNAKV_ADMIN_IDENTITIES", "ops"),
        ("LUNAKV_ADMIN_TOKEN", ADMIN),
    ]);
    assert!(
        master.proc.output().contains("admin_tls=https"),
        "{}",
        master.proc.output()
    );
    let base = format!("https://{}", master.admin);
    let (anonymous, alice, ops) = (
        pki.ca_only(),
        pki.env(&pki.client("alice")),
        pki.env(&pki.client("ops")),
    );

    // Probes and scrapes: no client certificate needed.
    for path in ["/metrics", "/health", "/role"] {
        let (code, body) = admin_get(&format!("{base}{path}"), Some(&anonymous), None)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(code, 200, "{path}: {body}");
    }
    let (_, metrics) = admin_get(&format!("{base}/metrics"), Some(&anonymous), None).unwrap();
    assert!(metrics.contains("master_"), "{metrics}");

    // The guarded listings: neither certificate nor token is refused, naming both ways in.
    let listing = format!("{base}/get_all_segments");
    let (code, body) = admin_get(&listing, Some(&anonymous), None).unwrap();
    assert_eq!(code, 401, "{body}");
    assert!(
        body.contains("LUNAKV_ADMIN_IDENTITIES") && body.contains("LUNAKV_ADMIN_TOKEN"),
        "{body}"
    );
    // An admin identity's certificate admits them; another identity's is refused by name.
    let (code, body) = admin_get(&listing, Some(&ops), None).unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin_get(&format!("{base}/namespaces"), Some(&alice), None).unwrap();
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains("\"alice\"") && body.contains("LUNAKV_ADMIN_IDENTITIES"),
        "{body}"
    );
    // The admin token, as before, with or without a certificate.
    let bearer = format!("Bearer {ADMIN}");
    let (code, body) = admin_get(&listing, Some(&anonymous), Some(&bearer)).unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin_get(&listing, Some(&alice), Some(&bearer)).unwrap();
    assert_eq!(code, 200, "{body}");

    // A certificate from another CA is refused at the handshake.
    let mallory = pki.env(
        &pki.other
            .issue_client("mallory")
            .write(pki.path(), "mallory"),
    );
    assert!(admin_get(&listing, Some(&mallory), None).is_err());

    // Plaintext HTTP gets a 400 that says what to use, and the master logs it.
    let plain = format!("http://{}/metrics", master.admin);
    let (code, body) = admin_get(&plain, None, None).expect("a plaintext answer");
    assert_eq!(code, 400, "{body}");
    assert!(
        body.contains("HTTPS") && body.contains("LUNAKV_ADMIN_TLS") && body.contains("https://"),
        "{body}"
    );
    let logged = wait_until(Duration::from_secs(5), || {
        master
            .proc
            .output()
            .contains("plaintext HTTP request on the admin port")
            .then_some(())
    });
    assert!(logged.is_some(), "{}", master.proc.output());
    // The master still serves after it.
    assert_eq!(
        admin_get(&format!("{base}/health"), Some(&anonymous), None)
            .unwrap()
            .0,
        200
    );

    // The CLI keeps working against it: status, and doctor's master and security rows.
    let _store = pki.store(&master.addr(), "store");
    let st = cli(&master.addr(), &["status"], &refs(&alice));
    assert!(st.status.success(), "{}", stderr(&st));
    let out = cli(&master.addr(), &["--json", "doctor"], &refs(&alice));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON ({e}): {}", stderr(&out)));
    let row = |name: &str| {
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} row: {v}"))
    };
    assert_eq!(row("master")["status"], "pass", "{v}");
    assert_ne!(row("security")["status"], "fail", "{v}");
}

#[test]
fn admin_tls_without_a_certificate_is_refused_at_start_naming_what_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let args = vec![
        "--rpc_address=127.0.0.1".to_owned(),
        "--rpc_port=0".to_owned(),
        "--metrics_port=0".to_owned(),
        format!("--data_dir={}", dir.path().join("data").display()),
    ];
    let mut p = lunakv_tests::Proc::spawn("lunakv-master", &args, &[("LUNAKV_ADMIN_TLS", "1")]);
    let code = p.wait_exit(Duration::from_secs(30));
    let out = p.output();
    assert!(code.is_some_and(|c| c != 0), "{code:?}: {out}");
    assert!(
        out.contains("LUNAKV_ADMIN_TLS") && out.contains("LUNAKV_TLS_CERT"),
        "{out}"
    );
}

#[test]
fn lunakv_up_with_admin_tls_prints_an_https_metrics_url_that_answers() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let pki = Pki::new();
    // One certificate for the master and, as its client, the store (`up` gives both the same
    // environment); it carries no extended key usage, so it serves either way.
    let env = pki.env(&pki.server("both"));
    let run = pki.path().join("run");
    let mut up = Command::new(lunakv_tests::bin("lunakv"))
        .args(["--json", "up", "--rpc-port=0", "--metrics-port=0"])
        .args([
            "--store-port=0",
            "--store-metrics-port=0",
            "--segment-size=32MB",
        ])
        .arg("--run-dir")
        .arg(&run)
        .env_remove("MOONCAKE_MASTER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .envs(env.iter().cloned())
        .env("LUNAKV_ADMIN_TLS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn lunakv up");
    let mut first = String::new();
    std::io::BufReader::new(up.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("read the ready line");
    let ready: Result<serde_json::Value, _> = serde_json::from_str(&first);
    let url = ready
        .as_ref()
        .ok()
        .and_then(|r| r["metrics_url"].as_str().map(str::to_string));
    let got = url
        .as_deref()
        .map(|u| admin_get(u, Some(&pki.ca_only()), None));
    let _ = Command::new("kill")
        .args(["-TERM", &up.id().to_string()])
        .status();
    let _ = up.wait();
    let url = url.unwrap_or_else(|| panic!("no metrics_url in {first:?}"));
    assert!(url.starts_with("https://"), "{url}");
    let (code, body) = got.unwrap().unwrap_or_else(|e| panic!("{url}: {e}"));
    assert_eq!(code, 200, "{body}");
}

/// `LUNAKV_MOUNT_IDENTITIES`: only the listed identities open segments to placements, so a
/// certified engine cannot mount a segment of its own and have new objects placed (and served)
/// there; the store-client's identity mounts as before.
#[test]
fn with_mount_identities_only_a_listed_identity_mounts() {
    let pki = Pki::new();
    let master = pki.master(&[("LUNAKV_MOUNT_IDENTITIES", "store")]);
    let addr = master.addr();
    let _store = pki.store(&addr, "store");
    let engine = pki.env(&pki.client("engine"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt.block_on(async {
        master_client(&addr, &engine)
            .await
            .mount_segment(pb::MountSegmentRequest {
                client_id: "engine-client".into(),
                cluster_id: "mooncake_cluster".into(),
                segment: Some(pb::SegmentDescriptor {
                    name: "127.0.0.1:9".into(),
                    transfer_endpoint: "127.0.0.1:9".into(),
                    size: 1 << 20,
                    host_id: "elsewhere".into(),
                    protocol: "tcp".into(),
                    instance_id: "engine".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect_err("an engine identity may not mount")
    });
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("\"engine\"") && e.message().contains("LUNAKV_MOUNT_IDENTITIES"),
        "{}",
        e.message()
    );
    // The store's segment is the only one, and a put lands there.
    pki.put(&addr, "k", &pattern(31, 4096), &engine);
}

/// Issue 33 item 6: under mTLS without a token, the plaintext admin port used to list where a
/// key lives (`/query_key`, 200) to anyone, while the RPC port refused that stranger every
/// call. The listings need a credential in every mode: here (no token, no LUNAKV_ADMIN_TLS)
/// they answer 401 naming what to configure; metrics and health stay open.
#[test]
fn under_mtls_without_a_token_the_plaintext_admin_port_lists_nothing() {
    let pki = Pki::new();
    let master = pki.master(&[("LUNAKV_ADMIN_IDENTITIES", "ops")]);
    let addr = master.addr();
    let _store = pki.store(&addr, "store-a");
    pki.put(
        &addr,
        "listed",
        &pattern(3, 4096),
        &pki.env(&pki.client("alice")),
    );
    for path in ["/query_key?key=listed", "/get_all_segments", "/namespaces"] {
        let (code, body) = lunakv_tests::http_get(master.admin, path);
        assert_eq!(code, 401, "{path}: {body}");
        assert!(
            body.contains("LUNAKV_ADMIN_TOKEN") && !body.contains("127.0.0.1:"),
            "{path}: {body}"
        );
    }
    assert_eq!(lunakv_tests::http_get(master.admin, "/metrics").0, 200);
    assert_eq!(lunakv_tests::http_get(master.admin, "/health").0, 200);
}
