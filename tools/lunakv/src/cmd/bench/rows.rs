//! The store rows: put and get through [`StoreClient`] against the benchmark's own
//! lunakv-store, per transport (shm / tcp), value size and call shape (single / batch x32).
//!
//! A row's put is timed on a *writer* client; its get on a separate *reader* client whose
//! location cache was warmed with `batch_exists` (as vLLM's `batch_is_exist` does before a
//! load), so the get is the warm path: one transfer, no master call. Only the client calls are
//! timed; stamping values and checking every returned byte happen outside the timer.

use anyhow::{Context, bail};
use lunakv_client::{ClientOptions, ReplicateConfig, StoreClient};
use serde::Serialize;

use super::progress::Progress;
use super::stats::percentile;

/// Objects per batch call (vLLM batches a request's blocks; 32 is the figure).
pub const BATCH: usize = 32;
/// Value sizes of the rows.
pub const SIZES: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Same host: the client maps the segment's memfd; a get is one memcpy.
    Shm,
    /// `enable_shm = false`: bytes cross the loopback socket to the store process.
    Tcp,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
        }
    }
}

/// How much to move.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Bytes stored per pass of a row (all distinct objects).
    pub bytes_per_pass: u64,
    /// Timed calls wanted per row, single and batch; passes repeat until reached...
    pub min_single_calls: usize,
    pub min_batch_calls: usize,
    /// ...or until this many passes.
    pub max_passes: usize,
}

impl Plan {
    pub fn full() -> Plan {
        Plan {
            bytes_per_pass: 256 << 20,
            min_single_calls: 64,
            min_batch_calls: 16,
            max_passes: 8,
        }
    }

    pub fn quick() -> Plan {
        Plan {
            bytes_per_pass: 32 << 20,
            min_single_calls: 16,
            min_batch_calls: 4,
            max_passes: 2,
        }
    }

    /// Objects per pass: the pass's bytes, at least one full batch.
    fn objects(&self, size: usize, batch: usize) -> usize {
        let n = ((self.bytes_per_pass / size as u64) as usize).max(batch);
        n.div_ceil(batch) * batch
    }

    fn passes(&self, calls_per_pass: usize, batch: usize) -> usize {
        let want = if batch == 1 {
            self.min_single_calls
        } else {
            self.min_batch_calls
        };
        want.div_ceil(calls_per_pass.max(1))
            .clamp(1, self.max_passes)
    }

    /// Segment bytes a row needs at once (one pass of the largest size, batched).
    pub fn segment_bytes_needed(&self) -> u64 {
        let largest = SIZES[SIZES.len() - 1];
        (self.objects(largest, BATCH) * largest) as u64
    }
}

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// e.g. `tcp_get_4m_single`, `shm_put_64k_batch32`.
    pub name: String,
    pub transport: &'static str,
    pub op: &'static str,
    /// `single` or `batch32`.
    pub mode: String,
    pub batch: usize,
    pub value_bytes: usize,
    /// Timed calls (a batch call moves `batch` objects).
    pub calls: usize,
    pub objects: usize,
    pub bytes: u64,
    /// Sum of the timed calls.
    pub seconds: f64,
    /// bytes / seconds / 1e9.
    pub gbps: f64,
    /// Objects per second.
    pub ops_per_sec: f64,
    /// Per call, microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
}

impl Row {
    fn new(t: Transport, op: &'static str, size: usize, batch: usize, mut lat_s: Vec<f64>) -> Row {
        let seconds: f64 = lat_s.iter().sum();
        let objects = lat_s.len() * batch;
        let bytes = (objects * size) as u64;
        lat_s.sort_by(f64::total_cmp);
        let mode = if batch == 1 {
            "single".to_owned()
        } else {
            format!("batch{batch}")
        };
        Row {
            name: format!("{}_{op}_{}_{mode}", t.name(), size_tag(size)),
            transport: t.name(),
            op,
            mode,
            batch,
            value_bytes: size,
            calls: lat_s.len(),
            objects,
            bytes,
            seconds,
            gbps: if seconds > 0.0 {
                bytes as f64 / seconds / 1e9
            } else {
                0.0
            },
            ops_per_sec: if seconds > 0.0 {
                objects as f64 / seconds
            } else {
                0.0
            },
            p50_us: percentile(&lat_s, 50.0) * 1e6,
            p99_us: percentile(&lat_s, 99.0) * 1e6,
        }
    }
}

/// `64k`, `1m`, `4m`.
pub fn size_tag(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{}m", size >> 20)
    } else {
        format!("{}k", size >> 10)
    }
}

/// Runs every row of one transport against the master at `master`.
pub fn run_transport(
    master: &str,
    t: Transport,
    plan: &Plan,
    progress: &Progress,
) -> anyhow::Result<Vec<Row>> {
    let connect = |role: &str| {
        StoreClient::connect(ClientOptions {
            master_server_address: master.to_owned(),
            global_segment_size: 0,
            enable_shm: t == Transport::Shm,
            ..ClientOptions::default()
        })
        .with_context(|| format!("connecting the {} {role} client", t.name()))
    };
    let writer = connect("writer")?;
    let reader = connect("reader")?;
    let mut rows = Vec::new();
    for size in SIZES {
        let mut w = Workload::new(size);
        for batch in [1, BATCH] {
            let (put, get) = w.run(&writer, &reader, t, plan, batch, progress)?;
            for r in [&put, &get] {
                progress.done(&format!(
                    "{} {:.2} GB/s, p50 {:.0} us",
                    r.name, r.gbps, r.p50_us
                ));
            }
            rows.push(put);
            rows.push(get);
        }
    }
    writer.close()?;
    reader.close()?;
    Ok(rows)
}

/// Buffers for one value size: a pattern, and stamped copies of it.
struct Workload {
    size: usize,
    pattern: Vec<u8>,
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
}

impl Workload {
    fn new(size: usize) -> Workload {
        let pattern = pattern(size as u64, size);
        Workload {
            size,
            src: vec![pattern.clone(); BATCH],
            // Non-zero so the pages are faulted in before the first timed get.
            dst: vec![vec![1u8; size]; BATCH],
            pattern,
        }
    }

    /// One put row and one get row for `batch` (1 = single calls).
    fn run(
        &mut self,
        writer: &StoreClient,
        reader: &StoreClient,
        t: Transport,
        plan: &Plan,
        batch: usize,
        progress: &Progress,
    ) -> anyhow::Result<(Row, Row)> {
        let size = self.size;
        let n = plan.objects(size, batch);
        let passes = plan.passes(n / batch, batch);
        let label = format!(
            "{} {} {}",
            t.name(),
            size_tag(size),
            if batch == 1 { "single" } else { "batch32" }
        );
        let key = |pass: usize, i: usize| {
            format!("bench/{}/{}/b{batch}/p{pass}/{i}", t.name(), size_tag(size))
        };

        // Puts: every pass stores new objects; all but the last pass are removed untimed.
        let mut put_lat = Vec::new();
        for pass in 0..passes {
            progress.show(&format!("{label} put, pass {}/{passes}", pass + 1));
            let keys: Vec<String> = (0..n).map(|i| key(pass, i)).collect();
            for (c, chunk) in keys.chunks(batch).enumerate() {
                for (j, buf) in self.src.iter_mut().take(chunk.len()).enumerate() {
                    apply_stamp(buf, stamp(size, pass, c * batch + j));
                }
                if batch == 1 {
                    let t0 = std::time::Instant::now();
                    writer.put(&chunk[0], &self.src[0])?;
                    put_lat.push(t0.elapsed().as_secs_f64());
                } else {
                    let items: Vec<(&str, Vec<&[u8]>)> = chunk
                        .iter()
                        .zip(&self.src)
                        .map(|(k, b)| (k.as_str(), vec![&b[..]]))
                        .collect();
                    let t0 = std::time::Instant::now();
                    let results = writer.batch_put(&items, &ReplicateConfig::default());
                    put_lat.push(t0.elapsed().as_secs_f64());
                    for (r, k) in results.into_iter().zip(chunk) {
                        r.with_context(|| format!("batch_put of '{k}'"))?;
                    }
                }
            }
            if pass + 1 < passes {
                writer.remove_all(true).context("removing a put pass")?;
            }
        }
        let last = passes - 1;
        let keys: Vec<String> = (0..n).map(|i| key(last, i)).collect();

        // Warm the reader's location cache the way vLLM does before loading.
        for chunk in keys.chunks(1024) {
            let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            for (r, k) in reader.batch_exists(&refs).into_iter().zip(chunk) {
                if !r.with_context(|| format!("batch_exists of '{k}'"))? {
                    bail!("'{k}' was put but the reader does not see it");
                }
            }
        }

        let gets = plan.passes(n / batch, batch);
        let mut get_lat = Vec::new();
        for gp in 0..gets {
            progress.show(&format!("{label} get, pass {}/{gets}", gp + 1));
            for (c, chunk) in keys.chunks(batch).enumerate() {
                if batch == 1 {
                    let t0 = std::time::Instant::now();
                    let got = reader.get_into(&chunk[0], &mut self.dst[0])?;
                    get_lat.push(t0.elapsed().as_secs_f64());
                    check_size(&chunk[0], got, size)?;
                } else {
                    let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
                    let mut dsts: Vec<Vec<&mut [u8]>> = self
                        .dst
                        .iter_mut()
                        .take(chunk.len())
                        .map(|d| vec![&mut d[..]])
                        .collect();
                    let t0 = std::time::Instant::now();
                    let results = reader.batch_get_into(&refs, &mut dsts);
                    get_lat.push(t0.elapsed().as_secs_f64());
                    for (r, k) in results.into_iter().zip(chunk) {
                        let got = r.with_context(|| format!("batch_get_into of '{k}'"))?;
                        check_size(k, got, size)?;
                    }
                }
                for (j, k) in chunk.iter().enumerate() {
                    verify(
                        k,
                        &self.dst[j],
                        &self.pattern,
                        stamp(size, last, c * batch + j),
                    )?;
                }
            }
        }
        writer
            .remove_all(true)
            .context("removing the row's objects")?;
        Ok((
            Row::new(t, "put", size, batch, put_lat),
            Row::new(t, "get", size, batch, get_lat),
        ))
    }
}

/// Objects stored once and read back pass after pass, for the paired trials: each
/// [`GetBench::pass`] is one row sample (single gets, warm location cache, checked bytes).
pub struct GetBench {
    reader: StoreClient,
    writer: StoreClient,
    keys: Vec<String>,
    w: Workload,
}

impl GetBench {
    pub fn start(master: &str, t: Transport, size: usize, plan: &Plan) -> anyhow::Result<GetBench> {
        let connect = |role: &str| {
            StoreClient::connect(ClientOptions {
                master_server_address: master.to_owned(),
                global_segment_size: 0,
                enable_shm: t == Transport::Shm,
                ..ClientOptions::default()
            })
            .with_context(|| format!("connecting the paired {} {role} client", t.name()))
        };
        let writer = connect("writer")?;
        let reader = connect("reader")?;
        let mut w = Workload::new(size);
        let keys: Vec<String> = (0..plan.objects(size, 1))
            .map(|i| format!("bench/paired/{}/{}/{i}", t.name(), size_tag(size)))
            .collect();
        for (i, k) in keys.iter().enumerate() {
            apply_stamp(&mut w.src[0], stamp(size, 0, i));
            writer.put(k, &w.src[0])?;
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        for (r, k) in reader.batch_exists(&refs).into_iter().zip(&keys) {
            if !r.with_context(|| format!("batch_exists of '{k}'"))? {
                bail!("'{k}' was put but the reader does not see it");
            }
        }
        Ok(GetBench {
            reader,
            writer,
            keys,
            w,
        })
    }

    /// One pass of single gets over every object: GB/s over the summed call times.
    pub fn pass(&mut self) -> anyhow::Result<f64> {
        let size = self.w.size;
        let mut seconds = 0.0;
        for (i, k) in self.keys.iter().enumerate() {
            let t0 = std::time::Instant::now();
            let got = self.reader.get_into(k, &mut self.w.dst[0])?;
            seconds += t0.elapsed().as_secs_f64();
            check_size(k, got, size)?;
            verify(k, &self.w.dst[0], &self.w.pattern, stamp(size, 0, i))?;
        }
        let bytes = (self.keys.len() * size) as f64;
        Ok(if seconds > 0.0 {
            bytes / seconds / 1e9
        } else {
            0.0
        })
    }

    pub fn finish(self) -> anyhow::Result<()> {
        self.writer.remove_all(true)?;
        self.writer.close()?;
        self.reader.close()?;
        Ok(())
    }
}

fn check_size(key: &str, got: u64, want: usize) -> anyhow::Result<()> {
    if got != want as u64 {
        bail!("get of '{key}' returned {got} bytes, {want} were put");
    }
    Ok(())
}

/// Deterministic pseudo-random bytes (xorshift), so compression or zero pages flatter nothing.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let take = (len - out.len()).min(8);
        out.extend_from_slice(&x.to_le_bytes()[..take]);
    }
    out
}

/// Per-object marker written at both ends of a value, so a get that returns another object
/// (or another pass's) is caught.
fn stamp(size: usize, pass: usize, i: usize) -> [u8; 8] {
    (0x6c75_6e61_0000_0000u64 ^ ((pass as u64) << 40) ^ ((size as u64) << 20) ^ i as u64)
        .to_le_bytes()
}

fn apply_stamp(buf: &mut [u8], s: [u8; 8]) {
    let n = buf.len();
    buf[..8].copy_from_slice(&s);
    buf[n - 8..].copy_from_slice(&s);
}

fn verify(key: &str, got: &[u8], pattern: &[u8], s: [u8; 8]) -> anyhow::Result<()> {
    let n = got.len();
    if got[..8] != s || got[n - 8..] != s {
        bail!("get of '{key}' returned another object's bytes (stamp mismatch)");
    }
    if got[8..n - 8] != pattern[8..n - 8] {
        let at = got[8..n - 8]
            .iter()
            .zip(&pattern[8..n - 8])
            .position(|(a, b)| a != b)
            .map_or(0, |p| p + 8);
        bail!("get of '{key}' returned corrupted bytes (first difference at offset {at})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_move_whole_batches_and_bounded_passes() {
        let p = Plan::full();
        assert_eq!(p.objects(64 << 10, 1), 4096);
        assert_eq!(p.objects(4 << 20, 1), 64);
        assert_eq!(p.objects(4 << 20, BATCH), 64);
        assert_eq!(p.passes(64, 1), 1);
        assert_eq!(p.passes(2, BATCH), 8);
        let q = Plan::quick();
        assert_eq!(q.objects(4 << 20, BATCH), 32);
        assert_eq!(q.passes(1, BATCH), 2);
        assert_eq!(p.segment_bytes_needed(), 256 << 20);
        assert_eq!(q.segment_bytes_needed(), 128 << 20);
    }

    #[test]
    fn verify_catches_stamps_and_corruption() {
        let pat = pattern(1, 1024);
        let mut v = pat.clone();
        apply_stamp(&mut v, stamp(1024, 0, 3));
        verify("k", &v, &pat, stamp(1024, 0, 3)).expect("intact");
        assert!(verify("k", &v, &pat, stamp(1024, 0, 4)).is_err());
        assert!(verify("k", &v, &pat, stamp(1024, 1, 3)).is_err());
        v[500] ^= 1;
        let e = verify("k", &v, &pat, stamp(1024, 0, 3)).expect_err("corrupt");
        assert!(e.to_string().contains("offset 500"), "{e}");
    }

    #[test]
    fn row_math() {
        let r = Row::new(Transport::Tcp, "get", 4 << 20, BATCH, vec![0.5, 0.5]);
        assert_eq!(r.name, "tcp_get_4m_batch32");
        assert_eq!(r.objects, 64);
        assert_eq!(r.bytes, 64 * (4 << 20));
        assert!((r.gbps - r.bytes as f64 / 1e9).abs() < 1e-9);
        assert!((r.ops_per_sec - 64.0).abs() < 1e-9);
        assert!((r.p50_us - 500_000.0).abs() < 1e-6);
        assert_eq!(size_tag(64 << 10), "64k");
    }
}
