//! `lunakv bench --device` (issue 34): vLLM's batch shape through the device test double against
//! the real master and store, embedded, shm and tcp. The benchmark checks every byte of its
//! warm-up batch and must report a call, copy and overhead figure for each mode and direction,
//! and the split of the 2D copies the double refuses. Sizes are tiny: the figures are the
//! benchmark's job (`make bench-device`), the test asserts none of them.

use std::process::Command;

use lunakv_tests::{bin, bin_dir};

#[test]
fn device_bench_reports_every_mode_and_direction() {
    let out = Command::new(bin("lunakv"))
        .args([
            "--json",
            "bench",
            "--device",
            "--device-objects",
            "8",
            "--device-layers",
            "2",
            "--device-block-bytes",
            "4096",
            "--device-batches",
            "2",
        ])
        .env("LUNAKV_BIN_DIR", bin_dir())
        .env_remove("LUNAKV_DEVICE")
        .output()
        .expect("run lunakv bench --device");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&stdout).expect("the report alone, as JSON");
    assert_eq!(r["batch_bytes"].as_u64(), Some(8 * 2 * 2 * 4096), "{r}");
    let rows = r["rows"].as_array().expect("rows");
    let mut seen: Vec<(String, String)> = rows
        .iter()
        .map(|row| {
            for k in [
                "call_ms_p50",
                "copy_ms_p50",
                "overhead_ms_p50",
                "overhead_ms_p99",
            ] {
                assert!(row[k].as_f64().is_some_and(|v| v >= 0.0), "{k} in {row}");
            }
            (
                row["mode"].as_str().unwrap_or_default().to_owned(),
                row["op"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    seen.sort();
    let mut want: Vec<(String, String)> = ["embedded", "shm", "tcp"]
        .iter()
        .flat_map(|m| ["get", "put"].map(|o| ((*m).to_owned(), o.to_owned())))
        .collect();
    want.sort();
    assert_eq!(seen, want);
    assert!(r["refused_2d"].as_u64().is_some() && r["split_runs"].as_u64().is_some());
}

/// A bad size is refused by name before anything starts.
#[test]
fn device_bench_refuses_a_zero_size_by_name() {
    let out = Command::new(bin("lunakv"))
        .args(["bench", "--device", "--device-objects", "0"])
        .env("LUNAKV_BIN_DIR", bin_dir())
        .output()
        .expect("run lunakv bench --device");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device-objects"), "{err}");
}
