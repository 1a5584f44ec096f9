//! P/D benchmark (ignored by default; numbers mean something only in release):
//!
//! ```text
//! cargo build --release --bins
//! cargo test --release -p lunakv-tests --test pd_bench -- --ignored --nocapture
//! ```
//!
//! 1. Sidecar overhead: p50/p99 latency and throughput of `/v1/completions` (non-streaming, one
//!    token) direct to the engine simulator and through `lunakv-sidecar`, at concurrency 1 and
//!    64, in one run.
//! 2. KV transfer: GB/s of `TransferEngine::batch_raw` into a `RegionServer` (the path a prefill
//!    engine writes a decoder's KV on), an end-to-end P/D request through the sidecar with a
//!    large KV, and raw loopback TCP on this machine, in the same run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, fresh_host, post};
use lunakv_transfer::{
    MemoryRegistry, RawRequest, RegionServer, RegionServerConfig, TransferEngine, TransferOptions,
};
use serde_json::json;

type C = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn one(c: &C, addr: SocketAddr, body: &Bytes) -> Duration {
    let req = hyper::Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .expect("request");
    let t = Instant::now();
    let r = c.request(req).await.expect("response");
    assert!(r.status().is_success());
    let _ = r.into_body().collect().await.expect("body");
    t.elapsed()
}

/// (p50 us, p99 us, requests/s) for `n` requests per worker at concurrency `conc`.
async fn measure(addr: SocketAddr, conc: usize, n: usize) -> (f64, f64, f64) {
    let c: C = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let body = Bytes::from(
        json!({"model": "sim", "prompt": "hello world benchmark prompt", "max_tokens": 1})
            .to_string(),
    );
    for _ in 0..50 {
        one(&c, addr, &body).await;
    }
    let t = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (c, body) = (c.clone(), body.clone());
            tokio::spawn(async move {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(one(&c, addr, &body).await);
                }
                v
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    let secs = t.elapsed().as_secs_f64();
    all.sort();
    let pct =
        |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)].as_secs_f64() * 1e6;
    (pct(0.50), pct(0.99), all.len() as f64 / secs)
}

fn raw_tcp_gbps(total: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < total {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got += n;
        }
        s.write_all(b"k").unwrap();
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let buf = vec![7u8; 1 << 20];
    let t = Instant::now();
    let mut sent = 0;
    while sent < total {
        s.write_all(&buf).unwrap();
        sent += buf.len();
    }
    let mut k = [0u8; 1];
    s.read_exact(&mut k).unwrap();
    let secs = t.elapsed().as_secs_f64();
    h.join().unwrap();
    total as f64 / secs / 1e9
}

fn transfer_gbps(block: usize, total: usize) -> f64 {
    let reg = MemoryRegistry::new();
    let srv = RegionServer::start(
        RegionServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            advertise_host: None,
        },
        reg.clone(),
    )
    .unwrap();
    let region = reg.alloc(total).unwrap();
    let src = vec![3u8; total];
    let e = TransferEngine::new(TransferOptions::default());
    let ep = srv.endpoint().to_string();
    let run = || {
        let mut reqs: Vec<RawRequest<'_>> = (0..total / block)
            .map(|i| RawRequest::Write {
                endpoint: &ep,
                remote_addr: region.addr() + (i * block) as u64,
                src: vec![&src[i * block..(i + 1) * block]],
            })
            .collect();
        assert!(e.batch_raw(&mut reqs).iter().all(|r| r.is_ok()));
    };
    run();
    let t = Instant::now();
    let rounds = 4;
    for _ in 0..rounds {
        run();
    }
    (total * rounds) as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[test]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
fn pd_bench() {
    let d = Sim::start("127.0.0.1".parse().unwrap(), 0, "decode", &[]);
    let sc = Sidecar::start(&d, "mooncake", 8998, &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .unwrap();
    println!("\n== sidecar overhead (POST /v1/completions, 1 token, non-streaming) ==");
    println!(
        "{:<12} {:>6} {:>10} {:>10} {:>12}",
        "path", "conc", "p50 us", "p99 us", "req/s"
    );
    for (conc, n) in [(1usize, 3000usize), (64, 150)] {
        let direct = rt.block_on(measure(d.http, conc, n));
        let via = rt.block_on(measure(sc.http, conc, n));
        println!(
            "{:<12} {:>6} {:>10.0} {:>10.0} {:>12.0}",
            "direct", conc, direct.0, direct.1, direct.2
        );
        println!(
            "{:<12} {:>6} {:>10.0} {:>10.0} {:>12.0}",
            "via sidecar", conc, via.0, via.1, via.2
        );
        println!(
            "  -> added p50 {:.0} us, throughput {:.0}% of direct",
            via.0 - direct.0,
            100.0 * via.2 / direct.2
        );
    }

    println!("\n== KV transfer (prefill WRITEs into decoder memory) vs raw loopback TCP ==");
    let total = 256 << 20;
    println!(
        "raw loopback TCP, 1 stream          {:>6.2} GB/s",
        raw_tcp_gbps(total)
    );
    println!(
        "batch_raw 64 KiB blocks -> region    {:>6.2} GB/s",
        transfer_gbps(64 << 10, total)
    );
    println!(
        "batch_raw 1 MiB blocks -> region     {:>6.2} GB/s",
        transfer_gbps(1 << 20, total)
    );

    // End to end through the sidecar with a 64 MiB KV (512 blocks of 128 KiB).
    let host = fresh_host();
    let boot = Bootstrap::start(host, 0, &[]);
    let kv = [
        "--block-tokens=1".to_string(),
        "--block-bytes=131072".to_string(),
    ];
    let mut pre = vec![format!("--bootstrap=http://{}", boot.http)];
    pre.extend(kv.iter().cloned());
    let p = Sim::start(host, 0, "prefill", &pre);
    p.wait_registered();
    let d2 = Sim::start("127.0.0.1".parse().unwrap(), 0, "decode", &kv);
    let sc2 = Sidecar::start(&d2, "mooncake", boot.http.port(), &[]);
    let prompt = (0..512)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let target = p.http.to_string();
    let mut best = f64::MAX;
    for i in 0..5 {
        let body = json!({"prompt": format!("{prompt} {i}"), "max_tokens": 1});
        let t = Instant::now();
        let r = post(
            sc2.http,
            "/v1/completions",
            &[("x-prefiller-host-port", &target)],
            &body,
        );
        best = best.min(t.elapsed().as_secs_f64());
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let bytes = 513.0 * 131072.0;
    println!(
        "P/D request, 64 MiB KV, end to end   {:>6.2} GB/s ({:.1} ms incl. KV compute on both sims)",
        bytes / best / 1e9,
        best * 1e3
    );
}
