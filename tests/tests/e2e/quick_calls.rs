//! Quick calls (lunakv_proto::quick, issue 19): BatchExistKey, BatchGetReplicaList,
//! BatchPutStart and BatchPutEnd as plain frames on the master's RPC port. The real master answers them as it answers gRPC, behind the
//! same token check, and refuses bad frames by name; the real CLI uses them and answers alike
//! with them off (`LUNAKV_QUICK_CALLS=0`), including a force remove seen at once.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lunakv_proto::ErrorCode;
use lunakv_proto::master as pb;
use lunakv_proto::quick::{self, Method};
use lunakv_tests::{Master, Store, child_env, cli, pattern};
use prost::Message;

const POOL: &str = "pool-quick-0123456789abcdef0123";

fn connect(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect to the master's RPC port");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(quick::MAGIC).unwrap();
    s.flush().unwrap();
    s
}

/// One request frame out, one response frame's body back.
fn roundtrip(s: &mut TcpStream, frame: &[u8]) -> Vec<u8> {
    s.write_all(frame).unwrap();
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).expect("a response frame");
    let mut body = vec![0u8; quick::frame_len(prefix).unwrap()];
    s.read_exact(&mut body).unwrap();
    body
}

fn exist_frame(auth: &str, keys: &[&str]) -> Vec<u8> {
    let req = pb::BatchExistKeyRequest {
        client_id: "00000000-0000-0000-0000-00000000beef".into(),
        keys: keys.iter().map(|k| k.to_string()).collect(),
    };
    quick::encode_request(Method::BatchExistKey, auth.as_bytes(), &req.encode_to_vec())
}

fn put(master: &str, dir: &std::path::Path, key: &str, env: &[(&str, &str)]) {
    let file = dir.join(key);
    std::fs::write(&file, pattern(3, 4096)).unwrap();
    let out = cli(master, &["put", key, &file.display().to_string()], env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn frames_are_answered_as_grpc_behind_the_same_token() {
    let dir = tempfile::tempdir().unwrap();
    let master = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
        Master::start(dir.path(), &[])
    };
    let addr = master.addr();
    let _store = {
        let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
        Store::start(&addr, "64MB", &[])
    };
    put(&addr, dir.path(), "present", &[("LUNAKV_AUTH_TOKEN", POOL)]);

    // The CLI's put went as quick frames too (BatchPutStart, BatchPutEnd).
    let base = master.metric("master_quick_calls_total").unwrap_or(0.0);
    assert!(base >= 2.0, "the put used quick frames: {base}");
    let mut s = connect(&addr);
    let bearer = format!("Bearer {POOL}");
    let answer = roundtrip(&mut s, &exist_frame(&bearer, &["present", "absent"]));
    let quick::Response::Ok(body) = quick::decode_response(&answer).unwrap() else {
        panic!(
            "an answer, not {}",
            quick::decode_response(&answer).unwrap()
        );
    };
    let r = pb::BatchObjectLocations::decode(body).unwrap();
    assert_eq!(r.results.len(), 2);
    assert_eq!(r.results[0].code, 0, "{:?}", r.results[0]);
    assert_eq!(r.results[0].size, 4096);
    assert!(
        !r.results[0].replicas.is_empty(),
        "the location comes along"
    );
    assert_eq!(r.results[1].code, ErrorCode::ObjectNotFound.as_i32());

    // The same connection: no token, a wrong token, an unknown method. Each is refused by name
    // and the connection stays usable.
    for (frame, code, words) in [
        (
            exist_frame("", &["present"]),
            tonic::Code::Unauthenticated,
            "LUNAKV_AUTH_TOKEN",
        ),
        (
            exist_frame("Bearer wrong", &["present"]),
            tonic::Code::Unauthenticated,
            "refused",
        ),
        (
            {
                let mut f = exist_frame(&bearer, &["present"]);
                f[4] = 9;
                f
            },
            tonic::Code::InvalidArgument,
            "method 9",
        ),
    ] {
        let answer = roundtrip(&mut s, &frame);
        match quick::decode_response(&answer).unwrap() {
            quick::Response::Status { code: c, message } => {
                assert_eq!(c, code as i32, "{message}");
                assert!(message.contains(words), "{message}");
            }
            other => panic!("refused, not {other}"),
        }
    }
    // Nothing about the object leaked to the refused callers, and the holder still reads.
    let answer = roundtrip(&mut s, &exist_frame(&bearer, &["present"]));
    assert!(matches!(
        quick::decode_response(&answer).unwrap(),
        quick::Response::Ok(_)
    ));
    assert_eq!(
        master.metric("master_quick_calls_total"),
        Some(base + 2.0),
        "only admitted calls count"
    );

    // A frame over the limit: refused by name, then the master closes the connection.
    s.write_all(&((quick::MAX_FRAME + 1) as u32).to_be_bytes())
        .unwrap();
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).unwrap();
    let mut body = vec![0u8; quick::frame_len(prefix).unwrap()];
    s.read_exact(&mut body).unwrap();
    match quick::decode_response(&body).unwrap() {
        quick::Response::Status { code, message } => {
            assert_eq!(code, tonic::Code::ResourceExhausted as i32);
            assert!(message.contains("limit"), "{message}");
        }
        other => panic!("refused, not {other}"),
    }
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "closed");

    // gRPC on the same port is untouched.
    let out = cli(
        &addr,
        &["exists", "present"],
        &[("LUNAKV_AUTH_TOKEN", POOL), ("LUNAKV_QUICK_CALLS", "0")],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "yes");
}

#[test]
fn the_cli_answers_alike_with_quick_calls_on_and_off() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let _store = Store::start(&addr, "64MB", &[]);
    put(&addr, dir.path(), "k", &[]);

    let exists = |quick_on: bool| {
        let env: &[(&str, &str)] = if quick_on {
            &[]
        } else {
            &[("LUNAKV_QUICK_CALLS", "0")]
        };
        let out = cli(&addr, &["exists", "k"], env);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let before = master.metric("master_quick_calls_total").unwrap_or(0.0);
    assert_eq!(exists(true), "yes");
    let after_on = master.metric("master_quick_calls_total").unwrap_or(0.0);
    assert!(
        after_on > before,
        "the default CLI asked with a quick frame"
    );
    assert_eq!(exists(false), "yes");
    assert_eq!(
        master.metric("master_quick_calls_total").unwrap_or(0.0),
        after_on,
        "LUNAKV_QUICK_CALLS=0 asks over gRPC only"
    );

    // Another client's force remove is seen by the very next exists, both ways (upstream's
    // contract: nothing answers exists from a cache).
    let rm = cli(&addr, &["rm", "k", "--force"], &[]);
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    assert_eq!(exists(true), "no");
    assert_eq!(exists(false), "no");
}

/// A peer that announces a large frame and trickles it is closed once the body's time is up,
/// and the master goes on answering others meanwhile (nothing is reserved for what it did not
/// send).
#[test]
fn a_trickled_frame_is_closed_and_others_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let mut slow = connect(&addr);
    slow.write_all(&(quick::MAX_FRAME as u32).to_be_bytes())
        .unwrap();
    slow.write_all(&[Method::BatchExistKey as u8, 0, 0])
        .unwrap();

    let mut other = connect(&addr);
    let answer = roundtrip(&mut other, &exist_frame("", &["nothing-here"]));
    assert!(matches!(
        quick::decode_response(&answer).unwrap(),
        quick::Response::Ok(_)
    ));

    slow.set_read_timeout(Some(Duration::from_secs(45)))
        .unwrap();
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    assert_eq!(
        slow.read_to_end(&mut rest).expect("closed, not timed out"),
        0
    );
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "closed after the body's 30 s"
    );
}

/// The master serves quick connections on its lanes: one thread per core named `quick-<i>`
/// (services/master/src/rpc/lanes.rs), each connection answered there, several at once.
#[test]
fn quick_connections_are_served_on_the_lanes() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let _store = Store::start(&addr, "64MB", &[]);
    put(&addr, dir.path(), "on-a-lane", &[]);

    // More connections than lanes, each used in turn: every one is answered.
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let mut conns: Vec<TcpStream> = (0..cores + 3).map(|_| connect(&addr)).collect();
    for round in 0..3 {
        for (i, s) in conns.iter_mut().enumerate() {
            let answer = roundtrip(s, &exist_frame("", &["on-a-lane"]));
            let quick::Response::Ok(body) = quick::decode_response(&answer).unwrap() else {
                panic!("connection {i}, round {round}: an answer");
            };
            let r = pb::BatchObjectLocations::decode(body).unwrap();
            assert_eq!(r.results[0].code, 0, "connection {i}: {:?}", r.results[0]);
        }
    }

    let lanes: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", master.proc.pid()))
        .expect("the master's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with("quick-"))
        .collect();
    assert_eq!(
        lanes.len(),
        cores,
        "one lane per core, the master's threads: {lanes:?}"
    );
}
/// A batch put is one BatchPutStart and one BatchPutEnd, both quick calls, and a requester
/// that never saw the keys finds all of them with one quick BatchGetReplicaList (its lookups
/// go on the caller's thread, not through the client runtime's gRPC connection).
#[test]
fn a_batch_put_and_a_cold_get_batch_are_quick_calls() {
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let _store = Store::start(&master.addr(), "64MiB", &[]);
    let c = lunakv_tests::requester(&master.addr());
    let n = 100;
    let keys: Vec<String> = (0..n).map(|i| format!("chunked-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..n).map(|i| pattern(i as u64, 4096 + i)).collect();
    let items: Vec<(&str, Vec<&[u8]>)> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_str(), vec![&v[..2048], &v[2048..]]))
        .collect();
    let starts = master
        .metric("master_batch_put_start_requests_total")
        .unwrap_or(0.0);
    let ends = master
        .metric("master_batch_put_end_requests_total")
        .unwrap_or(0.0);
    let quick = master.metric("master_quick_calls_total").unwrap_or(0.0);
    for r in c.batch_put(&items, &Default::default()) {
        r.expect("every object of the batch is put");
    }
    assert_eq!(
        master
            .metric("master_batch_put_start_requests_total")
            .unwrap()
            - starts,
        1.0,
        "one placement call for the whole batch"
    );
    assert_eq!(
        master
            .metric("master_batch_put_end_requests_total")
            .unwrap()
            - ends,
        1.0,
        "one publish for the whole batch"
    );
    assert_eq!(
        master.metric("master_quick_calls_total").unwrap() - quick,
        2.0,
        "both as quick calls"
    );
    // A requester that never saw these keys finds them all with one quick lookup.
    let fresh = lunakv_tests::requester(&master.addr());
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut dsts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let quick = master.metric("master_quick_calls_total").unwrap();
    for r in fresh.batch_get_into(&key_refs, &mut dsts) {
        r.expect("every object reads back");
    }
    assert_eq!(
        master.metric("master_quick_calls_total").unwrap() - quick,
        1.0,
        "the lookups of a get batch are one quick call"
    );
    assert_eq!(bufs, values, "every byte as put");
}
