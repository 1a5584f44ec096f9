//! Unit tests of the SSD tier: writes, reads, recovery after a restart, compaction and eviction
//! on small buckets in a temporary directory.

use super::*;

fn cfg(dir: &Path, limit: u64) -> OffloadConfig {
    let mut c = OffloadConfig::new(dir, limit);
    c.bucket_max_bytes = 64 << 10;
    c.bucket_max_keys = 4;
    c
}

fn obj(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j) as u8).collect()
}

fn put(t: &DiskTier, i: u64, len: usize) {
    let b = obj(i, len);
    let key = format!("k{i}");
    let stored = t
        .store_batch(&[StoreItem {
            key: &key,
            generation: i,
            bytes: &b,
            proof: None,
        }])
        .unwrap();
    assert_eq!(stored, vec![i]);
}

#[test]
fn stores_loads_and_recovers() {
    let d = tempfile::tempdir().unwrap();
    {
        let (t, r) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
        assert_eq!(r.objects, 0);
        for i in 1..=10 {
            put(&t, i, 10_000 + i as usize);
        }
        let mut buf = vec![0u8; 10_003];
        t.load(3, &mut buf).unwrap();
        assert_eq!(buf, obj(3, 10_003));
        assert!(matches!(t.load(99, &mut buf), Err(LoadError::NotFound(99))));
        t.remove(&[4]).unwrap();
        assert_eq!(t.stats().objects, 9);
    }
    let (t, r) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
    assert_eq!(r.objects, 9);
    let inv = t.inventory();
    assert_eq!(inv.len(), 9);
    assert!(inv.iter().all(|o| o.generation != 4));
    let mut buf = vec![0u8; 10_010];
    t.load(10, &mut buf).unwrap();
    assert_eq!(buf, obj(10, 10_010));
    // Appends after a restart go to a new bucket.
    put(&t, 11, 100);
}

#[test]
fn fifo_drops_oldest_buckets_at_the_limit() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = DiskTier::open(cfg(d.path(), 100_000)).unwrap();
    for i in 1..=20 {
        put(&t, i, 10_000);
    }
    let s = t.stats();
    assert!(s.used_bytes <= 100_000, "{s:?}");
    let dropped = t.take_dropped();
    assert!(!dropped.is_empty());
    // Oldest first.
    assert!(dropped.iter().all(|o| o.generation <= 12));
    let mut buf = vec![0u8; 10_000];
    t.load(20, &mut buf).unwrap();
    assert!(t.load(1, &mut buf).is_err());
    assert!(matches!(
        t.store_batch(&[StoreItem {
            key: "big",
            generation: 99,
            bytes: &vec![0u8; 200_000],
            proof: None,
        }]),
        Err(OffloadError::TooLarge { .. })
    ));
}

#[test]
fn after_seal_the_limit_drops_every_older_object_first() {
    let d = tempfile::tempdir().unwrap();
    // Bucket bounds far above the objects: without the seal all ten would share one bucket.
    let mut c = cfg(d.path(), 100_000);
    c.bucket_max_bytes = 1 << 20;
    c.bucket_max_keys = 500;
    let (t, _) = DiskTier::open(c).unwrap();
    for i in 1..=5 {
        put(&t, i, 10_000);
    }
    t.seal();
    // A drain of up to the limit: the five older objects go, none of the new ones.
    for i in 11..=20 {
        put(&t, i, 10_000);
    }
    for i in 1..=5 {
        assert_eq!(t.size_of(i), None, "older object {i} should have made room");
    }
    for i in 11..=20 {
        check(&t, i, 10_000);
    }
}

#[test]
fn lru_keeps_what_is_read() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path(), 100_000);
    c.policy = EvictionPolicy::Lru;
    let (t, _) = DiskTier::open(c).unwrap();
    for i in 1..=8 {
        put(&t, i, 10_000);
    }
    let mut buf = vec![0u8; 10_000];
    // Object 1 is read between puts: it keeps moving to the young end and survives, while
    // FIFO would have dropped it with the first bucket.
    for i in 9..=30 {
        put(&t, i, 10_000);
        t.load(1, &mut buf).unwrap();
    }
    assert!(t.load(2, &mut buf).is_err());
    assert_eq!(buf, obj(1, 10_000));
}

/// Fills a 100 KB tier of 4-object buckets with objects 1..=8, reads object 1 once, then puts
/// 9..=12, which drops the first bucket; returns the tier and the drops it reported.
fn read_once_then_overflow(policy: EvictionPolicy) -> (DiskTier, Vec<u64>, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path(), 100_000);
    c.policy = policy;
    let (t, _) = DiskTier::open(c).unwrap();
    for i in 1..=8 {
        put(&t, i, 10_000);
    }
    let mut buf = vec![0u8; 10_000];
    t.load(1, &mut buf).unwrap();
    for i in 9..=12 {
        put(&t, i, 10_000);
    }
    let mut dropped: Vec<u64> = t.take_dropped().iter().map(|o| o.generation).collect();
    dropped.sort_unstable();
    (t, dropped, d)
}

#[test]
fn clock_carries_what_was_read_out_of_a_dropped_bucket() {
    // FIFO: the first bucket goes whole, the object read with it.
    let (t, dropped, _d) = read_once_then_overflow(EvictionPolicy::Fifo);
    assert_eq!(dropped, vec![1, 2, 3, 4]);
    assert_eq!(t.size_of(1), None);

    // Clock: object 1 was read, so it moves to the newest bucket with the batch; the others
    // of its bucket go, reported, and the limit holds.
    let (t, dropped, _d) = read_once_then_overflow(EvictionPolicy::Clock);
    assert_eq!(dropped, vec![2, 3, 4]);
    // (Presence only: a read would mark them again.)
    for i in [1, 5, 6, 7, 8, 9, 10, 11, 12] {
        assert_eq!(t.size_of(i), Some(10_000), "object {i}");
    }
    let s = t.stats();
    assert_eq!(s.second_chances_total, 1);
    assert!(s.used_bytes <= 100_000, "{s:?}");
    // Its mark went with the move: unread since, it goes when its new bucket is the oldest.
    for i in 13..=40 {
        put(&t, i, 10_000);
    }
    assert_eq!(t.size_of(1), None);
    assert_eq!(t.stats().second_chances_total, 1);
}

#[test]
fn clock_second_chances_survive_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path(), 100_000);
    c.policy = EvictionPolicy::Clock;
    {
        let (t, _) = DiskTier::open(c.clone()).unwrap();
        for i in 1..=8 {
            put(&t, i, 10_000);
        }
        let mut buf = vec![0u8; 10_000];
        t.load(2, &mut buf).unwrap();
        for i in 9..=12 {
            put(&t, i, 10_000);
        }
    }
    // The carried copy is the indexed one; the old bucket's file is gone.
    let (t, r) = DiskTier::open(c).unwrap();
    assert_eq!(r.objects, 9);
    check(&t, 2, 10_000);
    assert!(!bucket_path(d.path(), 1).exists());
}

#[test]
fn corrupt_bytes_are_never_served() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
    put(&t, 1, 5000);
    put(&t, 2, 5000);
    // Flip one byte of object 2 (second in the first bucket).
    let bucket = bucket_path(d.path(), 1);
    let mut bytes = std::fs::read(&bucket).unwrap();
    bytes[5000 + 17] ^= 0xff;
    std::fs::write(&bucket, &bytes).unwrap();
    let mut buf = vec![0u8; 5000];
    assert!(matches!(
        t.load(2, &mut buf),
        Err(LoadError::Corrupt { .. })
    ));
    assert!(matches!(t.load(2, &mut buf), Err(LoadError::NotFound(2))));
    assert_eq!(t.stats().corrupt_objects_total, 1);
    assert_eq!(t.take_dropped()[0].key, "k2");
    t.load(1, &mut buf).unwrap();
}

#[test]
fn unindexed_tails_are_dropped_at_recovery() {
    let d = tempfile::tempdir().unwrap();
    {
        let (t, _) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
        put(&t, 1, 5000);
    }
    // A bucket written but never indexed (a crash before the commit), and a truncated bucket.
    std::fs::write(bucket_path(d.path(), 7), vec![1u8; 3000]).unwrap();
    let b1 = bucket_path(d.path(), 1);
    let f = std::fs::OpenOptions::new().write(true).open(&b1).unwrap();
    f.set_len(4000).unwrap();
    let (t, r) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
    assert_eq!(r.objects, 0);
    assert_eq!(r.dropped_rows, 1);
    assert_eq!(r.deleted_buckets, 2);
    assert!(t.inventory().is_empty());
}

#[test]
fn unwritable_directory_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let e = DiskTier::open(cfg(&file.join("sub"), 1 << 20))
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(msg.contains("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"), "{msg}");
}

fn check(t: &DiskTier, i: u64, len: usize) {
    let mut buf = vec![0u8; len];
    t.load(i, &mut buf)
        .unwrap_or_else(|e| panic!("object {i}: {e}"));
    assert_eq!(buf, obj(i, len), "object {i}");
}

/// Two sealed buckets of four 10 kB objects; bucket 1 keeps only object 4, bucket 2 keeps 7
/// and 8. 80 kB used, 30 kB live.
fn half_dead(dir: &Path, limit: u64) -> DiskTier {
    let (t, _) = DiskTier::open(cfg(dir, limit)).unwrap();
    for i in 1..=8 {
        put(&t, i, 10_000);
    }
    t.remove(&[1, 2, 3, 5, 6]).unwrap();
    let s = t.stats();
    assert_eq!((s.used_bytes, s.live_bytes), (80_000, 30_000));
    t
}

#[test]
fn compaction_reclaims_dead_space_before_dropping_live_objects() {
    let d = tempfile::tempdir().unwrap();
    let t = half_dead(d.path(), 100_000);
    // 80 kB + 3 x 10 kB > 100 kB: without compaction FIFO drops bucket 1 and object 4 with it.
    for i in 9..=11 {
        put(&t, i, 10_000);
    }
    let s = t.stats();
    assert!(s.compactions_total >= 1, "{s:?}");
    assert!(s.compacted_bytes_total >= 30_000, "{s:?}");
    assert!(s.used_bytes <= 100_000, "{s:?}");
    assert!(t.take_dropped().is_empty(), "a live object was dropped");
    for i in [4, 7, 8, 9, 10, 11] {
        check(&t, i, 10_000);
    }
    drop(t);
    // The new offsets are durable.
    let (t, r) = DiskTier::open(cfg(d.path(), 100_000)).unwrap();
    assert_eq!(r.objects, 6);
    for i in [4, 7, 8, 9, 10, 11] {
        check(&t, i, 10_000);
    }
}

#[test]
fn compaction_interrupted_before_its_index_commit_keeps_the_old_bucket() {
    let d = tempfile::tempdir().unwrap();
    let t = half_dead(d.path(), 1 << 30);
    assert_eq!(
        t.compact_bucket(1, CompactStop::BeforeIndexCommit).unwrap(),
        0
    );
    assert!(compact_path(d.path(), 1).exists());
    drop(t); // the "crash"
    let (t, r) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
    assert_eq!((r.compactions_discarded, r.compactions_finished), (1, 0));
    assert!(!compact_path(d.path(), 1).exists());
    assert_eq!(
        std::fs::metadata(bucket_path(d.path(), 1)).unwrap().len(),
        40_000
    );
    for i in [4, 7, 8] {
        check(&t, i, 10_000);
    }
}

#[test]
fn compaction_interrupted_after_its_index_commit_is_finished_at_open() {
    let d = tempfile::tempdir().unwrap();
    let t = half_dead(d.path(), 1 << 30);
    assert_eq!(t.compact_bucket(1, CompactStop::BeforeRename).unwrap(), 0);
    drop(t);
    let (t, r) = DiskTier::open(cfg(d.path(), 1 << 30)).unwrap();
    assert_eq!((r.compactions_discarded, r.compactions_finished), (0, 1));
    assert!(!compact_path(d.path(), 1).exists());
    // Bucket 1 now holds object 4 only.
    assert_eq!(
        std::fs::metadata(bucket_path(d.path(), 1)).unwrap().len(),
        10_000
    );
    for i in [4, 7, 8] {
        check(&t, i, 10_000);
    }
    assert_eq!(t.stats().used_bytes, 50_000);
}

#[test]
fn reads_during_a_compaction_see_the_right_bytes() {
    let d = tempfile::tempdir().unwrap();
    let t = Arc::new(half_dead(d.path(), 1 << 30));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (t, stop) = (t.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n == 0 {
                check(&t, 4, 10_000);
                n += 1;
            }
            n
        })
    };
    for _ in 0..20 {
        let _w = t.writer.lock();
        t.compact_bucket(1, CompactStop::Never).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    check(&t, 4, 10_000);
}

#[test]
fn placement_proofs_survive_a_restart_and_rows_without_one_still_decode() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path(), 1 << 30);
    c.policy = EvictionPolicy::Lru;
    // A tenant-scoped key holds a NUL; the proof may hold any byte, 0xFF included.
    let key = "tenant-a\0model/0/abc";
    let proof = [0xFFu8; PROOF_LEN];
    {
        let (t, _) = DiskTier::open(c.clone()).unwrap();
        let b = obj(1, 5000);
        t.store_batch(&[
            StoreItem {
                key,
                generation: 1,
                bytes: &b,
                proof: Some(proof),
            },
            StoreItem {
                key: "plain",
                generation: 2,
                bytes: &b,
                proof: None,
            },
        ])
        .unwrap();
        // An LRU read re-appends the object: its new row keeps the proof.
        let mut buf = vec![0u8; 5000];
        t.load(1, &mut buf).unwrap();
        assert_eq!(t.proof_of(1), Some(proof));
    }
    let (t, _) = DiskTier::open(c).unwrap();
    let inv = t.inventory();
    assert_eq!(inv[0].key, key);
    assert_eq!(inv[0].proof, Some(proof));
    assert_eq!(inv[1].proof, None);
    assert_eq!(t.proof_of(1), Some(proof));
    // A row written before proofs existed: the key runs to the end.
    let mut old = Vec::new();
    for v in [3u64, 4096, 5000] {
        old.extend_from_slice(&v.to_le_bytes());
    }
    old.extend_from_slice(&7u32.to_le_bytes());
    old.extend_from_slice(b"old-key");
    let l = Loc::decode(&old).expect("an old row decodes");
    assert_eq!((l.key.as_str(), l.proof), ("old-key", None));
    // A proof cut short is a corrupt row, not a wrong key.
    let mut cut = old.clone();
    cut.extend_from_slice(&[PROOF_MARK, 1, 2]);
    assert!(Loc::decode(&cut).is_none());
}

/// The OFFLOAD path: what the limit drops for a batch comes back with the batch, never twice
/// (not also on the Ping's queue); a drop the caller could not deliver goes back on the queue.
#[test]
fn a_reporting_store_returns_what_it_dropped_instead_of_queueing_it() {
    let d = tempfile::tempdir().unwrap();
    // 4 objects per bucket, 10 objects under the limit.
    let (t, _) = DiskTier::open(cfg(d.path(), 100_000)).unwrap();
    let bytes: Vec<Vec<u8>> = (0..=20).map(|i| obj(i, 10_000)).collect();
    let keys: Vec<String> = (0..=20).map(|i| format!("k{i}")).collect();
    let mut returned: Vec<DiskObject> = Vec::new();
    for i in 1..=20usize {
        let s = t
            .store_batch_reporting(&[StoreItem {
                key: &keys[i],
                generation: i as u64,
                bytes: &bytes[i],
                proof: None,
            }])
            .unwrap();
        assert_eq!(s.stored, vec![i as u64]);
        returned.extend(s.dropped);
    }
    assert!(!returned.is_empty(), "the limit dropped nothing");
    assert!(
        t.take_dropped().is_empty(),
        "reported drops must not reach the Ping too"
    );
    let mut buf = vec![0u8; 10_000];
    for o in &returned {
        assert_eq!(o.key, format!("k{}", o.generation));
        assert_eq!(o.size, 10_000);
        assert!(matches!(
            t.load(o.generation, &mut buf),
            Err(LoadError::NotFound(_))
        ));
    }
    // Every object not returned is still served: nothing was dropped silently.
    for i in 1..=20u64 {
        if returned.iter().all(|o| o.generation != i) {
            t.load(i, &mut buf).unwrap();
        }
    }
    assert_eq!(
        t.stats().evicted_objects_total,
        returned.len() as u64,
        "every drop is counted once"
    );
    t.requeue_dropped(returned.clone());
    assert_eq!(t.take_dropped(), returned);
    // The plain store still queues its drops for the Ping.
    for i in 21..=30u64 {
        put(&t, i, 10_000);
    }
    assert!(!t.take_dropped().is_empty());
}
