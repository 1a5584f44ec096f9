//! This machine's limits, measured in the same run as the store rows: single-thread memcpy and
//! raw loopback TCP between two processes (this process and `lunakv __tcp-sink`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use super::stats::{Spread, percentile};

/// Chunk size of the streaming test: the same 4 MiB a big KV object moves in.
pub const STREAM_CHUNK: usize = 4 << 20;
/// Bytes per memcpy.
const MEMCPY_BYTES: usize = 64 << 20;
/// Ping-pong message size.
const PING_BYTES: usize = 64;

const OP_STREAM: u8 = b'S';
const OP_ECHO: u8 = b'E';
const ACK: u8 = b'K';

/// Single-thread memcpy of 64 MiB out of segment memory (a memfd mapping, as a shm get reads)
/// into a private buffer, `reps` times after one warm-up copy; GB/s. Between two private
/// buffers the figure swung between ~6.5 and ~13 GB/s here, with whether the kernel had
/// transparent huge pages to give, which a shmem segment never gets on this kernel; so the
/// limit copies from the pages a shm get copies from.
pub fn memcpy(reps: usize) -> anyhow::Result<Spread> {
    let gbps = lunakv_transfer::segment_copy_gbps(MEMCPY_BYTES, reps)
        .context("memcpy limit: cannot map segment memory (memfd)")?;
    Ok(Spread::of(gbps))
}

/// Raw loopback TCP figures.
#[derive(Debug, Clone, Serialize)]
pub struct Loopback {
    /// One-way streaming GB/s, 4 MiB writes, with the transfer library's socket settings
    /// (TCP_NODELAY, 4 MiB buffers).
    pub stream_gbps: Vec<f64>,
    /// 64-byte round trips, microseconds.
    pub ping_us: Vec<f64>,
}

impl Loopback {
    pub fn merge(&mut self, other: Loopback) {
        self.stream_gbps.extend(other.stream_gbps);
        self.ping_us.extend(other.ping_us);
    }

    pub fn stream(&self) -> Spread {
        Spread::of(self.stream_gbps.clone())
    }

    pub fn ping_p50_us(&self) -> f64 {
        let mut v = self.ping_us.clone();
        v.sort_by(f64::total_cmp);
        percentile(&v, 50.0)
    }

    pub fn ping_p99_us(&self) -> f64 {
        let mut v = self.ping_us.clone();
        v.sort_by(f64::total_cmp);
        percentile(&v, 99.0)
    }
}

/// Streams `bytes` one way `reps` times and does `pings` 64-byte round trips against a
/// `lunakv __tcp-sink` child process.
pub fn loopback(bytes: u64, reps: usize, pings: usize) -> anyhow::Result<Loopback> {
    let sink = Sink::spawn()?;
    let mut s = TcpStream::connect(&sink.addr)
        .with_context(|| format!("cannot connect to the tcp sink at {}", sink.addr))?;
    // Same socket settings as lunakv's transfer connections, so the comparison is like for like.
    lunakv_transfer::tune_socket(&s);
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let chunk = vec![0x3cu8; STREAM_CHUNK];
    // Warm-up: lets the receive window grow before anything is timed.
    stream_once(&mut s, &chunk, (64u64 << 20).min(bytes))?;
    let mut stream_gbps = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        stream_once(&mut s, &chunk, bytes)?;
        stream_gbps.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }

    let warm = 100;
    let mut header = vec![OP_ECHO];
    header.extend_from_slice(&((pings + warm) as u64).to_le_bytes());
    s.write_all(&header)?;
    let msg = [0x42u8; PING_BYTES];
    let mut back = [0u8; PING_BYTES];
    let mut ping_us = Vec::with_capacity(pings);
    for i in 0..pings + warm {
        let t = Instant::now();
        s.write_all(&msg)?;
        s.read_exact(&mut back)?;
        if i >= warm {
            ping_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(s);
    sink.stop();
    Ok(Loopback {
        stream_gbps,
        ping_us,
    })
}

fn stream_once(s: &mut TcpStream, chunk: &[u8], bytes: u64) -> anyhow::Result<()> {
    let mut header = vec![OP_STREAM];
    header.extend_from_slice(&bytes.to_le_bytes());
    s.write_all(&header)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    // The sink acks after it has read every byte: the time covers delivery, not just queueing.
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)
        .context("the tcp sink did not acknowledge the stream")?;
    if ack[0] != ACK {
        bail!("the tcp sink answered {:#x} instead of its ack", ack[0]);
    }
    Ok(())
}

/// The child process end of the measurement.
struct Sink {
    child: Child,
    // Held open: the sink exits when it sees EOF here (we stopped or died).
    stdin: Option<ChildStdin>,
    addr: String,
}

impl Sink {
    fn spawn() -> anyhow::Result<Sink> {
        let exe = std::env::current_exe().context("cannot find the running lunakv executable")?;
        let mut child = Command::new(&exe)
            .args(["__tcp-sink", "0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {} __tcp-sink", exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("sink stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading the tcp sink's address")?;
        let addr = crate::stack::listening_fields(&line).remove("addr");
        match addr {
            Some(addr) => Ok(Sink { child, stdin, addr }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the tcp sink printed {line:?} instead of its listening line")
            }
        }
    }

    fn stop(mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `lunakv __tcp-sink PORT`: binds 127.0.0.1:PORT, prints `listening addr=IP:PORT`, and serves
/// connections one at a time: `S` + u64 len = read and discard len bytes then ack one byte;
/// `E` + u64 count = echo `count` 64-byte messages. Exits when its stdin closes.
pub fn tcp_sink(port: u16) -> anyhow::Result<ExitCode> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("cannot bind 127.0.0.1:{port}"))?;
    println!("listening addr={}", listener.local_addr()?);
    std::io::stdout().flush()?;
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    let mut buf = vec![0u8; STREAM_CHUNK];
    for conn in listener.incoming() {
        let Ok(mut s) = conn else { continue };
        lunakv_transfer::tune_socket(&s);
        // A broken connection ends that connection only.
        let _ = serve(&mut s, &mut buf);
    }
    Ok(ExitCode::SUCCESS)
}

fn serve(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    loop {
        let mut header = [0u8; 9];
        match s.read_exact(&mut header) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            r => r?,
        }
        let n = u64::from_le_bytes(header[1..].try_into().unwrap_or_default());
        match header[0] {
            OP_STREAM => {
                let mut left = n;
                while left > 0 {
                    let want = left.min(buf.len() as u64) as usize;
                    let got = s.read(&mut buf[..want])?;
                    if got == 0 {
                        return Ok(());
                    }
                    left -= got as u64;
                }
                s.write_all(&[ACK])?;
            }
            OP_ECHO => {
                let mut msg = [0u8; PING_BYTES];
                for _ in 0..n {
                    s.read_exact(&mut msg)?;
                    s.write_all(&msg)?;
                }
            }
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcpy_reports_positive_rates() {
        let s = memcpy(2).expect("memfd");
        assert_eq!(s.samples.len(), 2);
        assert!(s.best >= s.median && s.median > 0.0);
    }

    #[test]
    fn sink_protocol_streams_and_echoes() {
        // serve() against an in-process listener: no child process, no timing checked.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = vec![0u8; 1024];
            serve(&mut s, &mut buf).expect("serve");
        });
        let mut c = TcpStream::connect(addr).expect("connect");
        stream_once(&mut c, &[7u8; 100], 1000).expect("stream");
        let mut h = vec![OP_ECHO];
        h.extend_from_slice(&1u64.to_le_bytes());
        c.write_all(&h).expect("header");
        c.write_all(&[9u8; PING_BYTES]).expect("ping");
        let mut back = [0u8; PING_BYTES];
        c.read_exact(&mut back).expect("pong");
        assert_eq!(back, [9u8; PING_BYTES]);
        drop(c);
        server.join().expect("server");
    }
}
