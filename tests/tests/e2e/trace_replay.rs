//! `lunakv bench --trace` (issue 31): a slice of Mooncake's conversation trace replayed against
//! the real master and store, as an operator runs it. The replay must check every byte it reads,
//! count no lookup answered "present" whose read then failed, and land between nothing and the
//! offline maximum computed in the same run. The full trace is the benchmark's job
//! (`make bench-trace`); this slice keeps the test short.

use std::path::PathBuf;
use std::process::Command;

use lunakv_tests::{bin, bin_dir};

/// The first `n` requests of the shipped trace (shared/ beside the checkout), or, where it is
/// absent, a generated trace of the same shape: shared prefixes of different popularity.
fn slice(dir: &std::path::Path, n: usize) -> PathBuf {
    let shipped = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/mooncake-traces/conversation_trace.jsonl");
    let lines: Vec<String> = match std::fs::read_to_string(&shipped) {
        Ok(t) => t.lines().take(n).map(str::to_owned).collect(),
        Err(_) => (0..n as u64)
            .map(|i| {
                let prefix = i % 7;
                let ids: Vec<String> = std::iter::once(prefix)
                    .chain((0..(i % 5 + 2)).map(|j| 100 + prefix * 1000 + (i % 3) * 10 + j))
                    .chain((0..3).map(|j| 1_000_000 + i * 10 + j))
                    .map(|x| x.to_string())
                    .collect();
                format!(
                    "{{\"timestamp\": {i}, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}",
                    ids.len() * 512,
                    ids.join(", ")
                )
            })
            .collect(),
    };
    let path = dir.join("slice.jsonl");
    std::fs::write(&path, lines.join("\n")).expect("write slice");
    path
}

#[test]
fn a_replay_checks_every_byte_and_lands_between_nothing_and_the_maximum() {
    let r = replay(&["--capacity-tokens", "1000000", "--block-bytes", "4096"]);
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!(f("requests"), 300.0);
    assert_eq!(f("wrong_bytes"), 0.0, "{r}");
    assert_eq!(f("false_present"), 0.0, "{r}");
    assert!(f("blocks_read") > 0.0, "the slice reuses prefixes: {r}");
    assert!(
        f("hit_rate") > 0.0 && f("hit_rate") <= f("max_hit_rate") + 1e-9,
        "{r}"
    );
    assert!(f("belady_hit_rate") >= f("lru_hit_rate") - 1e-9, "{r}");
    assert!(r["errors"].as_object().is_some_and(|e| e.is_empty()), "{r}");
}

/// `lunakv bench --trace` with `extra` args over the 300-request slice: its JSON report.
fn replay(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = slice(dir.path(), 300);
    let out = Command::new(bin("lunakv"))
        .args(["--json", "bench", "--trace"])
        .arg(&trace)
        .args(extra)
        .env("LUNAKV_BIN_DIR", bin_dir())
        .output()
        .expect("run lunakv bench --trace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("one JSON line");
    serde_json::from_str(json).expect("json")
}

/// DRAM for 512 blocks and an SSD tier for 1,024, against about 8,000 blocks put: blocks go to
/// disk, and the disk tier drops its oldest buckets to make room (a put batch may reserve the
/// whole pool: the slice's longest chains are long for so small a pool). Every lookup answered "present" must read back (the store
/// names what it dropped in the OFFLOAD answer, issue 31 item 5), and no put or read fails.
#[test]
fn a_replay_through_a_full_ssd_tier_never_answers_present_for_a_dropped_block() {
    let r = replay(&[
        "--capacity-tokens",
        "262144",
        "--ssd-tokens",
        "524288",
        "--block-bytes",
        "4096",
        "--master-arg=--put_reservation_limit_ratio=1",
        "--master-arg=--put_reservation_total_ratio=1",
    ]);
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!(f("ssd_tokens"), 524288.0);
    assert!(
        r["master"]["master_offloaded_keys_total"]
            .as_f64()
            .is_some_and(|n| n > 0.0),
        "blocks went to disk: {r}"
    );
    assert!(
        r["master"]["master_disk_dropped_keys_total"]
            .as_f64()
            .is_some_and(|n| n > 0.0),
        "the disk tier dropped blocks: {r}"
    );
    assert_eq!(f("wrong_bytes"), 0.0, "{r}");
    assert_eq!(f("false_present"), 0.0, "{r}");
    assert!(r["errors"].as_object().is_some_and(|e| e.is_empty()), "{r}");
    assert!(f("blocks_read") > 0.0, "{r}");
}

#[test]
fn a_bad_trace_line_is_refused_with_its_number() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"input_length\": 512, \"hash_ids\": [1]}\nnot json\n",
    )
    .unwrap();
    let out = Command::new(bin("lunakv"))
        .args(["bench", "--trace"])
        .arg(&path)
        .env("LUNAKV_BIN_DIR", bin_dir())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
}
