//! `lunakv drain SEGMENT`: moves a segment's objects to the other segments before its store
//! goes away (upstream's drain jobs, on the master's admin port; docs/ARCHITECTURE.md "Drain
//! jobs"). Creates the job, and with `--wait` polls it until it ends and prints the report.
//! `--cancel JOB_ID` cancels one instead. A store's Kubernetes preStop runs
//! `lunakv drain <its segment> --wait` (deploy/k8s).
//!
//! Exit status: 0 when the job was created (or, with `--wait`, SUCCEEDED); 1 when it ended
//! FAILED or CANCELED or left objects it could not place (they stay on the segment, listed);
//! 2 for errors (the master refused the request, or could not be reached).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use lunakv_proto::ErrorCode;

use crate::args::DrainArgs;
use crate::cmd::admin::{Admin, admin_base};
use crate::error::Coded;
use crate::output::{human_bytes, print_json};

pub fn run(a: &DrainArgs, master: &str, json: bool) -> anyhow::Result<ExitCode> {
    let admin = Admin::new(admin_base(a.admin.as_deref(), master)?)?;
    if let Some(id) = &a.cancel {
        let v = admin.call(
            "POST",
            &format!("/api/v1/drain_jobs/cancel?job_id={id}"),
            "",
        )?;
        if json {
            print_json(&v)?;
        } else {
            println!("drain job {id} canceled; its segments take placements again");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(segment) = &a.segment else {
        return Err(Coded::new(
            ErrorCode::InvalidParams,
            "name the segment to drain (its HOST:PORT, as `lunakv status` lists it), or give \
             --cancel JOB_ID",
        )
        .into());
    };
    let mut body = serde_json::json!({
        "segments": [segment],
        "target_segments": a.target,
        "max_concurrency": a.max_concurrency,
    });
    if let Some(r) = a.max_bytes_per_sec {
        body["max_bytes_per_sec"] = r.into();
    }
    let created = admin.call("POST", "/api/v1/drain_jobs", &body.to_string())?;
    let id = created["job_id"].as_str().unwrap_or_default().to_string();
    if !a.wait {
        if json {
            print_json(&created)?;
        } else {
            println!(
                "drain job {id} created for {segment}; follow it with `lunakv drain --wait` or \
                 GET /api/v1/drain_jobs/query?job_id={id}"
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let started = Instant::now();
    let deadline = a.timeout.map(|s| started + Duration::from_secs(s));
    let mut last_print = Instant::now();
    let report = loop {
        let v = admin.call("GET", &format!("/api/v1/drain_jobs/query?job_id={id}"), "")?;
        let status = v["status_name"].as_str().unwrap_or_default().to_string();
        if matches!(status.as_str(), "SUCCEEDED" | "FAILED" | "CANCELED") {
            break v;
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            return Err(Coded::new(
                ErrorCode::UnavailableInCurrentStatus,
                format!(
                    "drain job {id} still {status} after --timeout {}s ({} objects moved): it \
                     goes on; cancel it with `lunakv drain --cancel {id}`",
                    a.timeout.unwrap_or_default(),
                    v["succeeded_units"]
                ),
            )
            .into());
        }
        if !json && last_print.elapsed() >= Duration::from_secs(2) {
            eprintln!(
                "drain {id}: {status}, {} moved ({}), {} in flight",
                v["succeeded_units"],
                human_bytes(v["migrated_bytes"].as_u64().unwrap_or(0)),
                v["active_units"]
            );
            last_print = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let secs = started.elapsed().as_secs_f64();
    let status = report["status_name"].as_str().unwrap_or_default();
    let blocked = report["blocked_units"].as_u64().unwrap_or(0);
    let moved = report["succeeded_units"].as_u64().unwrap_or(0);
    let bytes = report["migrated_bytes"].as_u64().unwrap_or(0);
    if json {
        let mut out = report.clone();
        out["ok"] = (status == "SUCCEEDED" && blocked == 0).into();
        out["seconds"] = secs.into();
        print_json(&out)?;
    } else {
        println!(
            "drain job {id} {status} in {secs:.1}s: {moved} objects moved ({}), {} failed, \
             {blocked} blocked",
            human_bytes(bytes),
            report["failed_units"]
        );
        if let Some(keys) = report["blocked_keys"].as_array().filter(|k| !k.is_empty()) {
            println!("left on {segment} (no room elsewhere, still readable there):");
            for k in keys {
                println!("  {}", k.as_str().unwrap_or_default());
            }
        }
        println!("{}", report["message"].as_str().unwrap_or_default());
    }
    Ok(if status == "SUCCEEDED" && blocked == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
