//! Harness for the P/D tests: `lunakv-bootstrap`, `lunakv-engine-sim` and `lunakv-sidecar` on
//! loopback, and a tiny blocking HTTP/1.1 client over a raw socket. It stays hand-written on
//! purpose (plain GETs go through lunakv-http, `crate::http_get`): the tests bind a chosen source
//! address per simulated peer, read an SSE stream a chunk at a time, hang up mid-stream and send
//! headers a client library would normalise or refuse.
//!
//! The sidecar finds a prefill host's bootstrap at `<prefill-host>:<bootstrap-port>`, so every
//! simulated prefill *host* gets its own loopback address (127.x.y.z) with its own bootstrap
//! on one shared port, exactly as pods with one IP each.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::{Proc, fields};

/// A port `p` on 127.0.0.1 with `p + 1 .. p + n` free too. Probed and released, so another
/// process could take one in between; rare enough on a test machine.
pub fn free_port_run(n: u16) -> u16 {
    loop {
        let p = crate::free_port();
        if p.checked_add(n).is_none() {
            continue;
        }
        let all_free = (1..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok());
        if all_free {
            return p;
        }
    }
}

/// A fresh loopback address per call (`127.<pid-derived>.<n>.1`), so parallel tests and test
/// binaries never share a host.
pub fn fresh_host() -> IpAddr {
    static N: AtomicU32 = AtomicU32::new(1);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    IpAddr::from([
        127,
        (20 + pid % 200) as u8,
        (n % 250) as u8 + 1,
        (pid / 200 % 250) as u8 + 1,
    ])
}

fn addr_of(line: &str, key: &str) -> SocketAddr {
    fields(line)
        .get(key)
        .unwrap_or_else(|| panic!("no {key}= in '{line}'"))
        .parse()
        .unwrap_or_else(|e| panic!("bad {key} in '{line}': {e}"))
}

pub struct Bootstrap {
    pub proc: Proc,
    pub http: SocketAddr,
    pub grpc: SocketAddr,
}

impl Bootstrap {
    /// On `host:port` (port 0 = pick one), short leases for tests unless `extra` says otherwise.
    pub fn start(host: IpAddr, port: u16, extra: &[&str]) -> Bootstrap {
        let mut args = vec![
            format!("--host={host}"),
            format!("--port={port}"),
            "--grpc-port=0".to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = Proc::spawn("lunakv-bootstrap", &args, &[]);
        let line = proc.wait_for_line("lunakv-bootstrap listening", Duration::from_secs(20));
        Bootstrap {
            http: addr_of(&line, "http"),
            grpc: addr_of(&line, "grpc"),
            proc,
        }
    }

    pub fn query(&self) -> serde_json::Value {
        let r = request(self.http, "GET", "/query", &[], b"");
        serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
    }
}

pub struct Sim {
    pub proc: Proc,
    pub http: SocketAddr,
    pub engine_id: String,
    pub args: Vec<String>,
}

impl Sim {
    pub fn start(host: IpAddr, port: u16, role: &str, extra: &[String]) -> Sim {
        let mut args = vec![
            format!("--host={host}"),
            format!("--port={port}"),
            format!("--role={role}"),
        ];
        args.extend(extra.iter().cloned());
        let proc = Proc::spawn("lunakv-engine-sim", &args, &[]);
        let line = proc.wait_for_line("lunakv-engine-sim listening", Duration::from_secs(20));
        Sim {
            http: addr_of(&line, "http"),
            engine_id: fields(&line).get("engine_id").cloned().unwrap_or_default(),
            proc,
            args,
        }
    }

    /// A prefill engine registering with `bootstrap` (lease 1.5 s, renewed every 0.5 s).
    pub fn prefill(host: IpAddr, bootstrap: &Bootstrap, extra: &[String]) -> Sim {
        let mut a = vec![
            format!("--bootstrap=http://{}", bootstrap.http),
            "--lease-ttl-ms=1500".to_string(),
        ];
        a.extend(extra.iter().cloned());
        let s = Sim::start(host, 0, "prefill", &a);
        s.wait_registered();
        s
    }

    /// Data-parallel rank `dp` of a `--data-parallel-size` simulator: its HTTP address and
    /// engine id.
    pub fn rank(&self, dp: u32) -> (SocketAddr, String) {
        let line = self
            .proc
            .wait_for_line(&format!(" dp_rank={dp}"), Duration::from_secs(20));
        let id = fields(&line).get("engine_id").cloned().unwrap_or_default();
        (addr_of(&line, "http"), id)
    }

    pub fn wait_registered(&self) {
        let ok = crate::wait_until(Duration::from_secs(10), || {
            (self.stats()["registered"] == true).then_some(())
        });
        assert!(
            ok.is_some(),
            "{} never registered:\n{}",
            self.http,
            self.proc.output()
        );
    }

    pub fn stats(&self) -> serde_json::Value {
        let r = request(self.http, "GET", "/sim/stats", &[], b"");
        serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn stat(&self, k: &str) -> u64 {
        self.stats()[k].as_u64().unwrap_or(0)
    }
}

pub struct Sidecar {
    pub proc: Proc,
    pub http: SocketAddr,
    /// Every listener, one per data-parallel rank (`http` is the first).
    pub listeners: Vec<SocketAddr>,
}

impl Sidecar {
    pub fn start(decoder: &Sim, connector: &str, bootstrap_port: u16, extra: &[String]) -> Sidecar {
        Sidecar::start_at(decoder.http, connector, bootstrap_port, extra)
    }

    /// In front of the model server at `model_server` (a simulator, or a TLS front of one).
    pub fn start_at(
        model_server: SocketAddr,
        connector: &str,
        bootstrap_port: u16,
        extra: &[String],
    ) -> Sidecar {
        let bin = crate::bin("lunakv-sidecar");
        Sidecar::start_bin(&bin, model_server, connector, bootstrap_port, extra)
    }

    /// [`Sidecar::start_at`] with the sidecar binary at `bin` (the benchmark compares builds).
    pub fn start_bin(
        bin: &std::path::Path,
        model_server: SocketAddr,
        connector: &str,
        bootstrap_port: u16,
        extra: &[String],
    ) -> Sidecar {
        let mut args = vec![
            "--host=127.0.0.1".to_string(),
            "--port=0".to_string(),
            format!("--vllm-port={}", model_server.port()),
            format!("--model-server-host={}", model_server.ip()),
            format!("--kv-connector={connector}"),
            format!("--mooncake-bootstrap-port={bootstrap_port}"),
            "--secure-proxy=false".to_string(),
        ];
        args.extend(extra.iter().cloned());
        let proc = Proc::spawn_path(bin, "lunakv-sidecar", &args, &[]);
        let line = proc.wait_for_line("lunakv-sidecar listening", Duration::from_secs(20));
        let listeners = fields(&line)
            .get("listeners")
            .map(|l| l.split(',').filter_map(|a| a.parse().ok()).collect())
            .unwrap_or_default();
        Sidecar {
            http: addr_of(&line, "http"),
            listeners,
            proc,
        }
    }

    /// A value from the sidecar's own metrics.
    pub fn metric(&self, name: &str) -> i64 {
        let r = request(self.http, "GET", "/lunakv/sidecar/metrics", &[], b"");
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.split_once(' ')?;
                (n == name).then(|| v.trim().parse().ok())?
            })
            .unwrap_or(-1)
    }
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn send_head(
    s: &mut impl Write,
    addr: impl std::fmt::Display,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    // A server may answer (413) before reading everything; ignore write errors on the body.
    let _ = s.write_all(body);
    s.flush()
}

/// One request on a fresh connection; reads the whole answer (de-chunked).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    exchange(s, addr, method, path, headers, body).expect("read the answer")
}

/// [`request`] from the source address `src` (a loopback host other than 127.0.0.1), as a peer
/// on that host would send it.
pub fn request_from(
    src: IpAddr,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let s = rt
        .block_on(async {
            let sock = if src.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            sock.bind(SocketAddr::new(src, 0))?;
            sock.connect(addr).await?.into_std()
        })
        .expect("connect from the source address");
    s.set_nonblocking(false).ok();
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    exchange(s, addr, method, path, headers, body).expect("read the answer")
}

/// POSTs JSON from the source address `src` (see [`request_from`]).
pub fn post_from(src: IpAddr, addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    request_from(src, addr, "POST", path, &[], body.to_string().as_bytes())
}

/// Sends one request on `s` (any stream: plain or TLS) and reads the whole answer.
pub fn exchange(
    mut s: impl Read + Write,
    host: impl std::fmt::Display,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    send_head(&mut s, host, method, path, headers, body)?;
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut hdrs = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
            break;
        }
        if let Some((k, v)) = l.trim_end().split_once(':') {
            hdrs.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let chunked = hdrs
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if r.read_line(&mut size).unwrap_or(0) == 0 {
                break;
            }
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0u8; n + 2];
            if r.read_exact(&mut chunk).is_err() {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let _ = r.read_to_end(&mut body);
    }
    Ok(Resp {
        status,
        headers: hdrs,
        body,
    })
}

/// POSTs JSON.
pub fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Resp {
    request(addr, "POST", path, headers, body.to_string().as_bytes())
}

/// Starts a request and returns the raw stream after the first `n` bytes of the answer were
/// read (for disconnect tests).
pub fn start_stream(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
    n: usize,
) -> TcpStream {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    send_head(
        &mut s,
        addr,
        "POST",
        path,
        headers,
        body.to_string().as_bytes(),
    )
    .expect("send the request head");
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).expect("first bytes of the stream");
    s
}

/// The concatenated text of an SSE completion/chat stream, and the usage chunk if any.
pub fn sse_text(body: &[u8]) -> (String, Option<serde_json::Value>, bool) {
    let mut text = String::new();
    let mut usage = None;
    let mut done = false;
    for line in String::from_utf8_lossy(body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).expect("SSE JSON");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(t) = c["text"].as_str() {
                text.push_str(t);
            }
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
        }
    }
    (text, usage, done)
}

/// The generated text of a non-streaming completion or chat answer.
pub fn output_of(v: &serde_json::Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .or_else(|| v["choices"][0]["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string()
}
