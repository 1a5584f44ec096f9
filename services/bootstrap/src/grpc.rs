//! The gRPC API (`lunakv.bootstrap.v1.Bootstrap`) over the same table as the HTTP API.

use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::sync::Arc;

use lunakv_proto::bootstrap as pb;
use lunakv_proto::bootstrap::bootstrap_server::{Bootstrap, BootstrapServer};
use lunakv_proto::status::GrpcError;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use crate::api::Api;
use crate::state::{RegisterError, StateError, Table, Worker};

/// The tonic service.
pub struct BootstrapService {
    api: Arc<Api>,
    stop: watch::Receiver<bool>,
}

/// Builds the server half for `tonic::transport::Server::add_service`.
pub(crate) fn server(
    api: Arc<Api>,
    stop: watch::Receiver<bool>,
) -> BootstrapServer<BootstrapService> {
    BootstrapServer::new(BootstrapService { api, stop })
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
    lunakv_proto::status::to_status(&e)
}

impl GrpcError for RegisterError {
    fn code(&self) -> Code {
        match self {
            RegisterError::Invalid(_) | RegisterError::LeaseOutOfRange { .. } => {
                Code::InvalidArgument
            }
            RegisterError::TableFull { .. } | RegisterError::PeerFull { .. } => {
                Code::ResourceExhausted
            }
            RegisterError::Unavailable(_) => Code::Unavailable,
            _ => Code::AlreadyExists,
        }
    }
}

impl GrpcError for StateError {
    fn code(&self) -> Code {
        Code::Unavailable
    }
}

fn unavailable(e: StateError) -> Status {
    lunakv_proto::status::to_status(&e)
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::QueryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Bootstrap for BootstrapService {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        // Served over lunakv_tls::grpc::incoming, so the peer is always known; without it the
        // registration counts under `::` and is never probed (no addr is on that host).
        let peer = req
            .extensions()
            .get::<lunakv_tls::Peer>()
            .map_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED), |p| p.addr.ip());
        let r = req.into_inner();
        let w = r
            .worker
            .ok_or_else(|| Status::invalid_argument("worker is missing"))?;
        let out = self
            .api
            .register(
                Worker {
                    engine_id: w.engine_id,
                    dp_rank: w.dp_rank,
                    tp_rank: w.tp_rank,
                    pp_rank: w.pp_rank,
                    addr: w.addr,
                },
                Some(r.lease_ttl_ms),
                peer,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(pb::RegisterResponse {
            lease_ttl_ms: u64::try_from(out.lease.as_millis()).unwrap_or(u64::MAX),
            replaced_engine_ids: out.replaced,
        }))
    }

    async fn query(
        &self,
        _req: Request<pb::QueryRequest>,
    ) -> Result<Response<pb::QueryResponse>, Status> {
        Ok(Response::new(to_pb(
            &self.api.state.query().await.map_err(unavailable)?,
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
            .api
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
        let state = self.api.state.clone();
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
