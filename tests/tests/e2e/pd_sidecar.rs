//! P/D end to end: lunakv-sidecar in front of lunakv-engine-sim prefill/decode engines and
//! lunakv-bootstrap, all real binaries on loopback. Every successful answer is compared with the
//! decoder's own (aggregated) answer, which it derives from a checksum of the KV it holds, and
//! the simulators' counters prove the KV crossed through libs/transfer.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use lunakv_tests::pd::{
    Bootstrap, Sidecar, Sim, fresh_host, output_of, post, request, sse_text, start_stream,
};
use lunakv_tests::wait_until;
use serde_json::{Value, json};

const PROMPT: &str = "the quick brown fox jumps over the lazy dog while the moon rises over the \
    quiet sea and every block of this prompt becomes a block of simulated kv cache bytes";

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": "sim", "prompt": prompt, "max_tokens": 6, "stream": stream,
           "stream_options": {"include_usage": true}})
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": "sim", "messages": [{"role": "user", "content": prompt}],
           "max_completion_tokens": 6, "stream": stream})
}

/// The answer the decoder gives on its own (it computes the KV itself).
fn expected(decoder: &Sim, path: &str, body: &Value) -> String {
    let mut b = body.clone();
    b["stream"] = json!(false);
    let r = post(decoder.http, path, &[], &b);
    assert_eq!(r.status, 200, "{}", r.text());
    output_of(&r.json())
}

/// One prefill host: its bootstrap on `port` (0 = pick) and a prefill engine.
struct PrefillHost {
    host: IpAddr,
    boot: Bootstrap,
    sim: Sim,
}

impl PrefillHost {
    fn start(port: u16) -> PrefillHost {
        let host = fresh_host();
        let boot = Bootstrap::start(host, port, &["--lease-ttl=1500ms"]);
        let sim = Sim::prefill(host, &boot, &[]);
        PrefillHost { host, boot, sim }
    }

    fn target(&self) -> String {
        self.sim.http.to_string()
    }
}

/// A prefill engine for the nixlv2 flow: it registers with no bootstrap (nixlv2 needs none).
fn nixl_prefill() -> Sim {
    Sim::start(
        fresh_host(),
        0,
        "prefill",
        &["--bootstrap=http://127.0.0.1:1".into()],
    )
}

fn decoder(extra: &[String]) -> Sim {
    Sim::start("127.0.0.1".parse().unwrap(), 0, "decode", extra)
}

fn check_all_shapes(sc: &Sidecar, d: &Sim, target: &str, tag: &str) {
    let hdr = [("x-prefiller-host-port", target)];
    for (path, body) in [
        (
            "/v1/completions",
            completion(&format!("{PROMPT} {tag} a"), false),
        ),
        (
            "/v1/chat/completions",
            chat(&format!("{PROMPT} {tag} b"), false),
        ),
    ] {
        let want = expected(d, path, &body);
        let before = d.stat("kv_bytes_received");
        let r = post(sc.http, path, &hdr, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let v = r.json();
        assert_eq!(
            output_of(&v),
            want,
            "{path}: P/D output differs from the decoder's own"
        );
        assert!(
            d.stat("kv_bytes_received") > before,
            "{path}: no KV arrived over the transfer"
        );
        // The decoder reports all prompt tokens as external hits; the sidecar rewrites to the
        // prefiller's own cached_tokens (0: it saw this prompt for the first time).
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{v}"
        );
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }
    for (path, body) in [
        (
            "/v1/completions",
            completion(&format!("{PROMPT} {tag} c"), true),
        ),
        (
            "/v1/chat/completions",
            chat(&format!("{PROMPT} {tag} d"), true),
        ),
    ] {
        let want = expected(d, path, &body);
        let before = d.stat("kv_bytes_received");
        let r = post(sc.http, path, &hdr, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert!(
            r.header("content-type")
                .unwrap_or("")
                .starts_with("text/event-stream")
        );
        let (text, usage, done) = sse_text(&r.body);
        assert!(done, "{path}: stream did not end with [DONE]");
        assert_eq!(text, want, "{path}: streamed P/D output differs");
        assert!(d.stat("kv_bytes_received") > before);
        if path == "/v1/completions" {
            // The prefiller has seen this prompt's leading blocks (request "a"): its prefix-cache
            // hits, not the decoder's "everything was external", reach the client.
            let u = usage.expect("usage chunk");
            let cached = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(
                cached < u["prompt_tokens"].as_u64().unwrap() && cached % 16 == 0 && cached > 0,
                "{u}"
            );
        }
    }
}

#[test]
fn mooncake_1p1d_completions_and_chat_streaming_and_not() {
    let p = PrefillHost::start(0);
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "mooncake", p.boot.http.port(), &[]);
    check_all_shapes(&sc, &d, &p.target(), "1p1d");
    assert_eq!(p.sim.stat("transfers_ok"), 4);
    assert_eq!(p.sim.stat("kv_bytes_sent"), d.stat("region_bytes_written"));
    // No silent recompute on the decoder: only the `expected` calls computed locally.
    assert_eq!(d.stat("local_prefills"), 4);
    assert_eq!(d.stat("remote_decodes"), 4);

    // x-request-id goes through to both engines and back.
    let r = post(
        sc.http,
        "/v1/completions",
        &[
            ("x-prefiller-host-port", &p.target()),
            ("x-request-id", "rid-42"),
        ],
        &completion(PROMPT, false),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("rid-42"));
    assert_eq!(r.json()["id"], "cmpl-rid-42");
    assert_eq!(
        p.sim.stats()["last_request_id"],
        "rid-42",
        "the prefill leg carries the request id too"
    );
    // The scheduler's header never reaches an engine, and every prefill asked for one token
    // without streaming whatever the client asked for.
    for (who, s) in [("prefill", p.sim.stats()), ("decode", d.stats())] {
        assert_eq!(s["prefiller_header_seen"], 0, "{who}: {s}");
    }
    assert_eq!(p.sim.stat("prefill_requests_not_minimal"), 0);
    // A comma list takes the first entry.
    let list = format!("{}, 127.0.0.1:1", p.target());
    let r = post(
        sc.http,
        "/v1/completions",
        &[("x-prefiller-host-port", &list)],
        &completion(PROMPT, false),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // No header: decode only, passthrough.
    let r = post(sc.http, "/v1/completions", &[], &completion(PROMPT, false));
    assert_eq!(r.status, 200);
    assert!(
        r.header("x-request-id").is_some(),
        "a request id is created when missing"
    );
    // Other routes are reverse-proxied to the engine.
    let r = request(sc.http, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], "sim-model");
    assert_eq!(request(sc.http, "GET", "/health", &[], b"").status, 200);
    assert_eq!(
        sc.metric("lunakv_sidecar_bootstrap_queries_total"),
        1,
        "cached per host:port"
    );
}

#[test]
fn mooncake_2p1d_chat_and_completions_use_each_prefill_host() {
    let p1 = PrefillHost::start(0);
    let p2 = PrefillHost::start(p1.boot.http.port());
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "mooncake", p1.boot.http.port(), &[]);
    for (i, p) in [&p1, &p2, &p1, &p2].iter().enumerate() {
        for stream in [false, true] {
            // Completions on the first pair of hosts, chat on the second.
            let (path, body) = if i < 2 {
                let b = completion(&format!("{PROMPT} 2p1d {i} {stream}"), stream);
                ("/v1/completions", b)
            } else {
                let b = chat(&format!("{PROMPT} 2p1d {i} {stream}"), stream);
                ("/v1/chat/completions", b)
            };
            let want = expected(&d, path, &body);
            let r = post(
                sc.http,
                path,
                &[("x-prefiller-host-port", &p.target())],
                &body,
            );
            assert_eq!(r.status, 200, "{}", r.text());
            let got = if stream {
                sse_text(&r.body).0
            } else {
                output_of(&r.json())
            };
            assert_eq!(got, want);
        }
    }
    assert_eq!(p1.sim.stat("transfers_ok"), 4);
    assert_eq!(p2.sim.stat("transfers_ok"), 4);
    assert_eq!(
        d.stat("kv_bytes_received"),
        p1.sim.stat("kv_bytes_sent") + p2.sim.stat("kv_bytes_sent")
    );
    assert_eq!(sc.metric("lunakv_sidecar_bootstrap_queries_total"), 2);
}

#[test]
fn prefill_engine_down_is_an_error_not_a_hang_or_a_recompute() {
    let mut p = PrefillHost::start(0);
    let d = decoder(&[]);
    let sc = Sidecar::start(
        &d,
        "mooncake",
        p.boot.http.port(),
        &[
            "--prefill-max-retries=2".into(),
            "--prefill-retry-backoff=50ms".into(),
        ],
    );
    let hdr = [("x-prefiller-host-port", p.target())];
    let hdr: Vec<(&str, &str)> = hdr.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(
        post(sc.http, "/v1/completions", &hdr, &completion(PROMPT, false)).status,
        200
    );
    p.sim.proc.kill9();
    for stream in [false, true] {
        let t = Instant::now();
        let r = post(
            sc.http,
            "/v1/completions",
            &hdr,
            &completion(PROMPT, stream),
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "took {:?}",
            t.elapsed()
        );
        assert_eq!(r.status, 503, "{}", r.text());
        let v = r.json();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("prefill"),
            "{v}"
        );
        assert_eq!(v["error"]["code"], 503);
    }
    assert_eq!(
        sc.metric("lunakv_sidecar_prefill_retries_total"),
        4,
        "2 retries per request"
    );
    assert!(sc.metric("lunakv_sidecar_bootstrap_cache_drops_total") >= 1);
    // The decoder never computed the prompt itself.
    assert_eq!(d.stat("local_prefills"), 0);
    // Every cancelled decode leg is gone.
    assert!(
        wait_until(Duration::from_secs(10), || (d.stat("inflight") == 0)
            .then_some(()))
        .is_some()
    );
    assert!(
        wait_until(Duration::from_secs(5), || (sc
            .metric("lunakv_sidecar_inflight_requests")
            == 1)
            .then_some(()))
        .is_some()
    );
}

#[test]
fn bootstrap_down_is_a_502() {
    let host = fresh_host();
    // A prefill engine with no bootstrap server on its host.
    let ghost = Bootstrap::start(host, 0, &[]);
    let port = ghost.http.port();
    drop(ghost);
    let sim = Sim::start(
        host,
        0,
        "prefill",
        &[format!("--bootstrap=http://{host}:{port}")],
    );
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "mooncake", port, &[]);
    let t = Instant::now();
    let r = post(
        sc.http,
        "/v1/chat/completions",
        &[("x-prefiller-host-port", &sim.http.to_string())],
        &chat(PROMPT, true),
    );
    assert!(t.elapsed() < Duration::from_secs(7));
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bootstrap")
    );
    assert_eq!(d.stat("requests"), 0, "no decode without a prefill engine");
}

#[test]
fn restarted_prefill_engine_with_a_new_engine_id() {
    let mut p = PrefillHost::start(0);
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "mooncake", p.boot.http.port(), &[]);
    let target = p.target();
    let hdr = [("x-prefiller-host-port", target.as_str())];
    assert_eq!(
        post(sc.http, "/v1/completions", &hdr, &completion(PROMPT, false)).status,
        200
    );
    let old = p.sim.engine_id.clone();
    // Restart in place: same address, new engine id (as vLLM does at every start).
    p.sim.proc.kill9();
    let port = p.sim.http.port();
    let new = Sim::start(
        p.host,
        port,
        "prefill",
        &[
            format!("--bootstrap=http://{}", p.boot.http),
            "--lease-ttl-ms=1500".into(),
        ],
    );
    new.wait_registered();
    assert_ne!(new.engine_id, old);
    assert_eq!(
        p.boot.query()["0"]["engine_id"],
        new.engine_id.as_str(),
        "replaced, not refused"
    );
    p.sim = new;
    // The sidecar still caches the old id: the decoder refuses it, the entry is dropped, and
    // the request is retried with the new id, transparently.
    let body = completion(&format!("{PROMPT} after restart"), false);
    let want = expected(&d, "/v1/completions", &body);
    let r = post(sc.http, "/v1/completions", &hdr, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(output_of(&r.json()), want);
    assert!(sc.metric("lunakv_sidecar_bootstrap_cache_drops_total") >= 1);
    assert_eq!(p.sim.stat("transfers_ok"), 1);
}

#[test]
fn ssrf_protection_checks_host_and_port() {
    let p = PrefillHost::start(0);
    let d = decoder(&[]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("allow.txt");
    std::fs::write(&file, "# nothing yet\n").unwrap();
    let sc = Sidecar::start(
        &d,
        "mooncake",
        p.boot.http.port(),
        &[
            "--enable-ssrf-protection".into(),
            format!("--ssrf-allowlist={}", p.target()),
            format!("--ssrf-allowlist-file={}", file.display()),
        ],
    );
    let ok = post(
        sc.http,
        "/v1/completions",
        &[("x-prefiller-host-port", &p.target())],
        &completion(PROMPT, false),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    let other_port = format!("{}:{}", p.host, p.sim.http.port() + 1);
    let other_host = format!("127.0.0.9:{}", p.sim.http.port());
    for t in [&other_port, &other_host] {
        let r = post(
            sc.http,
            "/v1/completions",
            &[("x-prefiller-host-port", t)],
            &completion(PROMPT, false),
        );
        assert_eq!(r.status, 403, "{t}: {}", r.text());
        assert_eq!(
            r.json()["error"]["message"],
            "Forbidden: prefill target not allowed by SSRF protection"
        );
    }
    // The watched file is re-read when it changes.
    std::fs::write(&file, format!("{other_port}\n")).unwrap();
    let allowed = wait_until(Duration::from_secs(5), || {
        let r = post(
            sc.http,
            "/v1/completions",
            &[("x-prefiller-host-port", &other_port)],
            &completion(PROMPT, false),
        );
        (r.status != 403).then_some(r.status)
    });
    assert!(allowed.is_some(), "allowlist file change not picked up");
    assert_eq!(d.stat("local_prefills"), 0);
}

#[test]
fn bad_requests_and_bad_flags() {
    let p = PrefillHost::start(0);
    let d = decoder(&[]);
    let sc = Sidecar::start(
        &d,
        "mooncake",
        p.boot.http.port(),
        &["--max-body-bytes=65536".into()],
    );
    let hdr = [("x-prefiller-host-port", p.target())];
    let hdr: Vec<(&str, &str)> = hdr.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let r = request(sc.http, "POST", "/v1/completions", &hdr, b"{\"prompt\": ");
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "BadRequestError");
    let huge = json!({"prompt": "x ".repeat(100_000), "max_tokens": 1});
    let r = post(sc.http, "/v1/completions", &hdr, &huge);
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(d.stat("requests"), 0);

    let out = std::process::Command::new(lunakv_tests::bin("lunakv-sidecar"))
        .args(["--kv-connector=lmcache", "--port=0", "--host=127.0.0.1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let msg = String::from_utf8_lossy(&out.stderr);
    for v in ["nixlv2", "shared-storage", "mooncake", "lmcache"] {
        assert!(msg.contains(v), "{msg}");
    }
    let out = std::process::Command::new(lunakv_tests::bin("lunakv-sidecar"))
        .args(["--mooncake-bootstrap-port=0", "--port=0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn client_disconnect_mid_stream_leaves_nothing_behind() {
    let p = PrefillHost::start(0);
    let d = decoder(&["--decode-us-per-token=50000".into()]);
    let sc = Sidecar::start(&d, "mooncake", p.boot.http.port(), &[]);
    let mut body = completion(PROMPT, true);
    body["max_tokens"] = json!(400);
    for with_pd in [true, false] {
        let target = p.target();
        let hdr: Vec<(&str, &str)> = if with_pd {
            vec![("x-prefiller-host-port", &target)]
        } else {
            vec![]
        };
        let s = start_stream(sc.http, "/v1/completions", &hdr, &body, 200);
        assert!(sc.metric("lunakv_sidecar_upstream_streams") >= 1);
        assert!(d.stat("inflight") >= 1);
        drop(s);
        let clean = wait_until(Duration::from_secs(10), || {
            (sc.metric("lunakv_sidecar_inflight_requests") == 1
                && sc.metric("lunakv_sidecar_upstream_streams") == 0
                && d.stat("inflight") == 0)
                .then_some(())
        });
        assert!(
            clean.is_some(),
            "with_pd={with_pd}: sidecar inflight {} streams {}, decoder inflight {}",
            sc.metric("lunakv_sidecar_inflight_requests"),
            sc.metric("lunakv_sidecar_upstream_streams"),
            d.stat("inflight")
        );
    }
}

#[test]
fn nixlv2_and_shared_storage_flows() {
    let prefill = nixl_prefill();
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "nixlv2", 8998, &[]);
    let hdr = [("x-prefiller-host-port", prefill.http.to_string())];
    let hdr: Vec<(&str, &str)> = hdr.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for stream in [false, true] {
        let body = chat(&format!("{PROMPT} nixl {stream}"), stream);
        let want = expected(&d, "/v1/chat/completions", &body);
        let r = post(sc.http, "/v1/chat/completions", &hdr, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let got = if stream {
            sse_text(&r.body).0
        } else {
            output_of(&r.json())
        };
        assert_eq!(got, want);
    }
    assert_eq!(prefill.stat("transfers_ok"), 2);
    assert!(d.stat("kv_bytes_received") > 0);

    let sc = Sidecar::start(&d, "shared-storage", 8998, &[]);
    let body = completion(&format!("{PROMPT} shared"), false);
    let want = expected(&d, "/v1/completions", &body);
    let before = prefill.stat("requests");
    let r = post(sc.http, "/v1/completions", &hdr, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(output_of(&r.json()), want);
    assert_eq!(prefill.stat("requests"), before + 1);
}

#[test]
fn data_parallel_ports_map_and_each_rank_registers_its_own_dp_rank() {
    // Prefill side: one multi-port DP engine, two ranks, each registering its own dp rank
    // (vLLM #51531 registered every rank as 0 and got "Engine ID mismatch").
    let host = fresh_host();
    let boot = Bootstrap::start(host, 0, &["--lease-ttl=1500ms"]);
    let prefill = Sim::start(
        host,
        0,
        "prefill",
        &[
            format!("--bootstrap=http://{}", boot.http),
            "--lease-ttl-ms=1500".into(),
            "--data-parallel-size=2".into(),
        ],
    );
    let (p0, id0) = prefill.rank(0);
    let (p1, id1) = prefill.rank(1);
    assert_ne!(id0, id1);
    let both = wait_until(Duration::from_secs(10), || {
        let q = boot.query();
        (q["0"]["engine_id"] == id0.as_str() && q["1"]["engine_id"] == id1.as_str()).then_some(q)
    });
    let q = both.unwrap_or_else(|| panic!("both ranks never registered: {}", boot.query()));
    assert_eq!(q["0"]["worker_addr"]["0"]["0"], format!("tcp://{p0}"));
    assert_eq!(q["1"]["worker_addr"]["0"]["0"], format!("tcp://{p1}"));

    // Decode side: ranks on m and m+1; the sidecar's listener i goes to m+i.
    let m = lunakv_tests::pd::free_port_run(2);
    let d = Sim::start(
        "127.0.0.1".parse().unwrap(),
        m,
        "decode",
        &["--data-parallel-size=2".into()],
    );
    let sc = Sidecar::start(
        &d,
        "mooncake",
        boot.http.port(),
        &["--data-parallel-size=2".into()],
    );
    assert_eq!(sc.listeners.len(), 2, "one listener per rank");
    let (d1, _) = d.rank(1);
    assert_eq!(d1.port(), d.http.port() + 1);
    for (i, l) in sc.listeners.iter().enumerate() {
        let r = request(*l, "GET", "/sim/stats", &[], b"");
        assert_eq!(
            r.json()["dp_rank"],
            i,
            "listener {i} reached the wrong rank"
        );
    }
    // P/D through both listeners: the sidecar picks a dp rank from /query and names it in
    // X-data-parallel-rank; the prefill engine serves it on that rank, the decoder pulls the KV
    // from that rank's engine id.
    let target = p0.to_string();
    for (i, l) in sc.listeners.iter().enumerate() {
        let rank_addr = if i == 0 { d.http } else { d1 };
        for k in 0..6 {
            let body = completion(&format!("{PROMPT} dp {i} {k}"), false);
            let want = {
                let r = post(rank_addr, "/v1/completions", &[], &body);
                output_of(&r.json())
            };
            let r = post(
                *l,
                "/v1/completions",
                &[("x-prefiller-host-port", &target)],
                &body,
            );
            assert_eq!(r.status, 200, "listener {i}: {}", r.text());
            assert_eq!(output_of(&r.json()), want);
        }
        let stats = request(rank_addr, "GET", "/sim/stats", &[], b"").json();
        assert_eq!(stats["remote_decodes"], 6, "decode rank {i}: {stats}");
    }
    let served = |a| {
        request(a, "GET", "/sim/stats", &[], b"").json()["transfers_ok"]
            .as_u64()
            .unwrap_or(0)
    };
    // The sidecar picks a dp rank at random: 12 requests all on one rank happen once in ~2000
    // runs, so keep going (up to 40 more) until both ranks served, rather than flake.
    let mut extra = 0;
    while (served(p0) == 0 || served(p1) == 0) && extra < 40 {
        let body = completion(&format!("{PROMPT} dp extra {extra}"), false);
        let r = post(
            sc.listeners[0],
            "/v1/completions",
            &[("x-prefiller-host-port", &target)],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        extra += 1;
    }
    let (s0, s1) = (served(p0), served(p1));
    assert_eq!(s0 + s1, 12 + extra);
    assert!(s0 > 0 && s1 > 0, "both prefill ranks serve: {s0} / {s1}");
    // A rank the engine does not have is refused, not silently served by another.
    let r = post(
        p0,
        "/v1/completions",
        &[("x-data-parallel-rank", "7")],
        &completion(PROMPT, false),
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn idle_upstream_connections_close_before_the_engine_keep_alive() {
    // The engine closes idle connections after 600 ms (uvicorn does after 5 s). The sidecar's
    // idle timeout is shorter, so it never sends into a connection the engine is closing
    // (llm-d #1564: 90 s idle connections -> resets -> 502s).
    let d = decoder(&["--timeout-keep-alive-ms=600".into()]);
    let sc = Sidecar::start(&d, "nixlv2", 8998, &["--idle-conn-timeout=200ms".into()]);
    let body = completion(PROMPT, false);
    for round in 0..3 {
        let r = post(sc.http, "/v1/completions", &[], &body);
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        // Idle for twice the engine's keep-alive: the gap itself is what is tested (whose
        // timer closes the connection first), so it is a fixed time.
        std::thread::sleep(Duration::from_millis(1200));
    }
    let r = post(sc.http, "/v1/completions", &[], &body);
    assert_eq!(r.status, 200, "after the idle gap: {}", r.text());
    assert_eq!(
        d.stat("connections_closed_idle"),
        0,
        "the engine had to close an idle sidecar connection: {}",
        d.stats()
    );
    assert!(d.stat("connections_closed_by_peer") >= 3, "{}", d.stats());
    assert_eq!(sc.metric("lunakv_sidecar_decode_errors_total"), 0);

    // The control: a sidecar idling longer than the engine leaves the close to the engine,
    // which is the race behind the 502s (so the assertion above can fail).
    let d2 = decoder(&["--timeout-keep-alive-ms=600".into()]);
    let sc2 = Sidecar::start(&d2, "nixlv2", 8998, &["--idle-conn-timeout=30s".into()]);
    assert_eq!(post(sc2.http, "/v1/completions", &[], &body).status, 200);
    wait_until(Duration::from_secs(15), || {
        (d2.stat("connections_closed_idle") >= 1).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the engine never closed the idle connection: {}",
            d2.stats()
        )
    });
}

#[test]
fn configuration_file_sits_under_env_and_flags() {
    let p = PrefillHost::start(0);
    let d = decoder(&[]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sidecar.yaml");
    // The file names mooncake and a wrong bootstrap port; MOONCAKE_BOOTSTRAP_PORT (env) must
    // beat the file, and --model-server-port (a flag) the file's 1.
    std::fs::write(
        &file,
        "kv-connector: mooncake\nmooncake-bootstrap-port: 1\nmodel-server-port: 1\n\
         secure-proxy: false\nprefill-max-retries: 1\n",
    )
    .unwrap();
    let args = vec![
        "--host=127.0.0.1".to_string(),
        "--port=0".to_string(),
        format!("--model-server-host={}", d.http.ip()),
        format!("--model-server-port={}", d.http.port()),
        format!("--configuration-file={}", file.display()),
    ];
    let boot_port = p.boot.http.port().to_string();
    let proc = lunakv_tests::Proc::spawn(
        "lunakv-sidecar",
        &args,
        &[("MOONCAKE_BOOTSTRAP_PORT", &boot_port)],
    );
    let line = proc.wait_for_line("lunakv-sidecar listening", Duration::from_secs(20));
    assert!(line.contains("connector=mooncake"), "{line}");
    let addr: std::net::SocketAddr = lunakv_tests::fields(&line)["http"].parse().unwrap();
    let body = completion(&format!("{PROMPT} file"), false);
    let want = expected(&d, "/v1/completions", &body);
    let r = post(
        addr,
        "/v1/completions",
        &[("x-prefiller-host-port", &p.target())],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(output_of(&r.json()), want);
    assert_eq!(p.sim.stat("transfers_ok"), 1);
}

#[test]
fn every_disaggregated_route_goes_through_prefill_never_silently_decode_only() {
    // The simulator implements completions and chat only; the other routes answer 404 and are
    // counted by path, which shows where the sidecar sent each request (llm-d-router #1461:
    // /inference/v1/generate went decode-only).
    let prefill = nixl_prefill();
    let d = decoder(&[]);
    let sc = Sidecar::start(&d, "nixlv2", 8998, &["--prefill-max-retries=2".into()]);
    let target = prefill.http.to_string();
    let body = json!({"model": "sim", "input": PROMPT, "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 4});
    for path in ["/v1/responses", "/v1/messages", "/inference/v1/generate"] {
        let r = post(sc.http, path, &[("x-prefiller-host-port", &target)], &body);
        // A non-2xx prefill answer reaches the client as is, and a 404 is not retried.
        assert_eq!(r.status, 404, "{path}: {}", r.text());
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not served"),
            "{path}: {}",
            r.text()
        );
        assert_eq!(
            prefill.stats()["unrouted"][path],
            1,
            "{path} skipped the prefill"
        );
        assert!(
            d.stats()["unrouted"][path].is_null(),
            "{path} reached the decoder"
        );
        // Without the header it is the engine's route: reverse-proxied to the decoder.
        let r = post(sc.http, path, &[], &body);
        assert_eq!(r.status, 404);
        assert_eq!(d.stats()["unrouted"][path], 1);
    }
    assert_eq!(sc.metric("lunakv_sidecar_prefill_retries_total"), 0);
    assert_eq!(sc.metric("lunakv_sidecar_disaggregated_total"), 3);
}

/// The resident set of process `pid`, in bytes (VmRSS of /proc/<pid>/status).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// A sidecar counter or gauge.
fn sidecar_metric(sc: &Sidecar, name: &str) -> i64 {
    let text = request(sc.http, "GET", "/lunakv/sidecar/metrics", &[], b"").text();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the sidecar's metrics:\n{text}"))
}

#[test]
fn parallel_large_bodies_stay_within_the_buffer_budget() {
    use std::io::{Read, Write};
    const MIB: usize = 1 << 20;
    const BODY: usize = 60 * MIB;
    let prefill = nixl_prefill();
    let d = decoder(&[]);
    // Room for two 60 MiB bodies at once (each charged 4 times its size), not three.
    let budget = 512 * MIB;
    let sc = Sidecar::start(
        &d,
        "nixlv2",
        8998,
        &[format!("--max-buffered-body-bytes={budget}")],
    );
    let target = prefill.http.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         x-prefiller-host-port: {target}\r\nContent-Length: {BODY}\r\nConnection: close\r\n\r\n",
        sc.http
    );
    let connect = || {
        let s = std::net::TcpStream::connect(sc.http).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        s
    };
    // Two clients send all but the last byte of their bodies: the sidecar buffers both.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = connect();
        s.write_all(head.as_bytes()).unwrap();
        let mut body = vec![b' '; BODY - 1];
        body[0] = b'{';
        s.write_all(&body).unwrap();
        held.push(s);
    }
    let full = wait_until(Duration::from_secs(30), || {
        (sidecar_metric(&sc, "lunakv_sidecar_buffered_body_bytes") >= 2 * 4 * BODY as i64)
            .then_some(())
    });
    assert!(full.is_some(), "the two bodies were never buffered");
    // Six more arrive while those are held: each is refused at once with the limit and the
    // flag named, before its body is read.
    for _ in 0..6 {
        let mut s = connect();
        s.write_all(head.as_bytes()).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(
            text.contains("--max-buffered-body-bytes") && text.contains(&budget.to_string()),
            "{text}"
        );
        assert!(
            text.to_ascii_lowercase().contains("retry-after: 1"),
            "{text}"
        );
    }
    assert_eq!(
        sidecar_metric(&sc, "lunakv_sidecar_body_budget_refused_total"),
        6
    );
    // Memory, not time: two buffered bodies plus the process itself, far from 8 x 60 MiB.
    let rss = rss_bytes(sc.proc.pid());
    assert!(
        rss < 320 * MIB as u64,
        "sidecar RSS {} MiB with two 60 MiB bodies held",
        rss / MIB as u64
    );
    // The clients leave: the budget comes back and requests go through again.
    drop(held);
    let freed = wait_until(Duration::from_secs(10), || {
        (sidecar_metric(&sc, "lunakv_sidecar_buffered_body_bytes") == 0).then_some(())
    });
    assert!(freed.is_some(), "the budget was not released");
    let hdr = [("x-prefiller-host-port", target.as_str())];
    let body = completion(&format!("{PROMPT} after the flood"), false);
    let want = expected(&d, "/v1/completions", &body);
    let r = post(sc.http, "/v1/completions", &hdr, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(output_of(&r.json()), want);
}
