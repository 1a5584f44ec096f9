//! The pool token and the admin token (issue 18, item 1 in part; docs/SECURITY.md): a master
//! started with them refuses callers without the token, refuses RemoveAll to the pool token,
//! guards the admin port's listings, and keeps health and metrics open. Stores, the CLI and
//! engines present the token from their environment. Real binaries on loopback; the "attacker"
//! is a raw gRPC client, as a stranger's would be.

use lunakv_proto::master::RemoveAllRequest;
use lunakv_proto::master::master_client::MasterClient;
use lunakv_tests::{Master, Store, child_env, cli, doctor_row, http_get, pattern};

const POOL: &str = "pool-0123456789abcdef0123456789";
const ADMIN: &str = "admin-0123456789abcdef012345678";

/// RemoveAll from a raw gRPC client with `token` (or none) as a bearer token.
fn remove_all(addr: &str, token: Option<&str>) -> Result<u64, tonic::Status> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = MasterClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let mut req = tonic::Request::new(RemoveAllRequest {
            client_id: "00000000-0000-0000-0000-000000000bad".into(),
            force: true,
            ..Default::default()
        });
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        c.remove_all(req).await.map(|r| r.into_inner().removed)
    })
}

#[test]
fn a_master_with_tokens_admits_only_holders_and_remove_all_only_the_admin() {
    let dir = tempfile::tempdir().unwrap();
    let master = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL), ("LUNAKV_ADMIN_TOKEN", ADMIN)]);
        Master::start(dir.path(), &[])
    };
    let addr = master.addr();
    // A store with the pool token mounts its segment.
    let _store = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
        Store::start(&addr, "64MB", &[])
    };
    let value = pattern(7, 8192);
    let file = dir.path().join("v");
    std::fs::write(&file, &value).unwrap();
    let file = file.display().to_string();

    let put = cli(
        &addr,
        &["put", "guarded", &file],
        &[("LUNAKV_AUTH_TOKEN", POOL)],
    );
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    let got = cli(&addr, &["get", "guarded"], &[("LUNAKV_AUTH_TOKEN", POOL)]);
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(got.stdout, value);

    // No token: refused, the message names the variable; nothing is read.
    let anon = cli(&addr, &["get", "guarded"], &[]);
    let text = String::from_utf8_lossy(&anon.stderr);
    assert!(!anon.status.success() && anon.stdout.is_empty(), "{text}");
    assert!(text.contains("LUNAKV_AUTH_TOKEN"), "{text}");
    // A wrong token: refused as such.
    let wrong = cli(
        &addr,
        &["get", "guarded"],
        &[("LUNAKV_AUTH_TOKEN", "not-the-pool-token-0000000")],
    );
    let text = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success(), "{text}");
    assert!(text.contains("refused this client's token"), "{text}");

    // RemoveAll: a stranger and the pool token are refused, and the object survives both.
    let e = remove_all(&addr, None).expect_err("no token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let e = remove_all(&addr, Some(POOL)).expect_err("pool token");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("LUNAKV_ADMIN_TOKEN"),
        "{}",
        e.message()
    );
    let still = cli(&addr, &["get", "guarded"], &[("LUNAKV_AUTH_TOKEN", POOL)]);
    assert_eq!(
        still.stdout, value,
        "a refused RemoveAll removed the object"
    );

    // The admin port: listings need a token, metrics and health do not.
    let (code, _) = http_get(master.admin, "/query_key?key=guarded");
    assert_eq!(code, 401, "/query_key without a token");
    let (code, _) = http_get(master.admin, "/get_all_segments");
    assert_eq!(code, 401, "/get_all_segments without a token");
    assert_eq!(http_get(master.admin, "/metrics").0, 200);
    assert_eq!(http_get(master.admin, "/health").0, 200);

    // The admin token removes everything.
    let removed = remove_all(&addr, Some(ADMIN)).expect("admin token");
    assert!(removed >= 1, "removed {removed}");
    let gone = cli(&addr, &["get", "guarded"], &[("LUNAKV_AUTH_TOKEN", POOL)]);
    assert!(!gone.status.success());
}

/// `lunakv doctor`'s security row asks the master itself: one status call without credentials.
/// A master started with the pool token turns it away (its owners then require capabilities);
/// one started without answers it, which on loopback is fine and said as such.
#[test]
fn doctor_tells_a_master_that_requires_the_token_from_one_that_does_not() {
    let row = |addr: &str, env: &[(&str, &str)]| doctor_row(addr, env, "security");
    let dir = tempfile::tempdir().unwrap();
    let guarded = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
        Master::start(&dir.path().join("guarded"), &[])
    };
    let r = row(&guarded.addr(), &[("LUNAKV_AUTH_TOKEN", POOL)]);
    assert_eq!(r["status"], "pass", "{r}");
    assert!(
        r["detail"]
            .as_str()
            .unwrap()
            .contains("refuses callers without the pool token"),
        "{r}"
    );
    let open = Master::start(&dir.path().join("open"), &[]);
    let r = row(&open.addr(), &[]);
    assert_eq!(r["status"], "pass", "{r}");
    assert!(
        r["detail"].as_str().unwrap().contains("asks no token"),
        "{r}"
    );
}

/// Issue 33 item 5: `ReplicateIndex` streams every store's 32-byte mount secret (with it, a
/// caller forges the master's FREE and any capability). With only the pool token set, an HA
/// master used to answer a pool-token holder with those secrets. Now the pool token never
/// admits that call (PERMISSION_DENIED, naming the admin token), a stranger gets
/// UNAUTHENTICATED, and a warm-standby master without an admin credential refuses to start,
/// naming `LUNAKV_ADMIN_TOKEN`, since its standbys could not follow.
#[test]
fn a_pool_token_holder_never_gets_the_mount_secrets_from_replicate_index() {
    use lunakv_proto::master::ReplicateIndexRequest;

    let Some(etcd) = lunakv_meta::testing::etcd_or_skip() else {
        return;
    };
    let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start_ha(&dir.path().join("m"), &etcd.endpoint(), &[]);
    lunakv_tests::wait_until(std::time::Duration::from_secs(20), || {
        (master.role().as_deref() == Some("leader")).then_some(())
    })
    .expect("the master leads");
    // A store with the pool token mounts: it draws a mount secret and sends it to the master.
    let _store = Store::start(&etcd.etcd_url(), "64MB", &["--enable_shm=false"]);

    let replicate = |token: Option<&str>| -> Result<usize, tonic::Status> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let mut c = MasterClient::connect(format!("http://{}", master.addr()))
                .await
                .unwrap();
            let mut req = tonic::Request::new(ReplicateIndexRequest {
                standby: "attacker".into(),
            });
            if let Some(t) = token {
                req.metadata_mut()
                    .insert("authorization", format!("Bearer {t}").parse().unwrap());
            }
            let mut stream = c.replicate_index(req).await?.into_inner();
            // The snapshot: count the secrets it hands out.
            let mut secrets = 0;
            while let Ok(Ok(Some(u))) =
                tokio::time::timeout(std::time::Duration::from_secs(5), stream.message()).await
            {
                secrets += u
                    .mounted
                    .iter()
                    .filter(|m| !m.data_secret.is_empty())
                    .count();
                if u.snapshot_done {
                    break;
                }
            }
            Ok(secrets)
        })
    };
    match replicate(Some(POOL)) {
        Ok(n) => panic!("a pool-token holder was streamed the index ({n} mount secrets)"),
        Err(e) => {
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            assert!(
                e.message().contains("LUNAKV_ADMIN_TOKEN"),
                "{}",
                e.message()
            );
        }
    }
    let e = replicate(None).expect_err("a stranger");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");

    // A warm-standby master with only the pool token: its standbys could not follow.
    let mut warm = lunakv_tests::Proc::spawn(
        "lunakv-master",
        &[
            "--rpc_address=127.0.0.1".into(),
            "--rpc_port=0".into(),
            "--metrics_port=0".into(),
            format!("--data_dir={}", dir.path().join("w").display()),
            "--enable_ha=true".into(),
            "--ha_warm_standby=true".into(),
            format!("--etcd_endpoints={}", etcd.endpoint()),
        ],
        &[],
    );
    let code = warm.wait_exit(std::time::Duration::from_secs(30));
    let out = warm.output();
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {out}");
    assert!(
        out.contains("LUNAKV_ADMIN_TOKEN") && out.contains("ha_warm_standby"),
        "{out}"
    );
}
