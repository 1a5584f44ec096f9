//! Drain jobs (issue 32 item 6; docs/ARCHITECTURE.md, "Drain jobs"): upstream's
//! `POST /api/v1/drain_jobs`, `GET /api/v1/drain_jobs/query`, `POST /api/v1/drain_jobs/cancel`
//! against real binaries on loopback. A loaded store (objects in DRAM and on its SSD tier) is
//! drained onto two others while a reader gets every key over and over: no get fails, every
//! object lands elsewhere with its bytes, the source ends empty and DRAINED, and the report
//! counts it all. Cancel restores the segment; bad requests get upstream's 400/404/409 shapes;
//! an object that fits nowhere is reported blocked and stays readable on its source.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lunakv_tests::pd::{Resp, request};
use lunakv_tests::{Master, Store, cli, pattern, requester, wait_until};

fn json(r: &Resp) -> serde_json::Value {
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&r.body)))
}

fn create(m: &Master, body: &str) -> Resp {
    request(
        m.admin,
        "POST",
        "/api/v1/drain_jobs",
        &[("content-type", "application/json")],
        body.as_bytes(),
    )
}

fn query(m: &Master, id: &str) -> serde_json::Value {
    let r = request(
        m.admin,
        "GET",
        &format!("/api/v1/drain_jobs/query?job_id={id}"),
        &[],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    json(&r)
}

/// Polls the job until it ended; its final report.
fn wait_finished(m: &Master, id: &str) -> serde_json::Value {
    wait_until(Duration::from_secs(120), || {
        let v = query(m, id);
        matches!(
            v["status_name"].as_str(),
            Some("SUCCEEDED" | "FAILED" | "CANCELED")
        )
        .then_some(v)
    })
    .unwrap_or_else(|| panic!("drain job {id} did not end: {}", query(m, id)))
}

fn segment_status(m: &Master, seg: &str) -> String {
    let r = request(
        m.admin,
        "GET",
        &format!("/api/v1/segments/status?segment={seg}"),
        &[],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    json(&r)["status_name"].as_str().unwrap().to_string()
}

/// The segments that hold a replica of `key` (DRAM or disk), from `/batch_query_keys`.
fn holders(m: &Master, key: &str) -> Vec<String> {
    let r = request(
        m.admin,
        "GET",
        &format!("/batch_query_keys?keys={key}"),
        &[],
        b"",
    );
    let v = json(&r);
    let d = &v["data"][key];
    assert_eq!(d["ok"], true, "{key}: {v}");
    let mut out: Vec<String> = d["values"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| x["transport_endpoint_"].as_str().unwrap().to_string())
        .collect();
    out.extend(
        d["local_disk_values"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|x| x["transport_endpoint"].as_str().unwrap().to_string()),
    );
    out
}

fn used_bytes(m: &Master, seg: &str) -> u64 {
    let r = request(
        m.admin,
        "GET",
        &format!("/query_segment?segment={seg}"),
        &[],
        b"",
    );
    let text = r.text();
    text.lines()
        .find_map(|l| l.strip_prefix("Used(bytes): "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{text}"))
}

const OBJ: usize = 64 << 10;

#[test]
fn a_drain_moves_every_object_and_every_get_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let disk = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &["--enable_offload=true"]);
    let disk_path = disk.path().display().to_string();
    let env = lunakv_tests::child_env(&[("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", &disk_path)]);
    // The source holds everything at first: it is the only store while the keys are put.
    let source = Store::start(&master.addr(), "64MB", &["--enable_offload=true"]);
    drop(env);
    let seg = source.segment_name();
    let client = requester(&master.addr());
    let n = 200u64;
    let keys: Vec<String> = (0..n).map(|i| format!("drain-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        client.put(k, &pattern(i as u64, OBJ)).expect("put");
    }
    // Some objects live only on the source's SSD tier.
    let on_disk = 20;
    for k in &keys[..on_disk] {
        client.offload_key(k).expect("offload_key");
    }
    for k in &keys[..on_disk] {
        assert_eq!(
            holders(&master, k),
            std::slice::from_ref(&seg),
            "{k} on the source's disk"
        );
    }
    let b = Store::start(&master.addr(), "64MB", &[]);
    let c = Store::start(&master.addr(), "64MB", &[]);

    // A reader gets every key, over and over, until the drain ended.
    let stop = Arc::new(AtomicBool::new(false));
    let gets = Arc::new(AtomicU64::new(0));
    let reader = {
        let (stop, gets, keys, addr) = (stop.clone(), gets.clone(), keys.clone(), master.addr());
        std::thread::spawn(move || {
            let c = requester(&addr);
            let mut failures = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                for (i, k) in keys.iter().enumerate() {
                    match c.get(k) {
                        Ok(v) if v == pattern(i as u64, OBJ) => {}
                        Ok(_) => failures.push(format!("{k}: wrong bytes")),
                        Err(e) => failures.push(format!("{k}: {e}")),
                    }
                    gets.fetch_add(1, Ordering::Relaxed);
                }
            }
            failures
        })
    };
    wait_until(Duration::from_secs(10), || {
        (gets.load(Ordering::Relaxed) >= n).then_some(())
    })
    .expect("the reader runs");

    let r = create(
        &master,
        &format!(r#"{{"segments": ["{seg}"], "max_concurrency": 8}}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["success"], true, "{v}");
    assert_eq!(v["status"], "CREATED", "{v}");
    let id = v["job_id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let report = wait_finished(&master, &id);
    // One more full round of gets after the swap.
    let after = gets.load(Ordering::Relaxed);
    wait_until(Duration::from_secs(30), || {
        (gets.load(Ordering::Relaxed) >= after + n).then_some(())
    })
    .expect("the reader goes on");
    stop.store(true, Ordering::SeqCst);
    let failures = reader.join().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed gets of {}: {:?}",
        failures.len(),
        gets.load(Ordering::Relaxed),
        &failures[..failures.len().min(10)]
    );

    assert_eq!(report["status_name"], "SUCCEEDED", "{report}");
    assert_eq!(report["status"], 3, "{report}");
    assert_eq!(report["type_name"], "DRAIN", "{report}");
    assert_eq!(report["succeeded_units"], n, "{report}");
    assert_eq!(report["failed_units"], 0, "{report}");
    assert_eq!(report["blocked_units"], 0, "{report}");
    assert_eq!(report["active_units"], 0, "{report}");
    assert_eq!(report["migrated_bytes"], n * OBJ as u64, "{report}");
    assert_eq!(report["segments"][0], seg.as_str(), "{report}");

    // Every object is elsewhere, with its bytes; the source holds nothing and stays DRAINED.
    let others = [b.segment_name(), c.segment_name()];
    for (i, k) in keys.iter().enumerate() {
        let h = holders(&master, k);
        assert!(
            !h.is_empty() && h.iter().all(|s| others.contains(s)),
            "{k} on {h:?}"
        );
        assert_eq!(client.get(k).expect("get"), pattern(i as u64, OBJ), "{k}");
    }
    assert_eq!(used_bytes(&master, &seg), 0);
    assert_eq!(segment_status(&master, &seg), "DRAINED");
    // A drained segment takes no new puts.
    client.put("after-drain", &pattern(999, OBJ)).expect("put");
    assert!(!holders(&master, "after-drain").contains(&seg));
    assert_eq!(
        master.metric("master_drain_moved_objects_total"),
        Some(n as f64)
    );
}

#[test]
fn cancel_restores_the_segment_and_bad_requests_get_upstreams_answers() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let source = Store::start(&master.addr(), "32MB", &[]);
    let seg = source.segment_name();
    let client = requester(&master.addr());
    for i in 0..50u64 {
        client
            .put(&format!("c-{i}"), &pattern(i, OBJ))
            .expect("put");
    }
    let other = Store::start(&master.addr(), "32MB", &[]);

    // Invalid JSON, a missing or malformed job_id: 400 INVALID_PARAMS.
    for body in [
        "{",
        "{}",
        "not json",
        r#"{"segments": "x"}"#,
        r#"{"segment": ["x"]}"#,
    ] {
        let r = create(&master, body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let v = json(&r);
        assert_eq!(v["success"], false, "{v}");
        assert_eq!(v["error_code"], -600, "{v}");
    }
    for path in [
        "/api/v1/drain_jobs/query",
        "/api/v1/drain_jobs/query?job_id=not-a-uuid",
    ] {
        let r = request(master.admin, "GET", path, &[], b"");
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(
            json(&r)["error_message"]
                .as_str()
                .unwrap()
                .contains("job_id")
        );
    }
    let r = request(master.admin, "POST", "/api/v1/drain_jobs/cancel", &[], b"");
    assert_eq!(r.status, 400, "{}", r.text());
    // No segments, max_concurrency 0, a source that is also a target: 400.
    for body in [
        r#"{"segments": []}"#.to_string(),
        format!(r#"{{"segments": ["{seg}"], "max_concurrency": 0}}"#),
        format!(r#"{{"segments": ["{seg}"], "target_segments": ["{seg}"]}}"#),
    ] {
        let r = create(&master, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(json(&r)["error_code"], -600);
    }
    // Unknown segment or target: 404 SEGMENT_NOT_FOUND; unknown job: 404 JOB_NOT_FOUND.
    let r = create(&master, r#"{"segments": ["127.0.0.1:1"]}"#);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(json(&r)["error_code"], -101);
    let r = create(
        &master,
        &format!(r#"{{"segments": ["{seg}"], "target_segments": ["127.0.0.1:1"]}}"#),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let unknown = "123e4567-e89b-42d3-a456-426614174000";
    let r = request(
        master.admin,
        "GET",
        &format!("/api/v1/drain_jobs/query?job_id={unknown}"),
        &[],
        b"",
    );
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(json(&r)["error_code"], -1402);
    assert_eq!(
        segment_status(&master, &seg),
        "OK",
        "refusals change nothing"
    );

    // A drain slowed to a crawl (one object, then no tokens), then canceled.
    let r = create(
        &master,
        &format!(
            r#"{{"segments": ["{seg}"], "target_segments": ["{}"], "max_concurrency": 1, "max_bytes_per_sec": 1}}"#,
            other.segment_name()
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let id = json(&r)["job_id"].as_str().unwrap().to_string();
    assert_eq!(segment_status(&master, &seg), "DRAINING");
    // A draining segment can be drained by no second job: 409.
    let r = create(&master, &format!(r#"{{"segments": ["{seg}"]}}"#));
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(json(&r)["error_code"], -1010);
    // A draining segment takes no new puts.
    client.put("during", &pattern(7, OBJ)).expect("put");
    assert_eq!(holders(&master, "during"), [other.segment_name()]);

    let cancel = |id: &str| {
        request(
            master.admin,
            "POST",
            &format!("/api/v1/drain_jobs/cancel?job_id={id}"),
            &[],
            b"",
        )
    };
    let r = cancel(&id);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(
        (
            v["success"].clone(),
            v["status"].clone(),
            v["job_id"].clone()
        ),
        (true.into(), "CANCELED".into(), id.as_str().into())
    );
    assert_eq!(segment_status(&master, &seg), "OK");
    let report = query(&master, &id);
    assert_eq!(report["status_name"], "CANCELED", "{report}");
    assert_eq!(report["status"], 5, "{report}");
    // Canceling an ended job: 409.
    let r = cancel(&id);
    assert_eq!(r.status, 409, "{}", r.text());
    // Nothing was lost: every key reads back.
    for i in 0..50u64 {
        assert_eq!(client.get(&format!("c-{i}")).expect("get"), pattern(i, OBJ));
    }
}

#[test]
fn an_object_that_fits_nowhere_is_reported_blocked_and_stays_readable() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let source = Store::start(&master.addr(), "32MB", &[]);
    let seg = source.segment_name();
    let client = requester(&master.addr());
    let big = 6 << 20;
    client.put("big", &pattern(1, big)).expect("put big");
    for i in 0..10u64 {
        client
            .put(&format!("small-{i}"), &pattern(100 + i, OBJ))
            .expect("put");
    }
    // The only other segment is smaller than the big object.
    let small = Store::start(&master.addr(), "4MB", &[]);

    let r = create(&master, &format!(r#"{{"segments": ["{seg}"]}}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    let id = json(&r)["job_id"].as_str().unwrap().to_string();
    let report = wait_finished(&master, &id);
    assert_eq!(report["status_name"], "FAILED", "{report}");
    assert_eq!(report["succeeded_units"], 10, "{report}");
    assert_eq!(report["blocked_units"], 1, "{report}");
    assert_eq!(
        report["blocked_keys"],
        serde_json::json!(["big"]),
        "{report}"
    );
    assert!(
        report["message"].as_str().unwrap().contains("\"big\""),
        "{report}"
    );
    // It stays where it was, readable; the small ones moved; the segment is OK again.
    assert_eq!(holders(&master, "big"), std::slice::from_ref(&seg));
    assert_eq!(client.get("big").expect("get big"), pattern(1, big));
    for i in 0..10u64 {
        let k = format!("small-{i}");
        assert_eq!(holders(&master, &k), [small.segment_name()], "{k}");
        assert_eq!(client.get(&k).expect("get"), pattern(100 + i, OBJ));
    }
    assert_eq!(segment_status(&master, &seg), "OK");

    // `lunakv drain --wait` says the same and exits 1: an object was left behind.
    let admin = master.admin.to_string();
    let out = cli(
        &master.addr(),
        &["drain", &seg, "--wait", "--admin", &admin],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("FAILED") && stdout.contains("  big"),
        "{stdout}"
    );
    assert_eq!(client.get("big").expect("get big"), pattern(1, big));
}

#[test]
fn lunakv_drain_waits_for_the_job_and_prints_its_report() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let source = Store::start(&master.addr(), "32MB", &[]);
    let seg = source.segment_name();
    let client = requester(&master.addr());
    for i in 0..30u64 {
        client
            .put(&format!("cli-{i}"), &pattern(i, OBJ))
            .expect("put");
    }
    let target = Store::start(&master.addr(), "32MB", &[]);
    let admin = master.admin.to_string();
    let tseg = target.segment_name();
    let out = cli(
        &master.addr(),
        &[
            "--json", "drain", &seg, "--wait", "--admin", &admin, "--target", &tseg,
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["status_name"], "SUCCEEDED", "{v}");
    assert_eq!(v["succeeded_units"], 30, "{v}");
    for i in 0..30u64 {
        let k = format!("cli-{i}");
        assert_eq!(holders(&master, &k), std::slice::from_ref(&tseg), "{k}");
    }
    // A second drain of a DRAINED segment is refused: exit 2 with the master's reason.
    let out = cli(&master.addr(), &["drain", &seg, "--admin", &admin], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("DRAINED"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An engine in embedded mode owns its segment as a store does: its drain moves the objects
/// to a store while the engine itself keeps reading them.
#[test]
fn an_embedded_engines_segment_drains_too() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let engine = lunakv_tests::embedded(&master.addr(), 16 << 20);
    for i in 0..40u64 {
        engine
            .put(&format!("e-{i}"), &pattern(i, OBJ))
            .expect("put");
    }
    let seg = holders(&master, "e-0").pop().expect("a holder");
    let store = Store::start(&master.addr(), "32MB", &[]);
    let r = create(&master, &format!(r#"{{"segments": ["{seg}"]}}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    let id = json(&r)["job_id"].as_str().unwrap().to_string();
    let report = wait_finished(&master, &id);
    assert_eq!(report["status_name"], "SUCCEEDED", "{report}");
    assert_eq!(report["succeeded_units"], 40, "{report}");
    for i in 0..40u64 {
        let k = format!("e-{i}");
        assert_eq!(holders(&master, &k), [store.segment_name()], "{k}");
        assert_eq!(engine.get(&k).expect("get"), pattern(i, OBJ), "{k}");
    }
}

/// A target that stops answering (SIGSTOP) holds the source owner's writes until their I/O
/// timeout, longer than the master's client_ttl: the owner's Pings must go on meanwhile, or the
/// master would declare the source dead and drop the very objects being drained. The target
/// expires instead, the job ends FAILED with every object still on its source and readable.
#[test]
fn a_hung_target_does_not_stall_the_sources_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &["--client_ttl=2"]);
    let source = Store::start(&master.addr(), "32MB", &[]);
    let seg = source.segment_name();
    let client = requester(&master.addr());
    for i in 0..40u64 {
        client
            .put(&format!("h-{i}"), &pattern(i, OBJ))
            .expect("put");
    }
    let mut target = Store::start(&master.addr(), "32MB", &[]);
    let tseg = target.segment_name();
    target.proc.pause();
    let r = create(
        &master,
        &format!(
            r#"{{"segments": ["{seg}"], "target_segments": ["{tseg}"], "max_concurrency": 8}}"#
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let id = json(&r)["job_id"].as_str().unwrap().to_string();
    let report = wait_finished(&master, &id);
    target.proc.signal(libc::SIGCONT);
    assert_eq!(report["status_name"], "FAILED", "{report}");
    assert_eq!(report["blocked_units"], 40, "{report}");
    assert_eq!(
        segment_status(&master, &seg),
        "OK",
        "the source is still mounted"
    );
    for i in 0..40u64 {
        let k = format!("h-{i}");
        assert_eq!(holders(&master, &k), std::slice::from_ref(&seg), "{k}");
        assert_eq!(client.get(&k).expect("get"), pattern(i, OBJ), "{k}");
    }
    target.proc.kill9();
}
