//! Capabilities on the data path (issue 18 item 2; docs/SECURITY.md, "Capabilities"): with the
//! pool token set, a store refuses every transfer request whose capability the master did not
//! issue, so knowing where an object lives (GetReplicaList, `/query_key`) no longer lets a
//! stranger read it, overwrite it or free it, and the victim's get returns its own bytes. Without
//! the token (the loopback default) the same route still poisons an object: the second test
//! documents it. Real binaries on loopback; the attacker speaks the transfer wire on a raw socket.

use std::io::{Read, Write};
use std::net::TcpStream;

use lunakv_proto::master::GetReplicaListRequest;
use lunakv_proto::master::master_client::MasterClient;
use lunakv_tests::{Master, Store, child_env, http_get, pattern};
use lunakv_transfer::wire::{self, Op, Request, Response, Status};

const POOL: &str = "pool-0123456789abcdef0123456789";
const LEN: usize = 8192;

fn cli(master: &str, args: &[&str], token: Option<&str>) -> std::process::Output {
    let env: Vec<_> = token
        .map(|t| ("LUNAKV_AUTH_TOKEN", t))
        .into_iter()
        .collect();
    lunakv_tests::cli(master, args, &env)
}

fn put(master: &str, key: &str, value: &[u8], dir: &std::path::Path, token: Option<&str>) {
    let file = dir.join(key);
    std::fs::write(&file, value).unwrap();
    let out = cli(master, &["put", key, &file.display().to_string()], token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn get(master: &str, key: &str, token: Option<&str>) -> Vec<u8> {
    let out = cli(master, &["get", key], token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// What the attacker learned: where the object lives, and the capability the master handed
/// out with it (a read capability: the attacker is assumed to have seen a reader's answer).
struct Leak {
    endpoint: String,
    generation: u64,
    offset: u64,
    len: u64,
    capability: Vec<u8>,
}

fn locate(master: &str, key: &str, token: Option<&str>) -> Leak {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = MasterClient::connect(format!("http://{master}"))
            .await
            .unwrap();
        let mut req = tonic::Request::new(GetReplicaListRequest {
            client_id: String::new(),
            key: key.into(),
        });
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let l = c.get_replica_list(req).await.unwrap().into_inner();
        assert_eq!(l.code, 0, "{}", l.message);
        let r = &l.replicas[0];
        Leak {
            endpoint: l.segments[r.segment as usize].transfer_endpoint.clone(),
            generation: l.generation,
            offset: r.offset,
            len: r.size,
            capability: r.capability.clone(),
        }
    })
}

/// Sends one request (with `cap` after the header when given, and `body`) and returns the
/// answer's status and message.
fn raw(endpoint: &str, req: Request, cap: Option<&[u8]>, body: &[u8]) -> (Status, String) {
    let mut s = TcpStream::connect(endpoint).unwrap();
    let mut h = req.encode();
    if let Some(c) = cap {
        h[wire::FLAGS_AT] |= wire::FLAG_CAP;
        s.write_all(&h).unwrap();
        s.write_all(c).unwrap();
    } else {
        s.write_all(&h).unwrap();
    }
    s.write_all(body).unwrap();
    let mut hdr = [0u8; wire::RESP_LEN];
    s.read_exact(&mut hdr).unwrap();
    let resp = Response::decode(&hdr).unwrap();
    let mut msg = vec![0u8; resp.len as usize];
    s.read_exact(&mut msg).unwrap();
    (resp.status, String::from_utf8_lossy(&msg).into_owned())
}

fn write_req(l: &Leak, key: &str) -> Request {
    Request {
        op: Op::Write,
        generation: l.generation,
        offset: l.offset,
        len: l.len,
        key_len: key.len() as u32,
        aux: 0,
    }
}

fn free_req(count: u32) -> Request {
    Request {
        op: Op::Free,
        generation: 0,
        offset: 0,
        len: 0,
        key_len: count,
        aux: 1000,
    }
}

fn pair(l: &Leak) -> Vec<u8> {
    [l.generation.to_le_bytes(), l.offset.to_le_bytes()].concat()
}

#[test]
fn with_the_pool_token_no_read_write_or_free_without_the_masters_capability_has_an_effect() {
    let dir = tempfile::tempdir().unwrap();
    let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let store = Store::start(&addr, "64MB", &[]);
    assert!(
        store.proc.output().contains("requires capabilities"),
        "a store with the pool token says it requires capabilities"
    );
    let value = pattern(11, LEN);
    put(&addr, "victim", &value, dir.path(), Some(POOL));
    // The victim reads its own bytes: the CLI's capability passes (shm on this host, or tcp).
    assert_eq!(get(&addr, "victim", Some(POOL)), value);

    let l = locate(&addr, "victim", Some(POOL));
    assert_eq!(l.capability.len(), lunakv_transfer::cap::CAP_LEN);
    let evil = vec![0xEE; l.len as usize];
    let body = [b"victim".as_slice(), &evil].concat();

    // A raw READ of the victim's object without a capability.
    let read = Request {
        op: Op::Read,
        generation: l.generation,
        offset: l.offset,
        len: l.len,
        key_len: 0,
        aux: 0,
    };
    let (st, msg) = raw(&l.endpoint, read, None, &[]);
    assert_eq!(st, Status::Refused, "{msg}");
    assert!(msg.contains("requires a capability"), "{msg}");

    // WRITEs with the right generation, offset and length: no capability, a forged one, the
    // reader's (read-only) one, and the reader's with its expiry pushed out.
    let mut forged = vec![0u8; lunakv_transfer::cap::CAP_LEN];
    forged[0] = 3;
    forged[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut stretched = l.capability.clone();
    stretched[0] = 3;
    stretched[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let attempts: [(Option<&[u8]>, &str); 4] = [
        (None, "requires a capability"),
        (Some(&forged), "does not match"),
        (Some(&l.capability), "does not grant write"),
        (Some(&stretched), "does not match"),
    ];
    for (cap, says) in attempts {
        let (st, msg) = raw(&l.endpoint, write_req(&l, "victim"), cap, &body);
        assert_eq!(st, Status::Refused, "{msg}");
        assert!(msg.contains(says), "{msg:?} should say {says:?}");
    }

    // A FREE from a stranger, without the master's tag, and with a reader's capability.
    let (st, msg) = raw(&l.endpoint, free_req(1), None, &pair(&l));
    assert_eq!(st, Status::Refused, "{msg}");
    let (st, msg) = raw(&l.endpoint, free_req(1), Some(&l.capability), &pair(&l));
    assert_eq!(st, Status::Refused, "{msg}");

    // None of it had an effect, and the store counted each refusal.
    assert_eq!(get(&addr, "victim", Some(POOL)), value);
    let (_, metrics) = http_get(store.admin.expect("admin port"), "/metrics");
    let refused: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lunakv_store_transfer_refused_total "))
        .expect("lunakv_store_transfer_refused_total")
        .trim()
        .parse()
        .unwrap();
    assert!(refused >= 7.0, "7 refusals, counted {refused}");

    // The master's own FREE still works: remove frees the range through the owner.
    let rm = cli(&addr, &["rm", "victim", "--force"], Some(POOL));
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    let (st, msg) = raw(&l.endpoint, read, Some(&l.capability), &[]);
    assert_eq!(
        st,
        Status::Stale,
        "the owner dropped the entry on the master's FREE: {msg}"
    );
}

#[test]
fn without_the_pool_token_a_stranger_who_knows_the_location_drops_the_object_but_cannot_rewrite_it()
{
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let _store = Store::start(&addr, "64MB", &[]);
    let value = pattern(12, LEN);
    put(&addr, "victim", &value, dir.path(), None);
    let l = locate(&addr, "victim", None);
    assert!(l.capability.is_empty(), "no capabilities without the token");
    let evil = vec![0xEE; l.len as usize];
    // A committed generation is never rewritten, even here...
    let body = [b"victim".as_slice(), &evil].concat();
    let (st, _) = raw(&l.endpoint, write_req(&l, "victim"), None, &body);
    assert_eq!(st, Status::Refused);
    assert_eq!(get(&addr, "victim", None), value);
    // ...a stranger may FREE it (the default is open on loopback), but the FREE revokes its
    // generation: writing it again is refused, and the victim never reads the stranger's bytes
    // (it used to: a FREE then a WRITE poisoned the object).
    let (st, msg) = raw(&l.endpoint, free_req(1), None, &pair(&l));
    assert_eq!(st, Status::Ok, "{msg}");
    let (st, msg) = raw(&l.endpoint, write_req(&l, "victim"), None, &body);
    assert_eq!(st, Status::Refused, "{msg}");
    assert!(msg.contains("revoked"), "{msg}");
    let out = cli(&addr, &["get", "victim"], None);
    assert!(
        !out.status.success() || out.stdout != evil,
        "the victim read the stranger's bytes"
    );
}

#[test]
fn a_restarted_master_learns_the_same_secret_at_the_remount_and_its_capabilities_pass() {
    let dir = tempfile::tempdir().unwrap();
    let _env = child_env(&[("LUNAKV_AUTH_TOKEN", POOL)]);
    let mut master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let store = Store::start(&addr, "64MB", &[]);
    let value = pattern(13, LEN);
    put(&addr, "survivor", &value, dir.path(), Some(POOL));
    let before = locate(&addr, "survivor", Some(POOL));
    master.restart();
    // The store remounts with its inventory and the secret it drew at start; the new master's
    // capabilities then pass at the same store (none of the old master's is reused).
    let got = lunakv_tests::wait_until(std::time::Duration::from_secs(30), || {
        let out = cli(&addr, &["get", "survivor"], Some(POOL));
        out.status.success().then_some(out.stdout)
    })
    .expect("the object is served again after the remount");
    assert_eq!(got, value);
    let after = locate(&addr, "survivor", Some(POOL));
    assert_eq!(after.generation, before.generation);
    assert_ne!(after.capability, before.capability, "a fresh capability");
    let (_, metrics) = http_get(store.admin.expect("admin port"), "/metrics");
    assert!(
        metrics.contains("lunakv_store_transfer_refused_total 0"),
        "no request of the victim was refused"
    );
}

/// What a forged inventory did: the master's answer to the attacker's MountSegment and what
/// the victim's next get returned.
struct Forgery {
    accepted: u64,
    rejected: usize,
    victim_reads: Vec<u8>,
}

/// Issue 18's forged inventory: a caller with the pool token (or, without one, anyone) runs a
/// segment of its own holding its bytes under the victim's key, and mounts it with an
/// inventory that claims the key at a generation far above the victim's.
fn forge_inventory(token: Option<&str>) -> Forgery {
    let dir = tempfile::tempdir().unwrap();
    let env: Vec<(&str, &str)> = token
        .map(|t| ("LUNAKV_AUTH_TOKEN", t))
        .into_iter()
        .collect();
    let _env = child_env(&env);
    let master = Master::start(dir.path(), &[]);
    let addr = master.addr();
    let _store = Store::start(&addr, "64MB", &[]);
    let value = pattern(14, LEN);
    put(&addr, "victim", &value, dir.path(), token);
    let l = locate(&addr, "victim", token);

    // The attacker's own segment server, in this process: tcp only, no capabilities.
    let evil_server = lunakv_transfer::SegmentServer::start(lunakv_transfer::SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 1 << 20,
        shm_socket: None,
        ..Default::default()
    })
    .unwrap();
    let info = evil_server.info();
    let forged_gen = l.generation + (1 << 40);
    let evil = vec![0xEE; LEN];
    lunakv_transfer::TransferEngine::new(lunakv_transfer::TransferOptions {
        enable_shm: false,
        ..Default::default()
    })
    .write(
        &lunakv_transfer::Target::from(&info),
        forged_gen,
        "victim",
        0,
        &[&evil],
    )
    .unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let resp = rt.block_on(async {
        use lunakv_proto::master as pb;
        let mut c = MasterClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let mut req = tonic::Request::new(pb::MountSegmentRequest {
            client_id: "attacker".into(),
            cluster_id: "mooncake_cluster".into(),
            segment: Some(pb::SegmentDescriptor {
                name: info.name.clone(),
                transfer_endpoint: info.transfer_endpoint.clone(),
                size: info.size,
                host_id: "elsewhere".into(),
                protocol: "tcp".into(),
                instance_id: info.instance_id.clone(),
                ..Default::default()
            }),
            inventory: vec![pb::InventoryItem {
                key: "victim".into(),
                offset: 0,
                size: LEN as u64,
                generation: forged_gen,
                kind: pb::ReplicaKind::Memory as i32,
                // A made-up proof: the master's key never left the master.
                proof: vec![0x5A; 16],
            }],
            ..Default::default()
        });
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        c.mount_segment(req).await.unwrap().into_inner()
    });
    let victim_reads = get(&addr, "victim", token);
    if token.is_some() {
        assert_eq!(
            master.metric("master_inventory_unproven_total"),
            Some(1.0),
            "the rejection is counted"
        );
    }
    Forgery {
        accepted: resp.accepted_objects,
        rejected: resp.rejected_generations.len(),
        victim_reads,
    }
}

#[test]
fn with_the_pool_token_a_forged_inventory_is_rejected_and_the_victim_reads_its_bytes() {
    let f = forge_inventory(Some(POOL));
    assert_eq!((f.accepted, f.rejected), (0, 1));
    assert_eq!(f.victim_reads, pattern(14, LEN), "the victim's own bytes");
}

#[test]
fn without_the_pool_token_a_forged_inventory_poisons_the_key() {
    let f = forge_inventory(None);
    assert_eq!((f.accepted, f.rejected), (1, 0));
    assert_eq!(
        f.victim_reads,
        vec![0xEE; LEN],
        "the default is open on loopback"
    );
}
