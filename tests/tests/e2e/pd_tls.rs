//! The sidecar's TLS flags, with real binaries on loopback: `--secure-proxy` (self-signed, or
//! `--cert-path` reloaded when the files change), `--enable-tls=prefiller,decoder` towards the
//! engines (behind TLS fronts here: the simulator serves plain HTTP) and
//! `--tls-insecure-skip-verify` per stage.

use std::time::Duration;

use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, fresh_host, output_of, post, request};
use lunakv_tests::tls::{TestCa, TlsFront, https_request};
use lunakv_tests::wait_until;
use serde_json::json;

const PROMPT: &str = "tls keeps every hop of this prompt private from the prefill engine to \
    the decode engine and back to the client";

fn completion(stream: bool) -> serde_json::Value {
    json!({"model": "sim", "prompt": PROMPT, "max_tokens": 5, "stream": stream})
}

fn write_cert(dir: &std::path::Path, ca: &TestCa) -> rustls_pki_types::CertificateDer<'static> {
    let issued = ca.issue("127.0.0.1".parse().unwrap());
    // Write then rename, so the watcher never reads half a file.
    for (name, text) in [("tls.key", &issued.key_pem), ("tls.crt", &issued.cert_pem)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
    issued.der
}

#[test]
fn secure_proxy_self_signed_and_cert_path_reloaded() {
    let d = Sim::start("127.0.0.1".parse().unwrap(), 0, "decode", &[]);
    let ca = TestCa::new();

    // Self-signed (no --cert-path): TLS works, the certificate is nobody's CA's.
    let sc = Sidecar::start(&d, "nixlv2", 8998, &["--secure-proxy=true".into()]);
    let (r, _) = https_request(sc.http, None, "GET", "/health", &[], b"").expect("https");
    assert_eq!(r.status, 200);
    let (r, _) = https_request(sc.http, None, "GET", "/v1/models", &[], b"").expect("https");
    assert_eq!(r.json()["data"][0]["id"], "sim-model", "proxied over TLS");
    let e = https_request(sc.http, Some(ca.roots()), "GET", "/health", &[], b"").unwrap_err();
    let e = e.to_string();
    assert!(e.contains("certificate"), "{e}");
    let plain = request(sc.http, "GET", "/health", &[], b"");
    assert_ne!(
        plain.status, 200,
        "plain HTTP must not be served on a TLS listener"
    );

    // --cert-path: the CA's certificate is served, and a new one is picked up.
    let dir = tempfile::tempdir().unwrap();
    let first = write_cert(dir.path(), &ca);
    let sc = Sidecar::start(
        &d,
        "nixlv2",
        8998,
        &[
            "--secure-proxy".into(),
            format!("--cert-path={}", dir.path().display()),
        ],
    );
    let (r, cert) =
        https_request(sc.http, Some(ca.roots()), "GET", "/health", &[], b"").expect("verified");
    assert_eq!(r.status, 200);
    assert_eq!(cert, first);
    // No wait for the clock: the files are renamed into place, so the watcher sees a new
    // inode whatever the mtime granularity.
    let second = write_cert(dir.path(), &ca);
    assert_ne!(first, second);
    let reloaded = wait_until(Duration::from_secs(15), || {
        let (_, c) = https_request(sc.http, Some(ca.roots()), "GET", "/health", &[], b"").ok()?;
        (c == second).then_some(())
    });
    assert!(reloaded.is_some(), "the new certificate was never served");

    // A bad cert dir is a startup error naming the file.
    let empty = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(lunakv_tests::bin("lunakv-sidecar"))
        .args([
            "--port=0",
            "--host=127.0.0.1",
            &format!("--cert-path={}", empty.path().display()),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls.crt"), "{err}");
}

#[test]
fn tls_to_prefiller_and_decoder_with_per_stage_verification() {
    let host = fresh_host();
    let boot = Bootstrap::start(host, 0, &["--lease-ttl=1500ms"]);
    let p = Sim::prefill(host, &boot, &[]);
    let d = Sim::start("127.0.0.1".parse().unwrap(), 0, "decode", &[]);
    // The prefill front sits on the prefill host, where the sidecar also finds the bootstrap.
    let pf = TlsFront::start(host, p.http);
    let df = TlsFront::start("127.0.0.1".parse().unwrap(), d.http);
    let target = pf.addr.to_string();
    let hdr = [("x-prefiller-host-port", target.as_str())];
    let want = {
        let r = post(d.http, "/v1/completions", &[], &completion(false));
        output_of(&r.json())
    };
    let sidecar = |extra: &[&str]| {
        let mut a = vec!["--enable-tls=prefiller,decoder".to_string()];
        a.extend(extra.iter().map(|s| s.to_string()));
        Sidecar::start_at(df.addr, "mooncake", boot.http.port(), &a)
    };

    // Both stages over TLS, neither verified (the fronts are self-signed): P/D works.
    let sc = sidecar(&["--tls-insecure-skip-verify=prefiller,decoder"]);
    for stream in [false, true] {
        let r = post(sc.http, "/v1/completions", &hdr, &completion(stream));
        assert_eq!(r.status, 200, "{}", r.text());
        let got = if stream {
            lunakv_tests::pd::sse_text(&r.body).0
        } else {
            output_of(&r.json())
        };
        assert_eq!(got, want);
    }
    assert!(pf.handshakes() >= 1 && df.handshakes() >= 1);
    assert_eq!(p.stat("transfers_ok"), 2);

    // Only the prefiller unverified: the decoder's certificate is checked, and refused.
    let before = pf.handshakes();
    let sc = sidecar(&["--tls-insecure-skip-verify=prefiller"]);
    let r = post(sc.http, "/v1/completions", &hdr, &completion(false));
    assert!(matches!(r.status, 502 | 503), "{} {}", r.status, r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("decode") && msg.contains("certificate"),
        "{msg}"
    );
    assert!(pf.handshakes() > before, "the prefill leg did use TLS");

    // Nothing unverified: the prefiller's certificate is refused first; no decode-side recompute.
    let sc = sidecar(&[]);
    let r = post(sc.http, "/v1/completions", &hdr, &completion(false));
    assert!(matches!(r.status, 502 | 503), "{} {}", r.status, r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("prefill") && msg.contains("certificate"),
        "{msg}"
    );
    assert_eq!(
        d.stat("local_prefills"),
        1,
        "only the reference answer was computed locally"
    );

    // An unknown stage is refused at startup, naming the flag and the valid stages.
    let out = std::process::Command::new(lunakv_tests::bin("lunakv-sidecar"))
        .args(["--port=0", "--enable-tls=prefiller,encoder"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("encoder") && err.contains("--enable-tls") && err.contains("decoder"),
        "{err}"
    );
}
