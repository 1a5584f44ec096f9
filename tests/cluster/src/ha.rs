//! [`HaCluster`]: HA masters (`--enable_ha`) and segments in the test process, on a real etcd
//! started on ephemeral ports; clients and segments find the leader through `etcd://...`.

use std::time::Duration;

use lunakv_master::{MasterConfig, RunningMaster};
use lunakv_meta::testing::{self, EtcdServer};
use lunakv_segment::SegmentHost;

use crate::{
    ClusterError, ClusterOptions, STEP_DEADLINE, segment_options, start_segment, wait_for,
};

/// Several HA masters and their segments in this process. Dropping it stops them all.
pub struct HaCluster {
    masters: Vec<Option<RunningMaster>>,
    segments: Vec<SegmentHost>,
    etcd: EtcdServer,
    dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
}

impl HaCluster {
    /// `masters` HA masters, a leader among them, then `opts.segments` segments mounted with
    /// it. `None` when etcd tests are skipped (`LUNAKV_SKIP_ETCD=1`; a missing etcd fails).
    pub fn start(masters: usize, opts: ClusterOptions) -> Option<Result<HaCluster, ClusterError>> {
        let etcd = testing::etcd_or_skip()?;
        Some(HaCluster::start_on(etcd, masters, opts))
    }

    fn start_on(
        etcd: EtcdServer,
        masters: usize,
        opts: ClusterOptions,
    ) -> Result<HaCluster, ClusterError> {
        let rt = crate::runtime()?;
        let dir = tempfile::tempdir()?;
        let mut c = HaCluster {
            masters: Vec::new(),
            segments: Vec::new(),
            etcd,
            dir,
            rt,
        };
        for i in 0..masters {
            let cfg = MasterConfig {
                rpc_address: "127.0.0.1".to_owned(),
                rpc_port: 0,
                metrics_port: 0,
                data_dir: c.dir.path().join(format!("master-{i}")),
                enable_ha: true,
                etcd_endpoints: c.etcd.endpoint(),
                ..MasterConfig::default()
            };
            std::fs::create_dir_all(&cfg.data_dir)?;
            let m = c.rt.block_on(lunakv_master::start(cfg))?;
            c.masters.push(Some(m));
        }
        c.wait_leader(None);
        for i in 0..opts.segments {
            let so = segment_options(c.master_address(), i, &opts);
            let host = c.rt.block_on(start_segment(so))?;
            c.segments.push(host);
        }
        Ok(c)
    }

    /// `etcd://127.0.0.1:PORT`: what clients and segments use to find the leader.
    pub fn master_address(&self) -> String {
        self.etcd.etcd_url()
    }

    /// The one running master that says it leads (GET /role), if exactly one does.
    pub fn leader(&self) -> Option<usize> {
        let leading: Vec<usize> = (0..self.masters.len())
            .filter(|&i| self.role(i).as_deref() == Some("leader"))
            .collect();
        (leading.len() == 1).then(|| leading[0])
    }

    /// Waits for exactly one leader other than `exclude`; panics after [`STEP_DEADLINE`].
    pub fn wait_leader(&self, exclude: Option<usize>) -> usize {
        let mut found = None;
        wait_for("a leader", STEP_DEADLINE, || {
            found = self.leader().filter(|&l| Some(l) != exclude);
            found.is_some()
        });
        found.expect("a leader")
    }

    /// Stops master `i` gracefully: a leader hands over at once (it revokes its lease).
    pub fn stop_master(&mut self, i: usize) -> Result<(), ClusterError> {
        if let Some(m) = self.masters[i].take() {
            self.rt.block_on(m.shutdown())?;
        }
        Ok(())
    }

    /// Whether every segment is mounted with the current leader.
    pub fn segments_mounted(&self) -> bool {
        self.segments.iter().all(|s| s.status().is_mounted())
    }

    fn role(&self, i: usize) -> Option<String> {
        let m = self.masters[i].as_ref()?;
        let r = lunakv_http::get_blocking(
            &format!("http://{}/role", m.admin_addr),
            Duration::from_secs(5),
        )
        .ok()?;
        Some(r.text().trim().to_owned())
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        for s in self.segments.drain(..) {
            let _ = self.rt.block_on(s.shutdown());
        }
        for m in self.masters.drain(..).flatten() {
            let _ = self.rt.block_on(m.shutdown());
        }
    }
}
