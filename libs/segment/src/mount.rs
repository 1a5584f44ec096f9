//! Mounting a segment with the master, and mounting it again with its inventory when a new
//! master (a restart, a new HA leader) does not know it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lunakv_master_client::{ClientError, MasterLink};
use lunakv_proto::master as pb;
use lunakv_transfer::{ProtocolChoice, SegmentInfo, SegmentServer};

use crate::inventory::{DiskInventory, inventory_item, inventory_parts};

/// Whether a segment is mounted with the master: a store-client's readiness. Cheap to clone;
/// every clone sees the same flag.
#[derive(Debug, Clone, Default)]
pub struct MountStatus(Arc<AtomicBool>);

impl MountStatus {
    pub fn is_mounted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    pub(crate) fn set(&self, mounted: bool) {
        self.0.store(mounted, Ordering::SeqCst);
    }
}

/// Mounts (and re-mounts) a segment; also drives the heartbeat of a pure requester, which has
/// no segment.
pub(crate) struct Mounter {
    pub(crate) master: MasterLink,
    pub(crate) client_id: String,
    pub(crate) cluster_id: String,
    pub(crate) protocol: ProtocolChoice,
    pub(crate) enable_offload: bool,
    pub(crate) server: Option<Arc<SegmentServer>>,
    pub(crate) disk: Option<Arc<dyn DiskInventory>>,
    /// Set after every successful mount, cleared while a re-mount is due.
    pub(crate) status: MountStatus,
}

/// A mount as the requests that make it: MountSegment with the first part of the inventory,
/// then one MountInventory per further part.
struct MountPlan {
    first: pb::MountSegmentRequest,
    rest: Vec<pb::MountInventoryRequest>,
    info: SegmentInfo,
    /// Inventory items in all.
    items: usize,
}

/// What the master accepted over a plan's requests.
#[derive(Default)]
struct MountTally {
    accepted: u64,
    rejected: usize,
}

impl MountTally {
    fn add(&mut self, accepted: u64, rejected: usize) {
        self.accepted += accepted;
        self.rejected += rejected;
    }
}

impl Mounter {
    /// The requests that mount the segment as it is now (with its inventory); `None` for a
    /// pure requester.
    fn plan(&self) -> Option<MountPlan> {
        let server = self.server.as_ref()?;
        let info = server.info();
        let mut inventory: Vec<pb::InventoryItem> = server
            .inventory()
            .into_iter()
            .map(|e| inventory_item(e, pb::ReplicaKind::Memory))
            .collect();
        if let Some(d) = &self.disk {
            inventory.extend(
                d.objects()
                    .into_iter()
                    .map(|e| inventory_item(e, pb::ReplicaKind::LocalDisk)),
            );
        }
        let items = inventory.len();
        let mut segment = descriptor(&info, &self.protocol, self.enable_offload);
        segment.disk_capacity_bytes = self.disk.as_ref().map_or(0, |d| d.capacity());
        let instance_id = segment.instance_id.clone();
        // The master takes at most 4 MiB per message (gRPC's default): tens of thousands of
        // vLLM-shaped keys are more than that, so the inventory goes in parts.
        let mut parts = inventory_parts(inventory).into_iter();
        let first = parts.next().unwrap_or_default();
        let rest: Vec<Vec<pb::InventoryItem>> = parts.collect();
        let last = rest.len();
        let first = pb::MountSegmentRequest {
            client_id: self.client_id.clone(),
            cluster_id: self.cluster_id.clone(),
            segment: Some(segment),
            inventory: first,
            inventory_follows: !rest.is_empty(),
            data_secret: server
                .capability_secret()
                .map(|k| k.as_bytes().to_vec())
                .unwrap_or_default(),
        };
        let rest = rest
            .into_iter()
            .enumerate()
            .map(|(i, items)| pb::MountInventoryRequest {
                client_id: self.client_id.clone(),
                segment_name: info.name.clone(),
                instance_id: instance_id.clone(),
                items,
                last: i + 1 == last,
            })
            .collect();
        Some(MountPlan {
            first,
            rest,
            info,
            items,
        })
    }

    /// Mounts (or re-mounts) through the link, with its HA and rebuild retries.
    pub(crate) async fn mount(&self) -> Result<(), ClientError> {
        let Some(plan) = self.plan() else {
            return Ok(());
        };
        let resp = self
            .master
            .call(|mut m| {
                let req = plan.first.clone();
                async move { m.mount_segment(req).await }
            })
            .await?;
        let mut tally = MountTally::default();
        tally.add(resp.accepted_objects, resp.rejected_generations.len());
        for req in &plan.rest {
            let resp = self
                .master
                .call(|mut m| {
                    let req = req.clone();
                    async move { m.mount_inventory(req).await }
                })
                .await?;
            tally.add(resp.accepted_objects, resp.rejected_generations.len());
        }
        self.mounted(&plan, &tally);
        Ok(())
    }

    /// One mount attempt with the master's own status, so that a starting owner can tell a
    /// refusal from a master that is not ready yet (`startup::retryable`). A failure part-way
    /// is retried from MountSegment, which starts the inventory again.
    pub(crate) async fn mount_once(&self, timeout: Duration) -> Result<(), tonic::Status> {
        let Some(plan) = self.plan() else {
            return Ok(());
        };
        let timed_out = |rpc: &str| tonic::Status::deadline_exceeded(format!("{rpc} timed out"));
        let mut m = self.master.client();
        let resp = tokio::time::timeout(timeout, m.mount_segment(plan.first.clone()))
            .await
            .map_err(|_| timed_out("MountSegment"))??
            .into_inner();
        let mut tally = MountTally::default();
        tally.add(resp.accepted_objects, resp.rejected_generations.len());
        for req in &plan.rest {
            let resp = tokio::time::timeout(timeout, m.mount_inventory(req.clone()))
                .await
                .map_err(|_| timed_out("MountInventory"))??
                .into_inner();
            tally.add(resp.accepted_objects, resp.rejected_generations.len());
        }
        self.mounted(&plan, &tally);
        Ok(())
    }

    fn mounted(&self, plan: &MountPlan, tally: &MountTally) {
        self.status.set(true);
        tracing::info!(
            segment = %plan.info.name,
            size = plan.info.size,
            inventory = plan.items,
            parts = plan.rest.len() + 1,
            accepted = tally.accepted,
            rejected = tally.rejected,
            "segment mounted"
        );
    }
}

/// The segment as MountSegment describes it to the master.
fn descriptor(
    info: &SegmentInfo,
    protocol: &ProtocolChoice,
    enable_offload: bool,
) -> pb::SegmentDescriptor {
    pb::SegmentDescriptor {
        name: info.name.clone(),
        transfer_endpoint: info.transfer_endpoint.clone(),
        size: info.size,
        host_id: info.host_id.clone(),
        shm_socket: info.shm_socket.clone().unwrap_or_default(),
        protocol: protocol.effective.as_str().to_owned(),
        enable_offload,
        disk_capacity_bytes: 0,
        instance_id: info.instance_id.clone(),
        requested_protocol: protocol.requested.as_str().to_owned(),
        protocol_reason: protocol.reason_str().to_owned(),
    }
}
