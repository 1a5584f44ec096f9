//! A secured etcd (issue 18, item 4): TLS with client certificates and etcd's own users, reached
//! by every lunakv etcd client through `LUNAKV_ETCD_*`. A real etcd (Debian's etcd-server) with
//! certificates from a test CA, and auth turned on with Debian's etcdctl, as an operator would.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use lunakv_meta::testing::{EtcdServer, EtcdTlsFiles};
use lunakv_meta::{EtcdClient, EtcdMetaStore, EtcdSecurity, MetaStore, Prefixed, conformance};
use lunakv_tests::tls::TestCa;
use lunakv_tests::{bin, child_env, pattern};

/// The test PKI on disk: a CA, etcd's server certificate, and a client certificate.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new(ca: &TestCa) -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = ca.issue(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let client = ca.issue_client("lunakv");
        let w = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        w("ca.pem", &ca.ca_pem());
        w("server.pem", &server.cert_pem);
        w("server-key.pem", &server.key_pem);
        w("client.pem", &client.cert_pem);
        w("client-key.pem", &client.key_pem);
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn etcd_files(&self) -> EtcdTlsFiles {
        let p = |n: &str| self.dir.path().join(n);
        EtcdTlsFiles {
            ca: p("ca.pem"),
            cert: p("server.pem"),
            key: p("server-key.pem"),
            client: Some((p("client.pem"), p("client-key.pem"))),
        }
    }
}

fn env_of(vars: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    move |k: &str| m.get(k).cloned()
}

fn client(etcd: &EtcdServer, vars: &[(&str, String)]) -> EtcdClient {
    let security = EtcdSecurity::from_env(&env_of(vars)).expect("credentials");
    // tonic's lazy channel spawns its connector on the current runtime.
    let rt = RT.get_or_init(rt);
    let _in = rt.enter();
    EtcdClient::connect_with(&[etcd.endpoint()], Duration::from_secs(5), &security).expect("client")
}

static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn start_tls(pki: &Pki) -> EtcdServer {
    if lunakv_meta::testing::skip_requested() {
        panic!("this test needs etcd; unset LUNAKV_SKIP_ETCD");
    }
    EtcdServer::start_tls(pki.etcd_files()).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn tls_with_client_certificates_passes_the_suite_and_refuses_strangers() {
    let ca = TestCa::new();
    let pki = Pki::new(&ca);
    let etcd = start_tls(&pki);
    let rt = rt();
    let full = [
        ("LUNAKV_ETCD_CACERT", pki.path("ca.pem")),
        ("LUNAKV_ETCD_CERT", pki.path("client.pem")),
        ("LUNAKV_ETCD_KEY", pki.path("client-key.pem")),
    ];
    let c = client(&etcd, &full);
    rt.block_on(async {
        c.check().await.expect("etcd answers over TLS");
        conformance::run(&EtcdMetaStore::new(c.clone())).await;
    });

    // Plain http to a TLS listener: refused.
    let plain = client(&etcd, &[]);
    let err = rt
        .block_on(plain.check())
        .expect_err("plain http is refused");
    eprintln!("plain: {err}");

    // TLS without a client certificate, against --client-cert-auth: the handshake fails and
    // the message names the variables to set.
    let no_cert = client(&etcd, &full[..1]);
    let err = rt
        .block_on(no_cert.check())
        .expect_err("no client certificate is refused")
        .to_string();
    assert!(err.contains("LUNAKV_ETCD_CERT"), "{err}");

    // A CA that did not sign etcd's certificate: the server is not trusted, and the message
    // names LUNAKV_ETCD_CACERT.
    let other = TestCa::new();
    let other_dir = tempfile::tempdir().unwrap();
    let other_ca = other_dir.path().join("other-ca.pem");
    std::fs::write(&other_ca, other.ca_pem()).unwrap();
    let wrong = [
        ("LUNAKV_ETCD_CACERT", other_ca.display().to_string()),
        ("LUNAKV_ETCD_CERT", pki.path("client.pem")),
        ("LUNAKV_ETCD_KEY", pki.path("client-key.pem")),
    ];
    let err = rt
        .block_on(client(&etcd, &wrong).check())
        .expect_err("an untrusted server is refused")
        .to_string();
    assert!(err.contains("LUNAKV_ETCD_CACERT"), "{err}");
}

#[test]
fn etcd_users_are_required_checked_and_scoped() {
    let Some(etcd) = lunakv_meta::testing::etcd_or_skip() else {
        return;
    };
    etcd.enable_auth("rootpw", "lunakv", "s3cret", "mooncake-store/")
        .unwrap_or_else(|e| panic!("{e}"));
    let rt = rt();

    // No user: etcd refuses, and the message says which variables to set.
    let err = rt
        .block_on(async {
            let c = client(&etcd, &[]);
            EtcdMetaStore::new(c).get("mooncake-store/x").await
        })
        .expect_err("no credentials is refused")
        .to_string();
    assert!(err.contains("LUNAKV_ETCD_USER"), "{err}");

    // A wrong password: refused, naming the user.
    let wrong = [("LUNAKV_ETCD_USER", "lunakv:nope".to_string())];
    let err = rt
        .block_on(client(&etcd, &wrong).check())
        .expect_err("a wrong password is refused")
        .to_string();
    assert!(
        err.contains("\"lunakv\"") && err.contains("authentication failed"),
        "{err}"
    );

    // The right user: the suite passes under lunakv's prefix, and keys outside it are denied.
    let good = [
        ("LUNAKV_ETCD_USER", "lunakv".to_string()),
        ("LUNAKV_ETCD_PASSWORD", "s3cret".to_string()),
    ];
    let c = client(&etcd, &good);
    rt.block_on(async {
        c.check().await.expect("check passes with a scoped user");
        let inner: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(c.clone()));
        conformance::run(&Prefixed::new(inner.clone(), "mooncake-store/auth-test/")).await;
        let err = inner
            .put("elsewhere/x", b"1")
            .await
            .expect_err("outside the granted prefix")
            .to_string();
        assert!(err.contains("grant"), "{err}");
    });
}

#[test]
fn an_expired_token_is_renewed_once_and_the_call_succeeds() {
    if lunakv_meta::testing::skip_requested() {
        return;
    }
    let etcd =
        EtcdServer::start_with_args(&["--auth-token-ttl=1"]).unwrap_or_else(|e| panic!("{e}"));
    etcd.enable_auth("rootpw", "lunakv", "s3cret", "mooncake-store/")
        .unwrap_or_else(|e| panic!("{e}"));
    let rt = rt();
    let c = client(&etcd, &[("LUNAKV_ETCD_USER", "lunakv:s3cret".to_string())]);
    let store = EtcdMetaStore::new(c);
    rt.block_on(async {
        store
            .put("mooncake-store/t", b"1")
            .await
            .expect("first put");
        // Idle past the token's TTL: etcd forgets it; the next call must re-authenticate.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            store
                .get("mooncake-store/t")
                .await
                .expect("get after the token expired"),
            Some(b"1".to_vec())
        );
    });
}

/// The whole HA path on a secured etcd: an HA master campaigns, a store-client and the CLI
/// follow the leader through `etcd://`, every one configured only by `LUNAKV_ETCD_*`.
#[test]
fn ha_master_store_and_cli_work_through_a_secured_etcd() {
    let ca = TestCa::new();
    let pki = Pki::new(&ca);
    let etcd = start_tls(&pki);
    etcd.enable_auth("rootpw", "lunakv", "s3cret", "mooncake-store/")
        .unwrap_or_else(|e| panic!("{e}"));
    let vars = [
        ("LUNAKV_ETCD_CACERT", pki.path("ca.pem")),
        ("LUNAKV_ETCD_CERT", pki.path("client.pem")),
        ("LUNAKV_ETCD_KEY", pki.path("client-key.pem")),
        ("LUNAKV_ETCD_USER", "lunakv".to_string()),
        ("LUNAKV_ETCD_PASSWORD", "s3cret".to_string()),
    ];
    let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _env = child_env(&env);
    let data = tempfile::tempdir().unwrap();
    let master = lunakv_tests::Master::start_ha(data.path(), &etcd.endpoint(), &[]);
    assert!(
        lunakv_tests::wait_until(Duration::from_secs(20), || {
            (master.role().as_deref() == Some("leader")).then_some(())
        })
        .is_some(),
        "the master never became leader:\n{}",
        master.proc.output()
    );
    let url = etcd.etcd_url();
    let _store = lunakv_tests::Store::start(&url, "64MB", &[]);

    let value = pattern(18, 4096);
    let value_file = data.path().join("value");
    std::fs::write(&value_file, &value).unwrap();
    let cli = |args: &[&str], extra_env: &[(&str, &str)], clear: &[&str]| {
        let mut cmd = std::process::Command::new(bin("lunakv"));
        cmd.args(["--master", &url]).args(args);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        for k in clear {
            cmd.env_remove(k);
        }
        cmd.output().expect("run lunakv")
    };
    let put = cli(
        &["put", "secured-key", &value_file.display().to_string()],
        &[],
        &[],
    );
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    let got = cli(&["get", "secured-key"], &[], &[]);
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(
        got.stdout, value,
        "the bytes read back through the secured path differ"
    );

    // The same CLI with neither a user nor a client certificate (etcd takes a client
    // certificate's CN as the user): refused with the variables to set, nothing read.
    let refused = cli(
        &["get", "secured-key"],
        &[],
        &[
            "LUNAKV_ETCD_USER",
            "LUNAKV_ETCD_PASSWORD",
            "LUNAKV_ETCD_CERT",
            "LUNAKV_ETCD_KEY",
        ],
    );
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{text}");
    assert!(refused.stdout.is_empty());
    assert!(text.contains("LUNAKV_ETCD_CERT"), "{text}");
}

/// deploy/k8s/components/etcd-tls/etcd-auth.sh, the ha overlay's etcd user setup, run as its
/// Job runs it (twice: a Job may be retried) against an etcd with client-certificate auth.
/// Afterwards only lunakv's certificate reaches lunakv's keys; no password exists.
#[test]
fn the_k8s_etcd_auth_script_admits_lunakv_s_certificate_only() {
    let ca = TestCa::new();
    let pki = Pki::new(&ca);
    let tls_dir = |cn: &str| {
        let cert = ca.issue_client(cn);
        let d = pki.dir.path().join(cn);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("ca.crt"), ca.ca_pem()).unwrap();
        std::fs::write(d.join("tls.crt"), &cert.cert_pem).unwrap();
        std::fs::write(d.join("tls.key"), &cert.key_pem).unwrap();
        d
    };
    let root = tls_dir("root");
    let stranger = tls_dir("stranger");
    let etcd = start_tls(&pki);
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/k8s/components/etcd-tls/etcd-auth.sh");
    for run in 1..=2 {
        let out = std::process::Command::new("sh")
            .arg(&script)
            .env("ETCD_ENDPOINTS", format!("https://{}", etcd.endpoint()))
            .env("ETCD_TLS_DIR", &root)
            .output()
            .expect("run etcd-auth.sh");
        assert!(
            out.status.success(),
            "run {run} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rt = rt();
    let as_cert = |dir: &Path| {
        client(
            &etcd,
            &[
                (
                    "LUNAKV_ETCD_CACERT",
                    dir.join("ca.crt").display().to_string(),
                ),
                (
                    "LUNAKV_ETCD_CERT",
                    dir.join("tls.crt").display().to_string(),
                ),
                ("LUNAKV_ETCD_KEY", dir.join("tls.key").display().to_string()),
            ],
        )
    };
    // pki's client certificate has CN lunakv: the user the script created.
    let lunakv = client(
        &etcd,
        &[
            ("LUNAKV_ETCD_CACERT", pki.path("ca.pem")),
            ("LUNAKV_ETCD_CERT", pki.path("client.pem")),
            ("LUNAKV_ETCD_KEY", pki.path("client-key.pem")),
        ],
    );
    rt.block_on(async {
        lunakv
            .check()
            .await
            .expect("lunakv's certificate is admitted");
        let inner: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(lunakv));
        conformance::run(&Prefixed::new(inner.clone(), "mooncake-store/k8s/")).await;
        let err = inner
            .put("other-app/x", b"1")
            .await
            .expect_err("outside lunakv's prefix")
            .to_string();
        assert!(err.contains("permission denied"), "{err}");
        let s: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(as_cert(&stranger)));
        let err = s
            .put("mooncake-store/k8s/x", b"evil")
            .await
            .expect_err("a stranger's certificate writes nothing")
            .to_string();
        eprintln!("stranger: {err}");
        assert_eq!(
            inner.get("mooncake-store/k8s/x").await.expect("get"),
            None,
            "the stranger's write landed"
        );
    });
}
