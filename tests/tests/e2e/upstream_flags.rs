//! Upstream's command lines, as scripts and manifests written for `mooncake_master` and
//! `mooncake_client` pass them (gflags syntax), start lunakv-master and lunakv-store: one-dash
//! flags, separate values, `--noflag`, upstream flags lunakv ignores (one warning each) and
//! those it refuses (the reason and the fix). docs/FLAGS.md.

use std::time::Duration;

use lunakv_tests::{Master, Proc, Store, fields, warn_lines};

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Runs `bin` with `a`, expecting it to exit non-zero at once; returns its output.
fn refused(bin: &str, a: &[&str]) -> String {
    let mut p = Proc::spawn(bin, &args(a), &[]);
    let code = p.wait_exit(Duration::from_secs(10));
    assert!(
        code.is_some_and(|c| c != 0),
        "{bin} {a:?} must exit non-zero, got {code:?}:\n{}",
        p.output()
    );
    p.output()
}

#[test]
fn a_mooncake_master_command_line_in_gflags_syntax_starts_the_master() {
    let dir = tempfile::tempdir().unwrap();
    let data = format!("-data_dir={}", dir.path().display());
    // As upstream's docs write them: one dash, a separate value, --noflag, upstream-only flags.
    let p = Proc::spawn(
        "lunakv-master",
        &args(&[
            "-rpc_address=127.0.0.1",
            "-rpc_port=0",
            "-metrics_port",
            "0",
            "--noenable_ha",
            "-default_kv_lease_ttl=5000",
            "-eviction_high_watermark_ratio",
            "0.95",
            "-rpc_thread_num=8",
            "--enable_http_metadata_server=true",
            "-http_metadata_server_port=8080",
            "-allocation_strategy=random",
            &data,
        ]),
        &[],
    );
    let line = p.wait_for_line("listening", Duration::from_secs(20));
    let f = fields(&line);
    assert!(
        f.get("rpc").is_some_and(|a| a.starts_with("127.0.0.1:")),
        "{line}"
    );
    let out = p.output();
    let warns = warn_lines(&out);
    for flag in ["--rpc_thread_num=8", "--enable_http_metadata_server=true"] {
        assert!(
            warns
                .iter()
                .any(|w| w.contains(flag) && w.contains("ignored by lunakv")),
            "one warning naming {flag}: {warns:#?}"
        );
    }
    assert!(
        !warns.iter().any(|w| w.contains("allocation_strategy")),
        "random is what lunakv does: no warning: {warns:#?}"
    );
}

#[test]
fn metrics_host_binds_the_admin_listener_apart_from_the_rpc_address() {
    let dir = tempfile::tempdir().unwrap();
    let m = Master::start(dir.path(), &["--metrics_host=127.0.0.2"]);
    assert_eq!(m.rpc.ip().to_string(), "127.0.0.1");
    assert_eq!(m.admin.ip().to_string(), "127.0.0.2");
    assert_eq!(m.http_get("/health").0, 200);
}

#[test]
fn upstream_master_flags_lunakv_cannot_honour_are_refused_with_the_fix() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["-enable_cxl"], &["--enable_cxl=true", "CXL"]),
        (
            &["--allocation_strategy=local_first"],
            &[
                "allocation_strategy",
                "local_first",
                "free_ratio_first",
                "preferred_segment",
            ],
        ),
        (
            &["-rpc_interface", "eth0"],
            &["--rpc_interface=eth0", "--rpc_address"],
        ),
        (&["-metrics_host=not-an-ip"], &["metrics_host", "not-an-ip"]),
        // Unknown: clap names it in its long form and suggests the closest flag.
        (&["-rpc_prot=1"], &["--rpc_prot", "--rpc_port"]),
    ];
    for (a, wants) in cases {
        let out = refused("lunakv-master", a);
        for w in *wants {
            assert!(out.contains(w), "{a:?}: output must name {w:?}:\n{out}");
        }
    }
}

#[test]
fn a_mooncake_client_command_line_in_gflags_syntax_starts_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let m = Master::start(dir.path(), &[]);
    let master = format!("-master_server_address={}", m.addr());
    let p = Proc::spawn(
        "lunakv-store",
        &args(&[
            &master,
            "-host=127.0.0.1",
            "-port",
            "0",
            "-metrics_port=0",
            "-global_segment_size=16MB",
            "-protocol=tcp",
            "-metadata_server=P2PHANDSHAKE",
            "--noenable_offload",
            "-threads=4",
            "-device_names=mlx5_0",
            "-local_buffer_size",
            "0",
            "--tenant_id=default",
        ]),
        &[],
    );
    p.wait_for_line("listening", Duration::from_secs(20));
    let out = p.output();
    let warns = warn_lines(&out);
    for flag in [
        "--threads=4",
        "--device_names=mlx5_0",
        "--local_buffer_size=0",
    ] {
        assert!(
            warns.iter().any(|w| w.contains(flag)),
            "one warning naming {flag}: {warns:#?}"
        );
    }
    // llm-d's DaemonSet arguments, unchanged, still start it.
    let s = Store::start(
        &m.addr(),
        "16MB",
        &[
            "--protocol=rdma",
            "--enable_offload=false",
            "--metadata_server=P2PHANDSHAKE",
        ],
    );
    assert!(s.admin.is_some());
}

#[test]
fn upstream_store_flags_lunakv_cannot_honour_are_refused_with_the_fix() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--tenant_id=team-a"],
            &[
                "--tenant_id=team-a",
                lunakv_config::messages::TENANT_REFUSAL,
            ],
        ),
        (&["-deployment_mode=P2P"], &["P2P"]),
        (&["-redis_password", "x"], &["etcd://"]),
        (&["-config_path=/etc/client.json"], &["flags"]),
    ];
    for (a, wants) in cases {
        let out = refused("lunakv-store", a);
        for w in *wants {
            assert!(out.contains(w), "{a:?}: output must name {w:?}:\n{out}");
        }
    }
}

/// What upstream Mooncake's client library sends first: a 20-byte coro_rpc request header.
fn coro_rpc_header() -> Vec<u8> {
    let mut h = vec![lunakv_proto::foreign::CORO_RPC_MAGIC, 1, 0, 0];
    h.extend_from_slice(&[0u8; 16]);
    h
}

#[test]
fn an_upstream_client_at_the_master_is_named_in_its_log() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let m = Master::start(dir.path(), &[]);
    let mut c = std::net::TcpStream::connect(m.rpc).unwrap();
    c.write_all(&coro_rpc_header()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(c.read(&mut buf).unwrap_or(0), 0, "the master closes it");
    let line = m
        .proc
        .wait_for_line("does not speak gRPC", Duration::from_secs(10));
    assert!(line.contains("coro_rpc"), "{line}");
    // A lunakv client right after still works: the check only looks.
    let r = lunakv_tests::requester(&m.addr());
    assert!(matches!(r.batch_exists(&["k"])[..], [Ok(false)]));
}

#[test]
fn a_lunakv_client_pointed_at_an_upstream_master_says_so() {
    use std::io::Read;
    // The double of upstream's mooncake_master: coro_rpc reads a 20-byte header, finds no
    // magic byte and closes the connection, as yalantinglibs' server does.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut h = [0u8; 20];
            let _ = c.read_exact(&mut h);
        }
    });
    let e = lunakv_client::StoreClient::connect(lunakv_client::ClientOptions {
        master_server_address: addr.clone(),
        ..lunakv_client::ClientOptions::default()
    })
    .err()
    .expect("connecting to a coro_rpc master fails");
    let msg = e.to_string();
    assert!(
        msg.contains("does not speak gRPC") && msg.contains("not a lunakv-master"),
        "{msg}"
    );
}

/// The security variables are read from the environment only (no flag carries a secret), so
/// each server's `--help` closes with the ones it reads (docs/SECURITY.md).
#[test]
fn help_names_the_security_variables_each_server_reads() {
    let cases: &[(&str, &[&str])] = &[
        (
            "lunakv-master",
            &[
                "LUNAKV_AUTH_TOKEN",
                "LUNAKV_AUTH_TOKEN_FILE",
                "LUNAKV_ADMIN_TOKEN",
                "LUNAKV_ADMIN_TOKEN_FILE",
                "LUNAKV_TLS_CERT",
                "LUNAKV_TLS_KEY",
                "LUNAKV_TLS_CACERT",
                "LUNAKV_ADMIN_IDENTITIES",
                "LUNAKV_MOUNT_IDENTITIES",
                "LUNAKV_ADMIN_TLS",
                "LUNAKV_ETCD_CACERT",
                "LUNAKV_ETCD_PASSWORD",
            ],
        ),
        (
            "lunakv-store",
            &[
                "LUNAKV_AUTH_TOKEN",
                "LUNAKV_AUTH_TOKEN_FILE",
                "LUNAKV_TLS_CERT",
                "LUNAKV_TLS_KEY",
                "LUNAKV_TLS_CACERT",
                "LUNAKV_TLS_SERVER_NAME",
                "LUNAKV_ETCD_CACERT",
                "LUNAKV_ETCD_PASSWORD",
            ],
        ),
    ];
    for (bin, wants) in cases {
        let out = std::process::Command::new(lunakv_tests::bin(bin))
            .arg("--help")
            .output()
            .unwrap_or_else(|e| panic!("{bin} --help: {e}"));
        assert!(out.status.success(), "{bin} --help: {out:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        for w in *wants {
            assert!(help.contains(w), "{bin} --help must name {w}:\n{help}");
        }
    }
}
