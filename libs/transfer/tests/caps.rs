//! Capabilities at the owner (docs/SECURITY.md, "Capabilities"): a segment server that requires
//! them refuses every READ, WRITE, PIN, COMMIT, ATTACH and FREE whose capability (or master tag)
//! is missing, forged, expired or grants too little, before it touches memory, and the victim's
//! bytes stay its own. Real sockets on 127.0.0.1 port 0 and real memfds.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use lunakv_transfer::cap::{READ_TTL, RIGHT_READ, RIGHT_WRITE, WRITE_TTL, attach_cap};
use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    Capability, Grant, MountSecret, SegmentServer, SegmentServerConfig, Target, TransferEngine,
    TransferError, TransferOptions,
};

const SEG: u64 = 4 << 20;
const GEN: u64 = 9 << 32 | 1;
const OFF: u64 = 8192;
const LEN: u64 = 4096;

struct Owner {
    server: SegmentServer,
    secret: MountSecret,
    _dir: tempfile::TempDir,
    sock: std::path::PathBuf,
}

fn owner() -> Owner {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("seg.sock");
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: Some(sock.clone()),
        ..Default::default()
    })
    .unwrap();
    let secret = MountSecret::generate();
    assert!(server.require_capabilities(secret));
    assert!(!server.require_capabilities(MountSecret::generate()));
    Owner {
        server,
        secret,
        _dir: dir,
        sock,
    }
}

fn tcp() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    })
}

fn grant(o: &Owner) -> Grant<'_> {
    // The segment's name is what every capability covers; `info()` is what the master knows.
    let _ = o;
    Grant {
        segment: "",
        generation: GEN,
        offset: OFF,
        len: LEN,
    }
}

fn target_with(o: &Owner, cap: Option<Capability>) -> Target {
    Target {
        capability: cap,
        ..Target::from(&o.server.info())
    }
}

fn cap(o: &Owner, secret: &MountSecret, rights: u8, expiry_ms: Option<u64>) -> Capability {
    let name = o.server.info().name;
    let g = Grant {
        segment: &name,
        ..grant(o)
    };
    match expiry_ms {
        Some(at) => Capability::issue_until(secret, &g, rights, at),
        None => Capability::issue(secret, &g, rights, WRITE_TTL),
    }
}

fn read(e: &TransferEngine, t: &Target) -> Result<Vec<u8>, TransferError> {
    let mut buf = vec![0u8; LEN as usize];
    e.read(t, GEN, OFF, &mut [&mut buf[..]])?;
    Ok(buf)
}

fn refused(r: Result<(), TransferError>, says: &str) {
    match r {
        Err(TransferError::Refused { message, .. }) => {
            assert!(
                message.contains(says),
                "refusal {message:?} should say {says:?}"
            )
        }
        other => panic!("expected a refusal saying {says:?}, got {other:?}"),
    }
}

#[test]
fn a_write_without_a_valid_write_capability_is_refused_and_the_bytes_stay_the_victims() {
    let o = owner();
    let e = tcp();
    let victim = vec![7u8; LEN as usize];
    let rw = cap(&o, &o.secret, RIGHT_READ | RIGHT_WRITE, None);
    e.write(&target_with(&o, Some(rw)), GEN, "k", OFF, &[&victim])
        .expect("the master's write capability is accepted");

    let evil = vec![0xEEu8; LEN as usize];
    let attempts = [
        (None, "requires a capability"),
        (
            Some(cap(&o, &MountSecret::generate(), RIGHT_WRITE, None)),
            "does not match",
        ),
        (
            Some(cap(&o, &o.secret, RIGHT_READ, None)),
            "does not grant write",
        ),
        (Some(cap(&o, &o.secret, RIGHT_WRITE, Some(1))), "expired"),
    ];
    for (c, says) in attempts {
        refused(e.write(&target_with(&o, c), GEN, "k", OFF, &[&evil]), says);
    }
    // Even the right capability cannot rewrite a committed generation.
    refused(
        e.write(&target_with(&o, Some(rw)), GEN, "k", OFF, &[&evil]),
        "already committed",
    );
    let r = Capability::issue(
        &o.secret,
        &Grant {
            segment: &o.server.info().name,
            ..grant(&o)
        },
        RIGHT_READ,
        READ_TTL,
    );
    assert_eq!(read(&e, &target_with(&o, Some(r))).unwrap(), victim);
    // A read without a capability is refused too; the connection stays usable.
    match read(&e, &target_with(&o, None)) {
        Err(TransferError::Refused { .. }) => {}
        other => panic!("a read without a capability must be refused: {other:?}"),
    }
    assert_eq!(read(&e, &target_with(&o, Some(r))).unwrap(), victim);
    assert!(o.server.refused_total() >= 6);
}

#[test]
fn a_free_without_the_masters_tag_is_refused_and_one_with_it_is_served() {
    let o = owner();
    let e = tcp();
    let rw = cap(&o, &o.secret, RIGHT_READ | RIGHT_WRITE, None);
    let t = target_with(&o, Some(rw));
    e.write(&t, GEN, "k", OFF, &[&vec![3u8; LEN as usize]])
        .unwrap();
    let ep = t.endpoint.clone();
    refused(
        e.free(&ep, &[(GEN, OFF)], Duration::from_secs(1)),
        "FREE not from the master",
    );
    e.set_owner_key(&ep, Some(MountSecret::generate()));
    refused(
        e.free(&ep, &[(GEN, OFF)], Duration::from_secs(1)),
        "does not match",
    );
    assert_eq!(read(&e, &t).unwrap(), vec![3u8; LEN as usize]);
    e.set_owner_key(&ep, Some(o.secret));
    e.free(&ep, &[(GEN, OFF)], Duration::from_secs(1)).unwrap();
    assert!(matches!(read(&e, &t), Err(TransferError::Stale { .. })));
}

#[test]
fn shm_attach_needs_a_capability_and_the_shm_path_carries_one() {
    let o = owner();
    // A raw ATTACH without a capability: REFUSED, and no descriptor.
    let mut s = UnixStream::connect(&o.sock).unwrap();
    s.write_all(&Request::bare(Op::Attach).encode()).unwrap();
    let mut hdr = [0u8; wire::RESP_LEN];
    s.read_exact(&mut hdr).unwrap();
    assert_eq!(Response::decode(&hdr).unwrap().status, Status::Refused);

    let e = TransferEngine::new(TransferOptions::default());
    let rw = cap(&o, &o.secret, RIGHT_READ | RIGHT_WRITE, None);
    let t = target_with(&o, Some(rw));
    if !e.uses_shm(&t) {
        eprintln!("shm disabled by the environment; skipping the shm half of this test");
        return;
    }
    let v = vec![5u8; LEN as usize];
    e.write(&t, GEN, "k", OFF, &[&v]).unwrap();
    assert_eq!(read(&e, &t).unwrap(), v);
    assert!(o.server.stats().shm_attaches >= 1, "the put went by shm");
    for _ in 0..50 {
        assert_eq!(read(&e, &t).unwrap(), v);
    }
    assert_eq!(
        o.server.stats().shm_attaches,
        1,
        "one attach serves every later request"
    );
    assert_eq!(
        o.server.refused_total(),
        1,
        "only the raw ATTACH was refused"
    );
}

#[test]
fn a_raw_read_of_another_range_with_a_valid_capability_is_refused() {
    let o = owner();
    let e = tcp();
    let rw = cap(&o, &o.secret, RIGHT_READ | RIGHT_WRITE, None);
    e.write(
        &target_with(&o, Some(rw)),
        GEN,
        "k",
        OFF,
        &[&vec![1u8; LEN as usize]],
    )
    .unwrap();
    // The capability of (GEN, OFF, LEN) sent with a READ of another generation at 0.
    let mut s = TcpStream::connect(o.server.local_addr()).unwrap();
    let mut h = Request {
        op: Op::Read,
        generation: GEN + 1,
        offset: 0,
        len: LEN,
        key_len: 0,
        aux: 0,
    }
    .encode();
    let cb = attach_cap(&mut h, Some(&rw)).to_vec();
    s.write_all(&h).unwrap();
    s.write_all(&cb).unwrap();
    let mut hdr = [0u8; wire::RESP_LEN];
    s.read_exact(&mut hdr).unwrap();
    assert_eq!(Response::decode(&hdr).unwrap().status, Status::Refused);
}

#[test]
fn without_capabilities_required_nothing_changes_on_the_wire_but_committed_generations_stay() {
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        ..Default::default()
    })
    .unwrap();
    let e = tcp();
    let t = Target::from(&server.info());
    e.write(&t, GEN, "k", OFF, &[&vec![2u8; LEN as usize]])
        .unwrap();
    let mut buf = vec![0u8; LEN as usize];
    e.read(&t, GEN, OFF, &mut [&mut buf[..]]).unwrap();
    assert_eq!(buf, vec![2u8; LEN as usize]);
    refused(
        e.write(&t, GEN, "k", OFF, &[&vec![9u8; LEN as usize]]),
        "already committed",
    );
    // The default: anyone may write a new generation anywhere (closed only by capabilities).
    e.write(&t, GEN + 1, "other", OFF, &[&vec![9u8; LEN as usize]])
        .unwrap();
}
