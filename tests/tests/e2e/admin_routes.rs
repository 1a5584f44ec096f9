//! Upstream Mooncake master's admin routes on lunakv-master's admin port (issue 32 item 5;
//! docs/SECURITY.md, "Upstream's admin routes"): `/kv_events/status`, `/get_all_keys`,
//! `/get_segments_detail`, `/query_segment`, `/batch_query_keys`, `/api/v1/segments/status` and
//! `POST /api/v1/remove_all`, each with upstream's shape, bad input refused with 400 naming the
//! parameter, and the guarded ones refused to a caller without the token. Real binaries on
//! loopback.

use std::time::Duration;

use lunakv_tests::pd::{Resp, request};
use lunakv_tests::{Master, Store, child_env, requester, wait_until};

const POOL: &str = "pool-0123456789abcdef0123456789";
const ADMIN: &str = "admin-0123456789abcdef012345678";

fn get(m: &Master, path: &str) -> Resp {
    request(m.admin, "GET", path, &[], b"")
}

fn post(m: &Master, path: &str, headers: &[(&str, &str)]) -> Resp {
    request(m.admin, "POST", path, headers, b"")
}

fn json(r: &Resp) -> serde_json::Value {
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&r.body)))
}

#[test]
fn upstream_admin_routes_answer_as_upstream_does() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let store = Store::start(&master.addr(), "64MB", &[]);
    let seg = store.segment_name();
    let client = requester(&master.addr());
    for k in ["alpha", "beta"] {
        client.put(k, &vec![7u8; 8192]).expect("put");
    }

    // /kv_events/status: upstream's five fields; this master publishes nothing.
    let r = get(&master, "/kv_events/status");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["enabled"], false, "{v}");
    for f in [
        "published_batches",
        "published_events",
        "dropped_events",
        "skipped_unparsed_keys",
    ] {
        assert_eq!(v[f], 0, "{f}: {v}");
    }

    // /get_all_keys: one key a line.
    let r = get(&master, "/get_all_keys");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let mut keys: Vec<String> = r.text().lines().map(str::to_string).collect();
    keys.sort();
    assert_eq!(keys, ["alpha", "beta"]);

    // /get_segments_detail.
    let r = get(&master, "/get_segments_detail");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["total_segments"], 1, "{v}");
    let s = &v["segments"][0];
    assert_eq!(s["segment_name"], seg.as_str(), "{v}");
    assert_eq!(s["size_bytes"], 64u64 << 20, "{v}");
    assert_eq!(s["size_human"], "0.0625 GiB", "{v}");
    assert_eq!(s["status"], "OK", "{v}");
    assert!(
        s["allocator_used_bytes"].as_u64().unwrap() >= 2 * 8192,
        "{v}"
    );
    assert!(s["allocator_usage_percent"].as_f64().unwrap() > 0.0, "{v}");
    assert!(!s["te_endpoint"].as_str().unwrap().is_empty(), "{v}");

    // /query_segment: upstream's text; a missing parameter is named, an unknown segment 404.
    let r = get(&master, &format!("/query_segment?segment={seg}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], seg, "{text}");
    assert!(lines[1].starts_with("Used(bytes): "), "{text}");
    assert_eq!(
        lines[2],
        format!("Capacity(bytes) : {}", 64u64 << 20),
        "{text}"
    );
    let r = get(&master, "/query_segment");
    assert_eq!(r.status, 400);
    assert!(r.text().contains("segment"), "{}", r.text());
    assert_eq!(get(&master, "/query_segment?segment=nope").status, 404);

    // /api/v1/segments/status.
    let r = get(&master, &format!("/api/v1/segments/status?segment={seg}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(
        (v["success"].clone(), v["status"].clone()),
        (true.into(), 1.into())
    );
    assert_eq!(v["status_name"], "OK", "{v}");
    let r = get(&master, "/api/v1/segments/status");
    assert_eq!(r.status, 400);
    let v = json(&r);
    assert_eq!(v["error_code"], -600, "{v}");
    assert!(
        v["error_message"].as_str().unwrap().contains("segment"),
        "{v}"
    );
    let r = get(&master, "/api/v1/segments/status?segment=nope");
    assert_eq!(r.status, 404);
    assert_eq!(json(&r)["error_code"], -101);

    // /batch_query_keys: per key, found or not; no keys and too many keys are 400.
    let r = get(&master, "/batch_query_keys?keys=alpha,missing");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(v["success"], true, "{v}");
    let a = &v["data"]["alpha"];
    assert_eq!(a["ok"], true, "{v}");
    assert_eq!(a["values"][0]["size_"], 8192, "{v}");
    assert_eq!(a["values"][0]["protocol_"], "tcp", "{v}");
    assert_eq!(v["data"]["missing"]["ok"], false, "{v}");
    assert_eq!(v["data"]["missing"]["error"], "OBJECT_NOT_FOUND", "{v}");
    let r = get(&master, "/batch_query_keys");
    assert_eq!(r.status, 400);
    assert!(json(&r)["error"].as_str().unwrap().contains("?keys="));
    let many = vec!["k"; 1001].join(",");
    let r = get(&master, &format!("/batch_query_keys?keys={many}"));
    assert_eq!(r.status, 400);
    let e = json(&r)["error"].as_str().unwrap().to_string();
    assert!(e.contains("keys") && e.contains("1000"), "{e}");

    // /api/v1/remove_all: POST only; bad force and tenant_id named; then everything goes.
    assert_eq!(get(&master, "/api/v1/remove_all").status, 405);
    let r = post(&master, "/api/v1/remove_all?force=maybe", &[]);
    assert_eq!(r.status, 400);
    assert!(
        json(&r)["error_message"]
            .as_str()
            .unwrap()
            .contains("force")
    );
    let r = post(&master, "/api/v1/remove_all?tenant_id=", &[]);
    assert_eq!(r.status, 400);
    assert!(
        json(&r)["error_message"]
            .as_str()
            .unwrap()
            .contains("tenant_id")
    );
    assert_eq!(get(&master, "/get_all_keys").text().lines().count(), 2);
    let r = post(&master, "/api/v1/remove_all?force=true", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = json(&r);
    assert_eq!(
        (v["success"].clone(), v["removed_count"].clone()),
        (true.into(), 2.into())
    );
    assert_eq!(get(&master, "/get_all_keys").text(), "");
    assert!(client.get("alpha").is_err(), "alpha survived remove_all");
}

#[test]
fn kv_events_status_counts_what_the_publisher_sent() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(
        dir.path(),
        &[
            "--enable_kv_event_publish=true",
            "--kv_event_publisher_endpoint=tcp://127.0.0.1:*",
        ],
    );
    let _store = Store::start(&master.addr(), "64MB", &[]);
    let client = requester(&master.addr());
    client.put("ev-a", b"kv").expect("put");
    client.put("ev-b", b"kv").expect("put");
    let v = wait_until(Duration::from_secs(20), || {
        let v = json(&get(&master, "/kv_events/status"));
        (v["published_events"].as_u64() >= Some(2)).then_some(v)
    })
    .expect("two events published");
    assert_eq!(v["enabled"], true, "{v}");
    assert!(v["published_batches"].as_u64().unwrap() >= 1, "{v}");
}

#[test]
fn guarded_upstream_routes_refuse_a_caller_without_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let master = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL), ("LUNAKV_ADMIN_TOKEN", ADMIN)]);
        Master::start(dir.path(), &[])
    };
    let admin = format!("Bearer {ADMIN}");
    for path in [
        "/get_all_keys",
        "/get_segments_detail",
        "/query_segment?segment=s",
        "/batch_query_keys?keys=a",
        "/api/v1/segments/status?segment=s",
    ] {
        let r = get(&master, path);
        assert_eq!(r.status, 401, "{path} without a token: {}", r.text());
        let r = request(master.admin, "GET", path, &[("Authorization", &admin)], b"");
        assert_ne!(r.status, 401, "{path} with the admin token: {}", r.text());
    }
    // Open as /kv_events is: counters only.
    assert_eq!(get(&master, "/kv_events/status").status, 200);
    // remove_all: the admin token only, as the RemoveAll RPC; the pool token is refused.
    let r = post(&master, "/api/v1/remove_all?force=true", &[]);
    assert_eq!(r.status, 401, "{}", r.text());
    let pool = format!("Bearer {POOL}");
    let r = post(
        &master,
        "/api/v1/remove_all?force=true",
        &[("Authorization", &pool)],
    );
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(r.text().contains("LUNAKV_ADMIN_TOKEN"), "{}", r.text());
    let r = post(
        &master,
        "/api/v1/remove_all?force=true",
        &[("Authorization", &admin)],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(json(&r)["removed_count"], 0);
    // Drain jobs: the same guard as remove_all (the pool token is refused).
    let job = "123e4567-e89b-42d3-a456-426614174000";
    for (method, path) in [
        ("POST", "/api/v1/drain_jobs".to_string()),
        ("GET", format!("/api/v1/drain_jobs/query?job_id={job}")),
        ("POST", format!("/api/v1/drain_jobs/cancel?job_id={job}")),
    ] {
        let body = br#"{"segments": ["s"]}"#;
        let r = request(master.admin, method, &path, &[], body);
        assert_eq!(r.status, 401, "{path} without a token: {}", r.text());
        let r = request(
            master.admin,
            method,
            &path,
            &[("Authorization", &pool)],
            body,
        );
        assert_eq!(r.status, 401, "{path} with the pool token: {}", r.text());
        let r = request(
            master.admin,
            method,
            &path,
            &[("Authorization", &admin)],
            body,
        );
        assert_eq!(r.status, 404, "{path} with the admin token: {}", r.text());
    }
}

#[test]
fn lunakv_keys_lists_the_pools_keys_by_prefix_and_bounds_what_it_prints() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let _store = Store::start(&master.addr(), "64MB", &[]);
    let client = requester(&master.addr());
    for k in ["layer-a-1", "layer-a-2", "layer-a-3", "other"] {
        client.put(k, k.as_bytes()).expect("put");
    }
    let admin = master.admin.to_string();
    let out = lunakv_tests::cli(
        &master.addr(),
        &["keys", "--prefix", "layer-a-", "--admin", &admin],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let mut listed: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    listed.sort();
    assert_eq!(listed, ["layer-a-1", "layer-a-2", "layer-a-3"]);

    // --limit bounds the keys printed, never the count.
    let out = lunakv_tests::cli(
        &master.addr(),
        &["--json", "keys", "--limit", "1", "--admin", &admin],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(v["count"], 4, "{v}");
    assert_eq!(v["keys"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["truncated"], true, "{v}");
}
