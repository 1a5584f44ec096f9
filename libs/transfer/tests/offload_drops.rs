//! OFFLOAD with `FLAG_DROPS`: the owner names in its answer the objects its disk tier dropped
//! to make room, so the master forgets them at once instead of at the owner's next Ping (until
//! then it called them present: reads got -704, re-puts -705). Requests without the flag, and
//! owners that predate it, keep the old answer.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use lunakv_transfer::wire::{self, DroppedObject, Op, Request, Response, Status};
use lunakv_transfer::{
    ColdDropped, ColdItem, ColdStored, ColdTier, ColdTierError, PlacementProof, SegmentServer,
    SegmentServerConfig, Target, TcpTransport, TransferEngine, TransferOptions,
};
use parking_lot::Mutex;

/// A disk tier holding at most `cap` objects, oldest dropped first (as the size limit drops
/// the oldest buckets), with the Ping's queue of drops it reports itself.
struct FifoTier {
    cap: usize,
    held: Mutex<VecDeque<(u64, String, u64)>>,
    queued: Mutex<Vec<ColdDropped>>,
    /// Extra drops the next store makes (objects no WRITE could have named).
    inject: Mutex<Vec<ColdDropped>>,
}

impl FifoTier {
    fn new(cap: usize) -> Arc<FifoTier> {
        Arc::new(FifoTier {
            cap,
            held: Mutex::new(VecDeque::new()),
            queued: Mutex::new(Vec::new()),
            inject: Mutex::new(Vec::new()),
        })
    }

    fn put(&self, items: &[ColdItem<'_>]) -> ColdStored {
        let mut held = self.held.lock();
        let mut out = ColdStored {
            dropped: std::mem::take(&mut *self.inject.lock()),
            ..ColdStored::default()
        };
        for i in items {
            while held.len() >= self.cap {
                let Some((generation, key, size)) = held.pop_front() else {
                    break;
                };
                out.dropped.push(ColdDropped {
                    key,
                    generation,
                    size,
                });
            }
            held.push_back((i.generation, i.key.to_owned(), i.bytes.len() as u64));
            out.stored.push(i.generation);
        }
        out
    }
}

impl ColdTier for FifoTier {
    fn store(&self, items: &[ColdItem<'_>]) -> Result<Vec<u64>, ColdTierError> {
        let s = self.put(items);
        self.queued.lock().extend(s.dropped);
        Ok(s.stored)
    }
    fn store_reporting(&self, items: &[ColdItem<'_>]) -> Result<ColdStored, ColdTierError> {
        Ok(self.put(items))
    }
    fn report_later(&self, dropped: Vec<ColdDropped>) {
        self.queued.lock().extend(dropped);
    }
    fn size_of(&self, generation: u64) -> Option<u64> {
        self.held
            .lock()
            .iter()
            .find(|h| h.0 == generation)
            .map(|h| h.2)
    }
    fn proof_of(&self, _generation: u64) -> Option<PlacementProof> {
        None
    }
    fn load(&self, _generation: u64, _dst: &mut [u8]) -> Result<bool, ColdTierError> {
        Ok(false)
    }
    fn remove(&self, generations: &[u64]) {
        self.held.lock().retain(|h| !generations.contains(&h.0));
    }
}

/// A segment whose disk tier holds 2 objects, with entries 1..=n at offsets 4096*(g-1).
fn owner(tier: Arc<FifoTier>, n: u64) -> (SegmentServer, Target) {
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    assert!(server.set_cold_tier(tier));
    let t = Target::from(&server.info());
    let engine = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    for g in 1..=n {
        engine
            .write(&t, g, &format!("k{g}"), 4096 * (g - 1), &[&[g as u8; 100]])
            .unwrap();
    }
    (server, t)
}

fn at(g: u64) -> (u64, u64) {
    (g, 4096 * (g - 1))
}

const WAIT: Duration = Duration::from_secs(1);

#[test]
fn the_answer_names_what_the_disk_tier_dropped_and_nothing_is_reported_twice() {
    let tier = FifoTier::new(2);
    let (_server, t) = owner(tier.clone(), 5);
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    let a = tcp
        .offload_reporting(&t.endpoint, &[at(1), at(2)], WAIT)
        .unwrap();
    assert!(a.reported);
    assert!(a.failed.is_empty() && a.dropped.is_empty());
    // Room for 3 and 4 pushes 1 and 2 out.
    let a = tcp
        .offload_reporting(&t.endpoint, &[at(3), at(4)], WAIT)
        .unwrap();
    assert!(a.reported);
    assert!(a.failed.is_empty());
    assert_eq!(
        a.dropped,
        vec![
            DroppedObject {
                generation: 1,
                key: "k1".into()
            },
            DroppedObject {
                generation: 2,
                key: "k2".into()
            },
        ]
    );
    assert!(
        tier.queued.lock().is_empty(),
        "drops named in the answer must not go on the Ping as well"
    );
    // A generation the owner does not have: failed, listed before the drops.
    let a = tcp
        .offload_reporting(&t.endpoint, &[(99, 0), at(5)], WAIT)
        .unwrap();
    assert_eq!(a.failed, vec![99]);
    assert_eq!(a.dropped.len(), 1);
    assert_eq!(a.dropped[0].generation, 3);
}

#[test]
fn without_the_flag_the_answer_is_the_old_one_and_drops_wait_for_the_ping() {
    let tier = FifoTier::new(1);
    let (_server, t) = owner(tier.clone(), 3);
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    // What an older master sends: no flag, the old body (failed generations only).
    let failed = tcp
        .offload(&t.endpoint, &[at(1), at(2), (99, 0)], WAIT)
        .unwrap();
    assert_eq!(failed, vec![99]);
    let queued: Vec<u64> = tier.queued.lock().iter().map(|d| d.generation).collect();
    assert_eq!(queued, vec![1], "the tier reports its drop itself");
}

/// A drop the answer may not carry (here a key past the wire's bound) is not lost: it goes on
/// the tier's own reporting (the Ping) instead.
#[test]
fn a_drop_the_answer_cannot_carry_goes_on_the_ping() {
    let tier = FifoTier::new(10);
    let (_server, t) = owner(tier.clone(), 1);
    let long = ColdDropped {
        key: "x".repeat(wire::MAX_KEY_LEN + 1),
        generation: 70,
        size: 1,
    };
    let short = ColdDropped {
        key: "y".into(),
        generation: 71,
        size: 1,
    };
    *tier.inject.lock() = vec![long.clone(), short];
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    let a = tcp.offload_reporting(&t.endpoint, &[at(1)], WAIT).unwrap();
    assert_eq!(
        a.dropped,
        vec![DroppedObject {
            generation: 71,
            key: "y".into()
        }]
    );
    assert_eq!(*tier.queued.lock(), vec![long]);
}

/// An owner from before the flag: it ignores the flag and answers with the old body and its
/// old features byte; the requester reads that body and leaves the drops to the Ping.
#[test]
fn an_owner_that_predates_the_flag_gets_the_old_answer_read() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = l.local_addr().unwrap().to_string();
    let old_owner = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hdr = [0u8; wire::REQ_LEN];
        s.read_exact(&mut hdr).unwrap();
        let req = Request::decode(&hdr).unwrap();
        assert_eq!(req.op, Op::Offload);
        assert!(wire::wants_drops(&hdr), "the requester asks");
        let mut body = vec![0u8; req.key_len as usize * 16];
        s.read_exact(&mut body).unwrap();
        let mut resp = Response {
            status: Status::Ok,
            value: 1,
            len: 8,
        }
        .encode();
        resp[wire::FLAGS_AT] = wire::FEATURE_TRACE | wire::FEATURE_IDENTITY;
        s.write_all(&resp).unwrap();
        s.write_all(&2u64.to_le_bytes()).unwrap();
        // Hold the connection until the requester read the answer.
        let _ = s.read(&mut [0u8; 1]);
    });
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    let a = tcp
        .offload_reporting(&endpoint, &[(1, 0), (2, 4096)], WAIT)
        .unwrap();
    assert_eq!(a.failed, vec![2]);
    assert!(a.dropped.is_empty());
    assert!(!a.reported);
    drop(tcp);
    old_owner.join().unwrap();
}

/// An owner claiming more than the bounds allow is a protocol error, not an allocation.
#[test]
fn an_answer_past_the_bounds_is_refused() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = l.local_addr().unwrap().to_string();
    let liar = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hdr = [0u8; wire::REQ_LEN];
        s.read_exact(&mut hdr).unwrap();
        let req = Request::decode(&hdr).unwrap();
        let mut body = vec![0u8; req.key_len as usize * 16];
        s.read_exact(&mut body).unwrap();
        let resp = Response {
            status: Status::Ok,
            value: 0,
            len: wire::max_offload_answer_len(1) + 1,
        }
        .encode();
        let _ = s.write_all(&resp);
        let _ = s.read(&mut [0u8; 1]);
    });
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    let e = tcp
        .offload_reporting(&endpoint, &[(1, 0)], WAIT)
        .unwrap_err();
    assert!(e.to_string().contains("OFFLOAD answered"), "{e}");
    drop(tcp);
    liar.join().unwrap();
}
