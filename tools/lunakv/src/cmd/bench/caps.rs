//! `lunakv bench --caps`: what capabilities on the data path cost (docs/SECURITY.md,
//! "Capabilities"). Two segment servers in this process, one requiring capabilities and one
//! not, the same requester engine, the same objects; single gets alternate between them pass by
//! pass (paired trials, docs/BENCH.md), so a burst of neighbour load lands on both sides of a
//! ratio. Target: the median on/off ratio >= 0.95 on every row.
//!
//! The master is left out on purpose: it issues a capability only on a cold get or a put (one
//! keyed hash beside a gRPC round trip of ~150 us), while the owner checks one on every request,
//! which is what these rows time. The raw cost of one check is printed too.

use std::time::Instant;

use lunakv_transfer::cap::{READ_TTL, RIGHT_READ, RIGHT_WRITE};
use lunakv_transfer::{
    Capability, Grant, MountSecret, SegmentServer, SegmentServerConfig, Target, TransferEngine,
    TransferOptions,
};
use serde::Serialize;

use super::paired::{PairedRatio, interleave, loadavg};

const TARGET: f64 = 0.95;

/// One row: a transport and an object size, gets alternating between the two servers.
#[derive(Debug, Serialize)]
pub struct CapsRow {
    pub name: &'static str,
    pub object_bytes: u64,
    pub gets_per_pass: usize,
    /// `limit` = capabilities off, `row` = on, in gets/s.
    pub paired: PairedRatio,
}

#[derive(Debug, Serialize)]
pub struct CapsReport {
    pub rows: Vec<CapsRow>,
    /// One `Capability::verify` (keyed BLAKE3 of ~70 bytes), in ns.
    pub verify_ns: f64,
    pub load_start: String,
    pub load_end: String,
    pub pass: bool,
}

struct Side {
    server: SegmentServer,
    /// One target per object (each with its own capability when the side requires them).
    targets: Vec<Target>,
}

fn generation(i: usize) -> u64 {
    (7 << 32) | i as u64
}

fn side(n: usize, len: u64, caps: bool) -> anyhow::Result<(Side, Option<MountSecret>)> {
    let dir = std::env::temp_dir().join(format!(
        "lunakv-bench-caps-{}-{}.sock",
        std::process::id(),
        caps
    ));
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse()?,
        size: (n as u64 * len).max(1 << 20),
        shm_socket: Some(dir),
        ..Default::default()
    })?;
    let secret = caps.then(MountSecret::generate);
    if let Some(k) = secret {
        server.require_capabilities(k);
    }
    let info = server.info();
    let writer = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    let value = vec![0x5Au8; len as usize];
    let mut targets = Vec::with_capacity(n);
    for i in 0..n {
        let g = Grant {
            segment: &info.name,
            generation: generation(i),
            offset: i as u64 * len,
            len,
        };
        let mut t = Target::from(&info);
        t.capability =
            secret.map(|k| Capability::issue(&k, &g, RIGHT_READ | RIGHT_WRITE, READ_TTL));
        writer.write(&t, g.generation, &format!("bench-{i}"), g.offset, &[&value])?;
        targets.push(t);
    }
    Ok((Side { server, targets }, secret))
}

/// One pass: a single get of every object, in order; gets/s.
fn pass(e: &TransferEngine, s: &Side, len: u64, buf: &mut [u8]) -> anyhow::Result<f64> {
    let t = Instant::now();
    for (i, target) in s.targets.iter().enumerate() {
        e.read(
            target,
            generation(i),
            i as u64 * len,
            &mut [&mut buf[..len as usize]],
        )?;
    }
    Ok(s.targets.len() as f64 / t.elapsed().as_secs_f64())
}

fn row(
    name: &'static str,
    shm: bool,
    len: u64,
    n: usize,
    pairs: usize,
) -> anyhow::Result<Option<CapsRow>> {
    let (off, _) = side(n, len, false)?;
    let (on, _) = side(n, len, true)?;
    let e = TransferEngine::new(TransferOptions {
        enable_shm: shm,
        ..TransferOptions::default()
    });
    if shm && !(e.uses_shm(&off.targets[0]) && e.uses_shm(&on.targets[0])) {
        return Ok(None);
    }
    let mut buf = vec![0u8; len as usize];
    // Warm both: connections, attachments, page faults.
    pass(&e, &off, len, &mut buf)?;
    pass(&e, &on, len, &mut buf)?;
    let mut buf2 = buf.clone();
    let pairs = interleave(
        pairs,
        |_| pass(&e, &off, len, &mut buf),
        |_| pass(&e, &on, len, &mut buf2),
    )?;
    let refused = on.server.refused_total();
    if refused > 0 {
        anyhow::bail!(
            "{name}: the capability side refused {refused} requests; its figures would not be gets"
        );
    }
    let via_shm = on.server.stats().shm_attaches > 0 && off.server.stats().shm_attaches > 0;
    if shm != via_shm {
        anyhow::bail!("{name}: expected shm={shm}, but the gets went the other way");
    }
    Ok(Some(CapsRow {
        name,
        object_bytes: len,
        gets_per_pass: n,
        paired: PairedRatio::judge(name, "caps on / off", "gets/s", pairs, TARGET),
    }))
}

fn verify_ns() -> f64 {
    let k = MountSecret::generate();
    let g = Grant {
        segment: "127.0.0.1:50052",
        generation: 7 << 32,
        offset: 1 << 20,
        len: 65536,
    };
    let c = Capability::issue(&k, &g, RIGHT_READ, READ_TTL);
    let n = 200_000;
    let t = Instant::now();
    let mut ok = 0usize;
    for _ in 0..n {
        ok += usize::from(std::hint::black_box(&c).verify(&k, &g, RIGHT_READ).is_ok());
    }
    assert_eq!(ok, n);
    t.elapsed().as_nanos() as f64 / n as f64
}

pub fn run(quick: bool, pairs: usize) -> anyhow::Result<CapsReport> {
    let load_start = loadavg();
    let (small, big) = if quick { (500, 16) } else { (4000, 64) };
    let mut rows = Vec::new();
    for (name, shm, len, n) in [
        ("tcp_get_64k", false, 64 << 10, small),
        ("tcp_get_4m", false, 4 << 20, big),
        ("shm_get_64k", true, 64 << 10, small),
    ] {
        if let Some(r) = row(name, shm, len, n, pairs)? {
            eprintln!(
                "bench: done {name} caps on/off {:.3}x",
                r.paired.median_ratio
            );
            rows.push(r);
        }
    }
    let verify_ns = verify_ns();
    let pass = !rows.is_empty() && rows.iter().all(|r| r.paired.pass);
    Ok(CapsReport {
        rows,
        verify_ns,
        load_start,
        load_end: loadavg(),
        pass,
    })
}

pub fn render(r: &CapsReport) -> String {
    let mut s = format!(
        "lunakv bench --caps: single gets alternating between two segment servers in one \
         process, capabilities off and on (load {} -> {})\n{:<14} {:>8} {:>14} {:>14} {:>26}\n",
        r.load_start,
        r.load_end,
        "row",
        "object",
        "off gets/s",
        "on gets/s",
        "on/off median [min-max]"
    );
    for row in &r.rows {
        let p = &row.paired;
        s.push_str(&format!(
            "{:<14} {:>8} {:>14.0} {:>14.0} {:>10.3}x [{:.3}-{:.3}] {}\n",
            row.name,
            crate::output::human_bytes(row.object_bytes),
            p.median_of(|x| x.limit),
            p.median_of(|x| x.row),
            p.median_ratio,
            p.min_ratio,
            p.max_ratio,
            if p.pass { "PASS" } else { "MISS" }
        ));
    }
    s.push_str(&format!(
        "one capability check (keyed BLAKE3): {:.0} ns; target on/off >= {TARGET}x: {}\n",
        r.verify_ns,
        if r.pass { "PASS" } else { "MISS" }
    ));
    s
}
