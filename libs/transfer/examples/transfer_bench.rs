//! Quick data-path benchmark: a segment owner in a child process, gets and puts from this one,
//! over tcp and shm, next to raw loopback TCP and memcpy baselines measured the same way.
//!
//! `cargo run --release -p lunakv-transfer --example transfer_bench [seconds_per_row]`

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferOptions, TransferRequest,
};

const SEG: u64 = 1 << 30;

fn serve() {
    let sock = std::env::temp_dir().join(format!("lunakv-bench-{}.sock", std::process::id()));
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: Some(sock),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let i = s.info();
    println!(
        "{} {} {}",
        i.transfer_endpoint,
        i.host_id,
        i.shm_socket.unwrap()
    );
    std::io::stdout().flush().unwrap();
    // Serve until the parent closes our stdin.
    let mut sink = String::new();
    let _ = std::io::stdin().read_to_string(&mut sink);
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn row(name: &str, size: usize, secs: f64, mut op: impl FnMut()) {
    op(); // warm
    let mut lat = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        op();
        lat.push(t.elapsed());
    }
    let total = start.elapsed();
    lat.sort();
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)].as_micros();
    println!(
        "{name:<28} {:>8} {:>7.2} GB/s  p50 {:>6} us  p99 {:>6} us  ({} ops)",
        human(size),
        gbps(size as u64 * lat.len() as u64, total),
        p(0.5),
        p(0.99),
        lat.len()
    );
}

fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{} KiB", n >> 10)
    }
}

/// Raw loopback TCP: a thread answers each 1-byte request with `size` bytes from a buffer.
fn raw_tcp(size: usize, secs: f64) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![7u8; size];
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut dst = vec![0u8; size];
    row("raw loopback tcp (thread)", size, secs, || {
        c.write_all(&[1]).unwrap();
        c.read_exact(&mut dst).unwrap();
    });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        return serve();
    }
    let secs: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let mut child = Command::new(&args[0])
        .arg("serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let parts: Vec<&str> = line.split_whitespace().collect();
    let target = Target {
        endpoint: parts[0].to_string(),
        host_id: parts[1].to_string(),
        shm_socket: Some(parts[2].to_string()),
        size: SEG,
        instance_id: None,
        capability: None,
    };
    let tcp = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    let shm = TransferEngine::new(TransferOptions {
        enable_shm: true,
        ..TransferOptions::default()
    });
    println!("shm usable: {}", shm.uses_shm(&target));
    for size in [64 << 10, 1 << 20, 4 << 20] {
        let src = vec![5u8; size];
        let mut dst = vec![0u8; size];
        row("memcpy", size, secs, || dst.copy_from_slice(&src));
        raw_tcp(size, secs);
        for (name, e) in [("tcp", &tcp), ("shm", &shm)] {
            let g = (size as u64) << 8 | u64::from(name == "shm");
            e.write(&target, g, "obj", 0, &[&src]).unwrap();
            row(&format!("{name} get"), size, secs, || {
                e.read(&target, g, 0, &mut [&mut dst[..]]).unwrap();
            });
            assert_eq!(dst, src);
            row(&format!("{name} put"), size, secs, || {
                e.write(&target, g, "obj", 0, &[&src]).unwrap();
            });
            // batch x32 of distinct objects
            let n = 32usize;
            let gens: Vec<u64> = (0..n as u64).map(|i| (g << 8) + i).collect();
            for (i, gg) in gens.iter().enumerate() {
                e.write(&target, *gg, "b", (i * size) as u64, &[&src])
                    .unwrap();
            }
            let mut bufs = vec![vec![0u8; size]; n];
            row(&format!("{name} batch get x32"), size * n, secs, || {
                let mut reqs: Vec<TransferRequest<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| TransferRequest::Read {
                        target: &target,
                        generation: gens[i],
                        offset: (i * size) as u64,
                        dst: vec![&mut b[..]],
                    })
                    .collect();
                for r in e.batch(&mut reqs) {
                    r.unwrap();
                }
            });
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
}
