//! Command-line arguments (clap derive). Flags that name a service flag keep Mooncake's
//! underscore spelling as an alias, so `--rpc_port` works as well as `--rpc-port`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "lunakv",
    version,
    about = "Operate a lunakv (Mooncake Store compatible) KV-cache pool",
    after_help = "Master address: --master, else $MOONCAKE_MASTER, else master_server_address of \
                  --config / $MOONCAKE_CONFIG_PATH, else 127.0.0.1:50051.\n\
                  Exit status: 0 ok, 1 `exists` answered no or a `doctor` check failed, 2 error."
)]
pub struct Cli {
    /// The master's gRPC address.
    #[arg(long, global = true, value_name = "HOST:PORT")]
    pub master: Option<String>,

    /// mooncake_config.json to take master_server_address (and enable_shm) from.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Print exactly one JSON object on stdout (errors too: {"ok":false,"error":..,"code":..}).
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Segments, capacity, used bytes, keys and clients, as the master sees them.
    Status,
    /// Store FILE (or stdin for `-`) under KEY.
    Put {
        key: String,
        /// File to read, or `-` for stdin.
        #[arg(value_name = "FILE|-")]
        file: String,
    },
    /// Fetch KEY into FILE (default: stdout).
    Get {
        key: String,
        /// File to write, or `-` for stdout (the default).
        #[arg(value_name = "FILE|-")]
        file: Option<String>,
    },
    /// Print yes/no; exit 0 if KEY exists, 1 if not.
    Exists { key: String },
    /// Remove KEY.
    Rm {
        key: String,
        /// Remove even if a reader holds a lease on it.
        #[arg(long)]
        force: bool,
    },
    /// Check the whole stack (master, store-clients, SSD tier, offload settings, bootstrap,
    /// connectors, cross-instance key consistency): a pass/fail table with the fix for each
    /// failure. --config is the engine's mooncake_config.json. Exit 1 when a check fails.
    Doctor(DoctorArgs),
    /// Run lunakv-master + lunakv-store on loopback until Ctrl-C (what `make run` does).
    Up(UpArgs),
    /// Self-contained benchmark: starts its own master and store, measures, stops them.
    Bench(BenchArgs),
    /// Move a segment's objects (DRAM and SSD tier) to the other segments before its store
    /// leaves (upstream's drain jobs, on the master's admin port). Exit 1 when the drain ends
    /// FAILED or CANCELED or leaves objects that fit nowhere (they stay, listed).
    Drain(DrainArgs),
    /// List the pool's keys (the default tenant's), from the master's admin port (upstream's
    /// /get_all_keys): --prefix narrows them, --limit bounds what is printed.
    Keys(KeysArgs),
    /// Subscribe to the master's KV events and print them decoded, one line each (--json: one
    /// JSON object per line) until Ctrl-C or --count (docs/EVENTS.md).
    Events(EventsArgs),
    /// Internal: the peer process of bench's raw loopback TCP measurement.
    #[command(name = "__tcp-sink", hide = true)]
    TcpSink {
        /// Port to bind on 127.0.0.1 (0 = any free port; the bound address is printed).
        #[arg(default_value_t = 0)]
        port: u16,
    },
}

#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    /// Only keys that start with this.
    #[arg(long)]
    pub prefix: Option<String>,

    /// Print at most this many keys (0: all); the count is of every match.
    #[arg(long, default_value_t = 1000)]
    pub limit: usize,

    /// The master's admin port, HOST:PORT or a URL (default: the master's host, port 9003).
    /// LUNAKV_ADMIN_TOKEN (else LUNAKV_AUTH_TOKEN) is sent when set.
    #[arg(long, value_name = "HOST:PORT")]
    pub admin: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct DrainArgs {
    /// The segment to drain: its HOST:PORT, as `lunakv status` lists it.
    #[arg(value_name = "SEGMENT")]
    pub segment: Option<String>,

    /// Move objects only to this segment; repeatable (default: any other segment with room,
    /// the emptiest first).
    #[arg(long, value_name = "SEGMENT")]
    pub target: Vec<String>,

    /// Objects moved at once.
    #[arg(long, default_value_t = 16)]
    pub max_concurrency: u32,

    /// Bytes moved per second (default: the master's drain_max_bytes_per_sec; 0: unbounded).
    #[arg(long, value_name = "BYTES")]
    pub max_bytes_per_sec: Option<u64>,

    /// Wait for the job to end and print its report.
    #[arg(long)]
    pub wait: bool,

    /// With --wait: give up waiting after this many seconds (the job goes on; exit 2).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,

    /// The master's admin port, HOST:PORT or a URL (default: the master's host, port 9003).
    /// LUNAKV_ADMIN_TOKEN (else LUNAKV_AUTH_TOKEN) is sent when set.
    #[arg(long, value_name = "HOST:PORT")]
    pub admin: Option<String>,

    /// Cancel this drain job instead (its segments take placements again).
    #[arg(long, value_name = "JOB_ID", conflicts_with = "segment")]
    pub cancel: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Master gRPC port (0 = any free port).
    #[arg(long, alias = "rpc_port", default_value_t = 50051)]
    pub rpc_port: u16,

    /// Master admin/metrics HTTP port.
    #[arg(long, alias = "metrics_port", default_value_t = 9003)]
    pub metrics_port: u16,

    /// Store transfer port.
    #[arg(long, default_value_t = 50052)]
    pub store_port: u16,

    /// Store admin/metrics HTTP port.
    #[arg(long, alias = "store_metrics_port", default_value_t = 9004)]
    pub store_metrics_port: u16,

    /// DRAM the store contributes ("1GB" = 1 GiB, as vLLM parses sizes).
    #[arg(long, alias = "global_segment_size", default_value = "1GB")]
    pub segment_size: String,

    /// Where the generated mooncake_config.json (and by default the master's data) go.
    #[arg(long, default_value = ".lunakv-run")]
    pub run_dir: PathBuf,

    /// Master's embedded metadata directory (default: RUN_DIR/master).
    #[arg(long, alias = "data_dir")]
    pub data_dir: Option<PathBuf>,

    /// Directory holding lunakv-master and lunakv-store (default: next to this executable).
    #[arg(long, env = "LUNAKV_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// A store-client's admin endpoint (its --metrics_port, /health and /metrics); repeatable.
    #[arg(long = "store", value_name = "HOST:PORT")]
    pub store: Vec<String>,

    /// The store-client's offload directory on this host (MOONCAKE_OFFLOAD_FILE_STORAGE_PATH):
    /// the SSD check then also sees it grow.
    #[arg(long, value_name = "DIR")]
    pub offload_dir: Option<PathBuf>,

    /// The P/D bootstrap (lunakv-bootstrap or vLLM's), whose GET /query must list engines.
    #[arg(long, value_name = "HOST:PORT")]
    pub bootstrap: Option<String>,

    /// The routing sidecar's arguments, as one string ("--port=8000 --kv-connector=mooncake").
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pub sidecar_args: Option<String>,

    /// The engine's --kv-transfer-config JSON, to match against --sidecar-args.
    #[arg(long, value_name = "JSON")]
    pub kv_transfer_config: Option<String>,

    /// The engine's `vllm serve` arguments as one string (as `ps -o args=` shows them, or the
    /// pod spec's args joined): doctor reads --disable-log-stats and --kv-transfer-config there
    /// for the vllm_stats row (vLLM #43828).
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pub vllm_args: Option<String>,

    /// The engine's vLLM version (`vllm --version`, or GET /version on the engine), for the
    /// vllm_stats row: which releases have the fix.
    #[arg(long, value_name = "X.Y.Z")]
    pub vllm_version: Option<String>,

    /// A segment whose owner has not pinged the master for longer is reported dead.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub stale_ping_ms: u64,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// A short run (less data per row, fewer repetitions) for smoke tests.
    #[arg(long)]
    pub quick: bool,

    /// Segment size of the benchmark's store.
    #[arg(long, default_value = "1GB")]
    pub segment_size: String,

    /// MiB moved per row and pass (default 256, or 32 with --quick).
    #[arg(long, value_name = "MIB")]
    pub mib_per_row: Option<u64>,

    /// Paired trials per ratio target (limit, row, limit, row, ...): the verdict uses the
    /// median of the per-pair ratios, so a burst of neighbour load skews one pair, not the run.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub pairs: usize,

    /// Directory holding lunakv-master and lunakv-store (default: next to this executable).
    #[arg(long, env = "LUNAKV_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,

    /// Only the SSD tier section: offload write GB/s vs raw sequential write to the same
    /// directory, and get-from-disk latency for 1 MiB and 4 MiB objects.
    #[arg(long)]
    pub offload: bool,

    /// Only the KV events section: put ops/s of small objects with events on and a subscriber
    /// attached against events off, two stacks in one run (docs/EVENTS.md). Target >= 0.95x.
    #[arg(long)]
    pub events: bool,

    /// Only the capabilities section: single gets (tcp 64 KiB and 4 MiB, shm 64 KiB) from a
    /// segment that requires capabilities against one that does not, paired passes in one run
    /// (docs/SECURITY.md). Target >= 0.95x.
    #[arg(long)]
    pub caps: bool,

    /// Only the drain section: a store loaded with objects (a tenth on its SSD tier) drained
    /// onto two others while a reader gets every key; objects and MiB moved per second, and the
    /// gets served meanwhile (failed, wrong, p50/p99). Exit 1 when a get failed or the drain
    /// did not succeed.
    #[arg(long)]
    pub drain: bool,

    /// --drain: moves in flight (the job's max_concurrency; `lunakv drain` asks 16).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub drain_concurrency: u32,

    /// Directory for the --offload section (default: a temp dir; point it at the NVMe volume,
    /// e.g. /data/mooncake-offload, to measure that device).
    #[arg(long, value_name = "DIR")]
    pub offload_dir: Option<PathBuf>,

    /// Only the trace replay: hits on real traffic from a Mooncake-format trace (one JSON
    /// object per line with input_length and hash_ids), against a stack of its own, beside the
    /// offline maximum, LRU and Belady for the same capacity (docs/BENCH.md).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,

    /// Only the device section: vLLM's batch (objects x layers x K/V blocks) from and into
    /// fake device memory (the test double), embedded, shm and tcp; per batch the call's time,
    /// the time inside the device copies, and the difference (overhead). docs/GPU.md.
    #[arg(long)]
    pub device: bool,

    /// --device: layers of the KV cache (make test-gpu's default).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub device_layers: usize,

    /// --device: objects (blocks) per batch.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub device_objects: usize,

    /// --device: bytes of one block of one layer's K or V.
    #[arg(long, value_name = "BYTES", default_value_t = 32768)]
    pub device_block_bytes: usize,

    /// --device: timed batches per mode and direction (default 20, or 5 with --quick).
    #[arg(long, value_name = "N")]
    pub device_batches: Option<usize>,

    /// --device: also run this other lunakv executable's `bench --device` (the build before),
    /// alternately with this one, --pairs times, and print the overheads side by side.
    #[arg(long, value_name = "LUNAKV")]
    pub against: Option<PathBuf>,

    /// --trace: bytes that stand for one 512-token block.
    #[arg(long, value_name = "BYTES", default_value_t = 16384)]
    pub block_bytes: u64,

    /// --trace: the pool's DRAM in tokens (512 per block).
    #[arg(long, value_name = "TOKENS", default_value_t = 3_000_000)]
    pub capacity_tokens: u64,

    /// --trace: the store's SSD tier in tokens (0: no SSD tier); the master and the store run
    /// with --enable_offload and the tier's limit is these tokens' bytes.
    #[arg(long, value_name = "TOKENS", default_value_t = 0)]
    pub ssd_tokens: u64,

    /// --trace: replay only the first N requests (0: all).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub first: usize,

    /// --trace: 0 replays as fast as the client goes; X > 0 follows the trace's timestamps
    /// compressed X times.
    #[arg(long, value_name = "X", default_value_t = 0.0)]
    pub time_scale: f64,

    /// --trace: a flag for the replay's lunakv-master (repeatable), e.g.
    /// --master-arg=--eviction_policy=lru --master-arg=--default_kv_lease_ttl=1
    #[arg(long = "master-arg", value_name = "FLAG", allow_hyphen_values = true)]
    pub master_args: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("lunakv").chain(args.iter().copied())).expect("parses")
    }

    #[test]
    fn global_flags_go_before_or_after_the_command() {
        let a = parse(&["--master", "10.0.0.1:1", "--json", "status"]);
        assert_eq!(a.master.as_deref(), Some("10.0.0.1:1"));
        assert!(a.json);
        let b = parse(&["status", "--json", "--config", "/tmp/m.json"]);
        assert!(b.json);
        assert_eq!(b.config, Some(PathBuf::from("/tmp/m.json")));
        assert!(matches!(b.command, Command::Status));
    }

    #[test]
    fn kv_commands() {
        match parse(&["put", "k1", "-"]).command {
            Command::Put { key, file } => assert_eq!((key.as_str(), file.as_str()), ("k1", "-")),
            c => panic!("{c:?}"),
        }
        match parse(&["get", "k1"]).command {
            Command::Get { key, file } => {
                assert_eq!(key, "k1");
                assert_eq!(file, None);
            }
            c => panic!("{c:?}"),
        }
        match parse(&["get", "k1", "out.bin"]).command {
            Command::Get { file, .. } => assert_eq!(file.as_deref(), Some("out.bin")),
            c => panic!("{c:?}"),
        }
        match parse(&["rm", "k1", "--force"]).command {
            Command::Rm { key, force } => assert!(key == "k1" && force),
            c => panic!("{c:?}"),
        }
        assert!(matches!(
            parse(&["exists", "k"]).command,
            Command::Exists { .. }
        ));
        // put needs a source: refusing beats silently reading stdin.
        assert!(Cli::try_parse_from(["lunakv", "put", "k"]).is_err());
        assert!(Cli::try_parse_from(["lunakv"]).is_err());
    }

    #[test]
    fn up_defaults_and_mooncake_spellings() {
        let Command::Up(u) = parse(&["up"]).command else {
            panic!("up")
        };
        assert_eq!(
            (
                u.rpc_port,
                u.metrics_port,
                u.store_port,
                u.store_metrics_port
            ),
            (50051, 9003, 50052, 9004)
        );
        assert_eq!(u.segment_size, "1GB");
        assert_eq!(u.run_dir, PathBuf::from(".lunakv-run"));
        let Command::Up(u) = parse(&["up", "--rpc_port=0", "--global_segment_size", "2GB"]).command
        else {
            panic!("up")
        };
        assert_eq!(u.rpc_port, 0);
        assert_eq!(u.segment_size, "2GB");
    }

    #[test]
    fn bench_flags() {
        let a = parse(&["bench", "--json", "--quick"]);
        assert!(a.json);
        let Command::Bench(b) = a.command else {
            panic!("bench")
        };
        assert!(b.quick);
        assert_eq!(b.mib_per_row, None);
        assert_eq!(b.pairs, 5);
    }

    #[test]
    fn doctor_flags() {
        let a = parse(&[
            "doctor",
            "--store",
            "127.0.0.1:1",
            "--store=127.0.0.1:2",
            "--bootstrap",
            "127.0.0.1:8998",
            "--sidecar-args",
            "--port=8000 --kv-connector=mooncake",
            "--kv-transfer-config",
            "{}",
            "--vllm-args",
            "--disable-log-stats --port=8000",
            "--vllm-version=0.32.0",
            "--config",
            "/tmp/m.json",
        ]);
        assert_eq!(a.config, Some(PathBuf::from("/tmp/m.json")));
        let Command::Doctor(d) = a.command else {
            panic!("doctor")
        };
        assert_eq!(d.store, vec!["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(
            d.sidecar_args.as_deref(),
            Some("--port=8000 --kv-connector=mooncake")
        );
        assert_eq!(
            d.vllm_args.as_deref(),
            Some("--disable-log-stats --port=8000")
        );
        assert_eq!(d.vllm_version.as_deref(), Some("0.32.0"));
        assert_eq!(d.stale_ping_ms, 5000);
    }

    #[test]
    fn hidden_sink_takes_a_port() {
        assert!(matches!(
            parse(&["__tcp-sink", "0"]).command,
            Command::TcpSink { port: 0 }
        ));
        assert!(matches!(
            parse(&["__tcp-sink"]).command,
            Command::TcpSink { port: 0 }
        ));
    }
}

#[derive(Debug, Clone, Args)]
pub struct EventsArgs {
    /// The PUB endpoint to subscribe to (default: the master's, from its status).
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub endpoint: Option<String>,
    /// Topic prefix to subscribe to (default: every topic).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// The endpoint carries the vLLM-format stream (with --endpoint; default: the master's
    /// vLLM stream when it binds one).
    #[arg(long)]
    pub vllm: bool,
    /// Stop after this many events (0 = run until Ctrl-C).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}
