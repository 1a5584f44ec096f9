//! A segment that device copies use is pinned whole, ahead of use: the first device copy pins
//! the granules it touches and starts one thread that pins the rest, so later batches landing
//! on fresh granules do not pay the pinning inline (docs/GPU.md). Its own binary: the test
//! double's pin counters are process-wide.

use std::time::{Duration, Instant};

use lunakv_transfer::device::fake;
use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferOptions,
};

#[test]
fn the_first_device_copy_pins_the_rest_of_the_segment_in_the_background() {
    let double = fake::install(false).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Three 64 MiB granules.
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 192 << 20,
        shm_socket: Some(dir.path().join("seg.sock")),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&s.info());
    let e = TransferEngine::new(TransferOptions::default());
    e.attach_local(&s);
    let dev = double.alloc(4096).unwrap();
    double.write(dev, &[7u8; 4096]).unwrap();
    // SAFETY: a device address handed only to the transfer library.
    let piece = unsafe { std::slice::from_raw_parts(dev as *const u8, 4096) };
    e.write(&t, 1, "k", 0, &[piece]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while double.stats().pins < 3 {
        assert!(
            Instant::now() < deadline,
            "only {} of 3 granules pinned after 30 s",
            double.stats().pins
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(double.stats().pinned_bytes, 192 << 20);
    let mut back = vec![0u8; 4096];
    e.read(&t, 1, 0, &mut [&mut back[..]]).unwrap();
    assert_eq!(back, vec![7u8; 4096]);
    drop(e);
    drop(s);
    let st = double.stats();
    assert_eq!(
        (st.unpins, st.pinned_bytes),
        (3, 0),
        "unpinned before the mapping went away"
    );
    double.free(dev).unwrap();
}
