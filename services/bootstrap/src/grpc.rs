//! The gRPC API (`lunakv.bootstrap.v1.Bootstrap`) over the same table as the HTTP API.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lunakv_proto::bootstrap as pb;
use lunakv_proto::bootstrap::bootstrap_server::{Bootstrap, BootstrapServer};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::state::{BootstrapState, RegisterError, StateError, Table, Worker};

/// The tonic service.
pub struct BootstrapService {
    state: Arc<dyn BootstrapState>,
    lease: Duration,
    stop: watch::Receiver<bool>,
}

/// Builds the server half for `tonic::transport::Server::add_service`.
pub fn server(
    state: Arc<dyn BootstrapState>,
    lease: Duration,
    stop: watch::Receiver<bool>,
) -> BootstrapServer<BootstrapService> {
    BootstrapServer::new(BootstrapService { state, lease, stop })
}

fn to_pb(t: &Table) -> pb::QueryResponse {
    pb::QueryResponse {
        entries: t
            .entries
            .iter()
            .map(|(dp, e)| pb::DpEntry {
                dp_rank: *dp,
                engine_id: e.engine_id.clone(),
                workers: e
                    .workers
                    .iter()
                    .flat_map(|(tp, pps)| {
                        pps.iter().map(move |(pp, a)| pb::WorkerAddr {
                            tp_rank: *tp,
                            pp_rank: *pp,
                            addr: a.clone(),
                        })
                    })
                    .collect(),
            })
            .collect(),
        version: t.version,
    }
}

fn status(e: RegisterError) -> Status {
    match e {
        RegisterError::Invalid(_) => Status::invalid_argument(e.to_string()),
        RegisterError::Unavailable(_) => Status::unavailable(e.to_string()),
        _ => Status::already_exists(e.to_string()),
    }
}

fn unavailable(e: StateError) -> Status {
    Status::unavailable(e.to_string())
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::QueryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Bootstrap for BootstrapService {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let r = req.into_inner();
        let w = r
            .worker
            .ok_or_else(|| Status::invalid_argument("worker is missing"))?;
        let ttl = if r.lease_ttl_ms > 0 {
            Duration::from_millis(r.lease_ttl_ms)
        } else {
            self.lease
        };
        let out = self
            .state
            .register(
                Worker {
                    engine_id: w.engine_id,
                    dp_rank: w.dp_rank,
                    tp_rank: w.tp_rank,
                    pp_rank: w.pp_rank,
                    addr: w.addr,
                },
                ttl,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(pb::RegisterResponse {
            lease_ttl_ms: out.lease.as_millis() as u64,
            replaced_engine_ids: out.replaced,
        }))
    }

    async fn query(
        &self,
        _req: Request<pb::QueryRequest>,
    ) -> Result<Response<pb::QueryResponse>, Status> {
        Ok(Response::new(to_pb(
            &self.state.query().await.map_err(unavailable)?,
        )))
    }

    async fn deregister(
        &self,
        req: Request<pb::DeregisterRequest>,
    ) -> Result<Response<pb::DeregisterResponse>, Status> {
        let r = req.into_inner();
        if r.engine_id.is_empty() {
            return Err(Status::invalid_argument("engine_id is empty"));
        }
        let ranks = (!r.all).then_some((r.dp_rank, r.tp_rank, r.pp_rank));
        let removed = self
            .state
            .deregister(&r.engine_id, ranks)
            .await
            .map_err(unavailable)? as u32;
        Ok(Response::new(pb::DeregisterResponse { removed }))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        _req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let state = self.state.clone();
        let mut changes = state.subscribe();
        let mut stop = self.stop.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            changes.mark_changed();
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tx.closed() => return,
                    r = changes.changed() => if r.is_err() { return },
                }
                changes.mark_unchanged();
                let msg = state.query().await.map(|t| to_pb(&t)).map_err(unavailable);
                if tx.send(msg).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
