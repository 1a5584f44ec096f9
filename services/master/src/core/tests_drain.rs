//! Unit tests of drain jobs' state machine ([`super::drain`]): validation, DRAINING segments
//! out of placement, moves handed to the source's owner and swapped in when reported, retries,
//! blocked objects, the rate bound, cancel and the final report.

use std::sync::Arc;
use std::time::Duration;

use lunakv_proto::ErrorCode;

use super::tests::desc;
use super::*;
use crate::notifier::RecordingNotifier;

fn core() -> (Arc<MasterCore>, Arc<RecordingNotifier>) {
    let n = Arc::new(RecordingNotifier::default());
    let cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl: Duration::from_secs(60),
        put_reservation_limit_ratio: 1.0,
        put_reservation_total_ratio: 1.0,
        put_eviction_limit_ratio: 1.0,
        drain_max_bytes_per_sec: 0,
        ..CoreConfig::default()
    };
    (Arc::new(MasterCore::new(cfg, 7, n.clone())), n)
}

fn mount(core: &MasterCore, client: &str, name: &str, size: u64) {
    core.mount(client, "c", desc(name, size), vec![])
        .expect("mount");
}

async fn put(core: &MasterCore, key: &str, size: u64) -> u64 {
    let (g, _) = core
        .put_start(
            "cl",
            key,
            size,
            &PutOptions {
                replica_num: 1,
                ..PutOptions::default()
            },
        )
        .await
        .expect("put_start");
    core.put_end(key).expect("put_end");
    g
}

fn req(segments: &[&str]) -> DrainRequest {
    DrainRequest {
        segments: segments.iter().map(|s| s.to_string()).collect(),
        target_segments: vec![],
        max_concurrency: 4,
        max_bytes_per_sec: None,
    }
}

fn on(core: &MasterCore, key: &str) -> Vec<String> {
    core.get_replica_list(key)
        .expect("readable")
        .replicas
        .iter()
        .map(|r| r.segment.name.clone())
        .collect()
}

fn ok(t: &MoveTask) -> MoveResult {
    MoveResult {
        job_id: t.job_id.clone(),
        key: t.key.clone(),
        generation: t.generation,
        ok: true,
        error: String::new(),
    }
}

/// One Ping of `client`: reports `results`, sends the FREEs, returns the next moves.
async fn ping(core: &MasterCore, client: &str, results: &[MoveResult]) -> Vec<MoveTask> {
    let (tasks, frees) = core.drain_ping(&Caller::default(), client, results);
    core.release(frees).await;
    tasks
}

#[tokio::test]
async fn requests_are_validated_as_upstream_does() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    mount(&core, "cb", "b", 1 << 20);
    let bad = |r: DrainRequest| core.create_drain(&r).expect_err("refused").code();
    assert_eq!(bad(req(&[])), ErrorCode::InvalidParams);
    assert_eq!(bad(req(&["a", "a"])), ErrorCode::InvalidParams);
    assert_eq!(
        bad(DrainRequest {
            max_concurrency: 0,
            ..req(&["a"])
        }),
        ErrorCode::InvalidParams
    );
    assert_eq!(
        bad(DrainRequest {
            target_segments: vec!["a".into()],
            ..req(&["a"])
        }),
        ErrorCode::InvalidParams
    );
    assert_eq!(bad(req(&["nope"])), ErrorCode::SegmentNotFound);
    assert_eq!(
        bad(DrainRequest {
            target_segments: vec!["nope".into()],
            ..req(&["a"])
        }),
        ErrorCode::SegmentNotFound
    );
    assert_eq!(core.segment_status("a"), Some(SegmentStatus::Ok));
    core.create_drain(&req(&["a"])).expect("created");
    assert_eq!(core.segment_status("a"), Some(SegmentStatus::Draining));
    // Draining already; and a draining segment is no target.
    assert_eq!(bad(req(&["a"])), ErrorCode::UnavailableInCurrentStatus);
    assert_eq!(
        bad(DrainRequest {
            target_segments: vec!["a".into()],
            ..req(&["b"])
        }),
        ErrorCode::UnavailableInCurrentStatus
    );
    assert_eq!(
        core.query_drain("123e4567-e89b-42d3-a456-426614174000")
            .expect_err("unknown")
            .code(),
        ErrorCode::JobNotFound
    );
}

#[tokio::test]
async fn a_draining_segment_takes_no_puts() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    mount(&core, "cb", "b", 1 << 20);
    core.create_drain(&req(&["a"])).expect("created");
    for i in 0..20 {
        let k = format!("k{i}");
        put(&core, &k, 1000).await;
        assert_eq!(on(&core, &k), ["b"]);
    }
    // Every segment draining: a put is refused, never placed on no segment.
    core.create_drain(&req(&["b"])).expect("created");
    let e = core
        .put_start("cl", "none", 10, &PutOptions::default())
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::NoAvailableHandle);
    assert!(e.message.contains("draining"), "{}", e.message);
}

#[tokio::test]
async fn moves_go_to_the_owner_and_swap_in_when_reported() {
    let (core, notifier) = core();
    mount(&core, "ca", "a", 1 << 20);
    let mut gens = Vec::new();
    for i in 0..6 {
        gens.push(put(&core, &format!("k{i}"), 1000).await);
    }
    mount(&core, "cb", "b", 1 << 20);
    let id = core.create_drain(&req(&["a"])).expect("created");
    assert_eq!(core.query_drain(&id).unwrap().status, JobStatus::Created);
    // Another client gets nothing to do.
    assert!(ping(&core, "cb", &[]).await.is_empty());
    let first = ping(&core, "ca", &[]).await;
    assert_eq!(first.len(), 4, "max_concurrency");
    for t in &first {
        assert_eq!(t.source.segment.name, "a");
        assert_eq!(t.target.segment.name, "b");
        assert!(!t.target.disk);
        // Until reported, readers still see the source.
        assert_eq!(on(&core, &t.key), ["a"]);
    }
    let r = core.query_drain(&id).unwrap();
    assert_eq!((r.status, r.active), (JobStatus::Running, 4));
    // A report for a move it was not handed (another client, another generation) is ignored.
    let mut wrong = ok(&first[0]);
    wrong.generation += 1;
    assert!(ping(&core, "cb", &[ok(&first[1])]).await.is_empty());
    let second = ping(&core, "ca", &[wrong]).await;
    assert!(second.is_empty(), "4 still in flight");
    let results: Vec<MoveResult> = first.iter().map(ok).collect();
    let second = ping(&core, "ca", &results).await;
    assert_eq!(second.len(), 2);
    for t in &first {
        assert_eq!(on(&core, &t.key), ["b"], "{}", t.key);
        assert!(
            notifier.freed().contains(&(t.generation, t.source.offset)),
            "the source of {} is freed",
            t.key
        );
    }
    let results: Vec<MoveResult> = second.iter().map(ok).collect();
    assert!(ping(&core, "ca", &results).await.is_empty());
    // The next Ping finds the segment empty: the job ends.
    assert!(ping(&core, "ca", &[]).await.is_empty());
    let r = core.query_drain(&id).unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!((r.succeeded, r.failed, r.blocked, r.active), (6, 0, 0, 0));
    assert_eq!(r.migrated_bytes, 6000);
    assert_eq!(core.segment_status("a"), Some(SegmentStatus::Drained));
    assert!(!core.drain_running_for("ca"));
    let a = core.segments().into_iter().find(|s| s.name == "a").unwrap();
    assert_eq!((a.used, a.objects), (0, 0));
    for i in 0..6 {
        assert_eq!(on(&core, &format!("k{i}")), ["b"]);
    }
}

#[tokio::test]
async fn a_failed_move_is_retried_then_reported_and_the_object_stays() {
    let (core, notifier) = core();
    mount(&core, "ca", "a", 1 << 20);
    put(&core, "k", 1000).await;
    mount(&core, "cb", "b", 1 << 20);
    let id = core.create_drain(&req(&["a"])).expect("created");
    let mut tasks = ping(&core, "ca", &[]).await;
    for _ in 0..3 {
        assert_eq!(tasks.len(), 1);
        let t = tasks[0].clone();
        let fail = MoveResult {
            ok: false,
            error: "reading the source: stale".into(),
            ..ok(&t)
        };
        tasks = ping(&core, "ca", &[fail]).await;
        // The target's range goes back through its owner.
        assert!(notifier.freed().contains(&(t.generation, t.target.offset)));
    }
    assert!(tasks.is_empty());
    let r = core.query_drain(&id).unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{r:?}");
    assert_eq!(r.failed, 3);
    assert_eq!(r.blocked_keys, ["k"]);
    assert_eq!(on(&core, "k"), ["a"]);
    assert_eq!(core.segment_status("a"), Some(SegmentStatus::Ok));
    let b = core.segments().into_iter().find(|s| s.name == "b").unwrap();
    assert_eq!(b.used, 0, "no target range left behind");
}

#[tokio::test]
async fn an_object_with_no_room_anywhere_is_blocked_and_listed() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    put(&core, "big", 600 << 10).await;
    put(&core, "small", 1000).await;
    mount(&core, "cb", "b", 256 << 10);
    let id = core.create_drain(&req(&["a"])).expect("created");
    let tasks = ping(&core, "ca", &[]).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].key, "small");
    assert!(ping(&core, "ca", &[ok(&tasks[0])]).await.is_empty());
    // A second pass retries the blocked one (a move landed since), then gives up.
    for _ in 0..3 {
        ping(&core, "ca", &[]).await;
    }
    let r = core.query_drain(&id).unwrap();
    assert_eq!(r.status, JobStatus::Failed, "{r:?}");
    assert_eq!((r.succeeded, r.blocked), (1, 1));
    assert_eq!(r.blocked_keys, ["big"]);
    assert!(r.message.contains("\"big\""), "{}", r.message);
    assert_eq!(on(&core, "big"), ["a"]);
    assert_eq!(on(&core, "small"), ["b"]);
}

#[tokio::test]
async fn the_byte_rate_bounds_what_is_handed_out() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    for i in 0..8 {
        put(&core, &format!("k{i}"), 1000).await;
    }
    mount(&core, "cb", "b", 1 << 20);
    core.create_drain(&DrainRequest {
        max_bytes_per_sec: Some(1),
        ..req(&["a"])
    })
    .expect("created");
    assert_eq!(ping(&core, "ca", &[]).await.len(), 1);
    assert!(ping(&core, "ca", &[]).await.is_empty(), "no tokens left");
}

#[tokio::test]
async fn cancel_restores_the_segment_and_refuses_an_ended_job() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    for i in 0..3 {
        put(&core, &format!("k{i}"), 1000).await;
    }
    mount(&core, "cb", "b", 1 << 20);
    let id = core.create_drain(&req(&["a"])).expect("created");
    let tasks = ping(&core, "ca", &[]).await;
    assert_eq!(tasks.len(), 3);
    core.cancel_drain(&id).expect("canceled");
    assert_eq!(core.segment_status("a"), Some(SegmentStatus::Ok));
    assert_eq!(core.query_drain(&id).unwrap().status, JobStatus::Canceled);
    assert_eq!(
        core.cancel_drain(&id).expect_err("ended").code(),
        ErrorCode::UnavailableInCurrentStatus
    );
    // A move in flight still lands; none is handed out any more.
    assert!(ping(&core, "ca", &[ok(&tasks[0])]).await.is_empty());
    assert_eq!(on(&core, &tasks[0].key), ["b"]);
    assert_eq!(on(&core, &tasks[1].key), ["a"]);
    let r = core.query_drain(&id).unwrap();
    assert_eq!(r.status, JobStatus::Canceled);
    assert_eq!(r.message, "Drain job canceled");
    // The segment drains again from OK.
    core.create_drain(&req(&["a"])).expect("a new job");
}

#[tokio::test]
async fn an_object_removed_during_its_move_frees_the_target() {
    let (core, notifier) = core();
    mount(&core, "ca", "a", 1 << 20);
    put(&core, "k", 1000).await;
    mount(&core, "cb", "b", 1 << 20);
    let id = core.create_drain(&req(&["a"])).expect("created");
    let tasks = ping(&core, "ca", &[]).await;
    core.remove("k", true).await.expect("removed");
    ping(&core, "ca", &[ok(&tasks[0])]).await;
    assert!(
        notifier
            .freed()
            .contains(&(tasks[0].generation, tasks[0].target.offset))
    );
    ping(&core, "ca", &[]).await;
    let r = core.query_drain(&id).unwrap();
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    assert_eq!(r.succeeded, 0);
}

#[tokio::test]
async fn a_put_still_in_flight_on_the_source_is_moved_once_it_ends() {
    let (core, _) = core();
    mount(&core, "ca", "a", 1 << 20);
    core.put_start("cl", "late", 1000, &PutOptions::default())
        .await
        .expect("put_start");
    mount(&core, "cb", "b", 1 << 20);
    let id = core.create_drain(&req(&["a"])).expect("created");
    assert!(ping(&core, "ca", &[]).await.is_empty(), "not yet readable");
    assert_eq!(core.query_drain(&id).unwrap().status, JobStatus::Running);
    core.put_end("late").expect("put_end");
    let tasks = ping(&core, "ca", &[]).await;
    assert_eq!(tasks.len(), 1);
    ping(&core, "ca", &[ok(&tasks[0])]).await;
    ping(&core, "ca", &[]).await;
    let r = core.query_drain(&id).unwrap();
    assert_eq!((r.status, r.succeeded), (JobStatus::Succeeded, 1), "{r:?}");
    assert_eq!(on(&core, "late"), ["b"]);
}

#[tokio::test]
async fn a_replica_with_a_copy_elsewhere_and_no_room_for_another_is_dropped_not_moved() {
    let (core, notifier) = core();
    mount(&core, "ca", "a", 1 << 20);
    mount(&core, "cb", "b", 1 << 20);
    let (g, views) = core
        .put_start(
            "cl",
            "two",
            1000,
            &PutOptions {
                replica_num: 2,
                ..PutOptions::default()
            },
        )
        .await
        .expect("put_start");
    core.put_end("two").expect("put_end");
    let on_a = views.iter().find(|v| v.segment.name == "a").unwrap().offset;
    let id = core.create_drain(&req(&["a"])).expect("created");
    // b already holds a copy, and no third segment exists: nothing to move.
    assert!(ping(&core, "ca", &[]).await.is_empty());
    ping(&core, "ca", &[]).await;
    let r = core.query_drain(&id).unwrap();
    assert_eq!(
        (r.status, r.succeeded, r.blocked),
        (JobStatus::Succeeded, 1, 0),
        "{r:?}"
    );
    assert_eq!(on(&core, "two"), ["b"]);
    assert!(notifier.freed().contains(&(g, on_a)));
}
