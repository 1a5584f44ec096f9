//! A real OTLP trace receiver, in process, for the tracing tests: the collector's gRPC
//! `TraceService/Export` and the HTTP `POST /v1/traces` (protobuf body), each on a loopback
//! ephemeral port. Every span received is kept with the `service.name` of its resource and the
//! protocol it came by, so tests can check the parent/child chain across processes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

/// One span as received.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    /// `service.name` of the span's resource.
    pub service: String,
    pub name: String,
    /// Lower-case hex, as in a `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// OTLP span kind (1 internal, 2 server, 3 client).
    pub kind: i32,
    pub attributes: Vec<(String, String)>,
    /// `grpc` or `http`.
    pub via: &'static str,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

impl std::fmt::Display for SpanRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{}] {:?} span={} parent={} kind={} via={}",
            self.service,
            self.name,
            self.span_id,
            if self.parent_span_id.is_empty() {
                "-"
            } else {
                &self.parent_span_id
            },
            self.kind,
            self.via
        )
    }
}

type Spans = Arc<Mutex<Vec<SpanRecord>>>;

/// The receiver; stops when dropped.
pub struct Collector {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    spans: Spans,
    rt: Option<tokio::runtime::Runtime>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value_text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn record(spans: &Spans, req: ExportTraceServiceRequest, via: &'static str) {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
            .map(|kv| value_text(&kv.value))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(SpanRecord {
                    service: service.clone(),
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value_text(&kv.value)))
                        .collect(),
                    via,
                });
            }
        }
    }
    spans.lock().expect("spans").extend(out);
}

struct GrpcSink(Spans);

#[tonic::async_trait]
impl TraceService for GrpcSink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        record(&self.0, req.into_inner(), "grpc");
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn http_export(
    req: Request<Incoming>,
    spans: Spans,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = |status: StatusCode, body: Vec<u8>| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            "content-type",
            hyper::header::HeaderValue::from_static("application/x-protobuf"),
        );
        Ok(r)
    };
    if req.method() != hyper::Method::POST || req.uri().path() != "/v1/traces" {
        return answer(StatusCode::NOT_FOUND, Vec::new());
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return answer(StatusCode::BAD_REQUEST, Vec::new()),
    };
    match ExportTraceServiceRequest::decode(body) {
        Ok(r) => {
            record(&spans, r, "http");
            answer(
                StatusCode::OK,
                ExportTraceServiceResponse::default().encode_to_vec(),
            )
        }
        Err(_) => answer(StatusCode::BAD_REQUEST, Vec::new()),
    }
}

impl Collector {
    /// Starts both receivers on 127.0.0.1 ephemeral ports.
    pub fn start() -> Collector {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("collector runtime");
        let spans: Spans = Arc::default();
        let (grpc, http) = rt.block_on(async {
            let g = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind grpc");
            let h = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind http");
            (g, h)
        });
        let (grpc_addr, http_addr) = (
            grpc.local_addr().expect("grpc addr"),
            http.local_addr().expect("http addr"),
        );
        let sink = GrpcSink(spans.clone());
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(sink))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(grpc)),
        );
        let s = spans.clone();
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = http.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| http_export(req, s.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Collector {
            grpc: grpc_addr,
            http: http_addr,
            spans,
            rt: Some(rt),
        }
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for `http/protobuf` (the exporter appends `/v1/traces`).
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.spans.lock().expect("spans").clone()
    }

    /// Polls `f` over the spans received until it returns Some, or `timeout` passes.
    pub fn wait_for<T>(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&[SpanRecord]) -> Option<T>,
    ) -> Option<T> {
        crate::wait_until(timeout, || f(&self.spans()))
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
