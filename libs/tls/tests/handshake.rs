//! A server that requires client certificates and the clients lunakv builds, over loopback: the
//! accepted client's identity reaches the server, and every refusal fails the client's connect
//! with a message that names its certificate and the fix.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use lunakv_config::tls::{TlsFile, TlsPaths};
use lunakv_tls::{ClientTls, ServerTls, TlsFailure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

struct Ca(rcgen::CertifiedIssuer<'static, rcgen::KeyPair>);

impl Ca {
    fn new(cn: &str) -> Ca {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        Ca(rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().unwrap()).unwrap())
    }

    /// Writes `dir/<name>.crt` and `.key`: a server certificate for localhost, or a client's
    /// for CN `name`.
    fn issue(&self, dir: &Path, name: &str, server: bool) -> (TlsFile, TlsFile) {
        let mut p = if server {
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap()
        } else {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(rcgen::DnType::CommonName, name);
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            p
        };
        if name == "old" {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let k = rcgen::KeyPair::generate().unwrap();
        let c = p.signed_by(&k, &self.0).unwrap();
        let file = |ext: &str, text: String, var: &str| {
            let path = dir.join(format!("{name}.{ext}"));
            std::fs::write(&path, text).unwrap();
            TlsFile {
                path,
                origin: var.to_string(),
            }
        };
        (
            file("crt", c.pem(), "LUNAKV_TLS_CERT"),
            file("key", k.serialize_pem(), "LUNAKV_TLS_KEY"),
        )
    }

    fn write(&self, dir: &Path, name: &str) -> TlsFile {
        let path = dir.join(name);
        std::fs::write(&path, self.0.pem()).unwrap();
        TlsFile {
            path,
            origin: "LUNAKV_TLS_CACERT".into(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_requires_certificates_names_callers_and_refusals_name_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (Ca::new("pool CA"), Ca::new("another CA"));
    let ca_file = ca.write(d, "ca.crt");
    let (cert, key) = ca.issue(d, "server", true);
    let server = ServerTls::from_paths(
        "test-server",
        &TlsPaths {
            cert: Some(cert),
            key: Some(key),
            ca: Some(ca_file.clone()),
            server_name: None,
        },
        &[b"h2"],
    )
    .unwrap()
    .map(Arc::new)
    .expect("TLS on");
    assert!(server.requires_client_certificates());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, mut identities) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (s, peer) = listener.accept().await.unwrap();
            let (server, tx) = (server.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some((mut s, p)) = server.accept(s, peer, Duration::from_secs(5)).await {
                    let _ = tx.send(p.identity.map(|i| i.to_string()));
                    let _ = s.write_all(b"ok").await;
                    let _ = s.flush().await;
                }
            });
        }
    });
    let client = |cert: Option<(TlsFile, TlsFile)>, ca: &TlsFile, name: &str| {
        let (cert, key) = cert.map_or((None, None), |(c, k)| (Some(c), Some(k)));
        ClientTls::from_paths(&TlsPaths {
            cert,
            key,
            ca: Some(ca.clone()),
            server_name: Some(name.to_string()),
        })
        .unwrap()
        .expect("TLS on")
    };
    let refusal = |e: std::io::Error| TlsFailure::of(&e).expect("explained").to_string();

    let alice = client(Some(ca.issue(d, "alice", false)), &ca_file, "localhost");
    let mut s = alice
        .connect(&addr, Duration::from_secs(5))
        .await
        .expect("alice");
    let mut got = [0u8; 2];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ok");
    assert_eq!(identities.recv().await.unwrap().as_deref(), Some("alice"));

    let none = client(None, &ca_file, "localhost");
    let e = refusal(
        none.connect(&addr, Duration::from_secs(5))
            .await
            .err()
            .unwrap(),
    );
    assert!(
        e.contains("presents none") && e.contains("LUNAKV_TLS_CERT"),
        "{e}"
    );

    let mallory = client(
        Some(other.issue(d, "mallory", false)),
        &ca_file,
        "localhost",
    );
    let e = refusal(
        mallory
            .connect(&addr, Duration::from_secs(5))
            .await
            .err()
            .unwrap(),
    );
    assert!(
        e.contains("mallory.crt") && e.contains("CN=mallory") && e.contains("not issued by a CA"),
        "{e}"
    );

    let old = client(Some(ca.issue(d, "old", false)), &ca_file, "localhost");
    let e = refusal(
        old.connect(&addr, Duration::from_secs(5))
            .await
            .err()
            .unwrap(),
    );
    assert!(e.contains("CN=old") && e.contains("expired"), "{e}");

    // The server's certificate is checked too: its CA, and the name.
    let other_ca = other.write(d, "other-ca.crt");
    let wrong_ca = client(Some(ca.issue(d, "bob", false)), &other_ca, "localhost");
    let e = refusal(
        wrong_ca
            .connect(&addr, Duration::from_secs(5))
            .await
            .err()
            .unwrap(),
    );
    assert!(
        e.contains("other-ca.crt") && e.contains("not issued by the CA"),
        "{e}"
    );
    let wrong_name = client(Some(ca.issue(d, "carol", false)), &ca_file, "lunakv-master");
    let e = refusal(
        wrong_name
            .connect(&addr, Duration::from_secs(5))
            .await
            .err()
            .unwrap(),
    );
    assert!(e.contains("LUNAKV_TLS_SERVER_NAME"), "{e}");

    // Blocking (quick calls): the same verdicts.
    tokio::task::spawn_blocking(move || {
        let tcp = std::net::TcpStream::connect(&addr).unwrap();
        let e = mallory.handshake_blocking(&addr, tcp).err().unwrap();
        let e = TlsFailure::of(&e).expect("explained").to_string();
        assert!(e.contains("CN=mallory"), "{e}");
        let tcp = std::net::TcpStream::connect(&addr).unwrap();
        let mut s = alice
            .handshake_blocking(&addr, tcp)
            .expect("alice, blocking");
        let mut got = [0u8; 2];
        std::io::Read::read_exact(&mut s, &mut got).unwrap();
        assert_eq!(&got, b"ok");
    })
    .await
    .unwrap();
}
