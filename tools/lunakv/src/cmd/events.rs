//! `lunakv events`: subscribe to a master's KV events and print them decoded (docs/EVENTS.md),
//! for operators debugging what a router is told.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};

use crate::args::EventsArgs;
use crate::target;

/// A msgpack value as JSON: bytes as a hex string (vLLM's block hashes), map keys as text.
pub fn to_json(v: &rmpv::Value) -> serde_json::Value {
    use rmpv::Value as V;
    use serde_json::Value as J;
    match v {
        V::Nil => J::Null,
        V::Boolean(b) => J::Bool(*b),
        V::Integer(i) => i
            .as_u64()
            .map(J::from)
            .or_else(|| i.as_i64().map(J::from))
            .unwrap_or(J::Null),
        V::F32(f) => J::from(f64::from(*f)),
        V::F64(f) => J::from(*f),
        V::String(s) => J::String(s.as_str().map_or_else(
            || String::from_utf8_lossy(s.as_bytes()).into_owned(),
            str::to_owned,
        )),
        V::Binary(b) => J::String(b.iter().map(|x| format!("{x:02x}")).collect()),
        V::Array(a) => J::Array(a.iter().map(to_json).collect()),
        V::Map(m) => J::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match to_json(k) {
                        J::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        V::Ext(..) => J::Null,
    }
}

/// One message, decoded: the batch's timestamp in seconds and its events (every format puts
/// them second). An integer timestamp is RFC #1527's milliseconds.
pub fn decode_batch(payload: &[u8]) -> anyhow::Result<(f64, Vec<serde_json::Value>)> {
    let v = rmpv::decode::read_value(&mut &payload[..]).context("payload is not msgpack")?;
    let arr = v.as_array().context("payload is not an EventBatch array")?;
    let ts = match arr.first() {
        Some(t) if t.is_i64() || t.is_u64() => t.as_i64().unwrap_or(0) as f64 / 1000.0,
        Some(t) => t.as_f64().unwrap_or(0.0),
        None => 0.0,
    };
    let events = arr
        .get(1)
        .and_then(rmpv::Value::as_array)
        .context("EventBatch has no event list")?;
    Ok((ts, events.iter().map(to_json).collect()))
}

/// `host` of `tcp://host:port` replaced by `master_host` when it is a wildcard.
fn reachable(endpoint: &str, master_host: &str) -> String {
    for wild in ["0.0.0.0", "*", "[::]"] {
        let prefix = format!("tcp://{wild}:");
        if let Some(port) = endpoint.strip_prefix(&prefix) {
            return format!("tcp://{master_host}:{port}");
        }
    }
    endpoint.to_owned()
}

pub fn run(
    a: &EventsArgs,
    master: &Option<String>,
    config: &Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let endpoint = match &a.endpoint {
        Some(e) => e.clone(),
        None => {
            let t = target::resolve_cli(master, config)?;
            let s = crate::cmd::status::fetch_blocking(&t)?;
            if !s.kv_events_enabled {
                bail!(
                    "the master at {} does not publish KV events: start it with \
                     --enable_kv_event_publish=true (docs/EVENTS.md)",
                    t.master
                );
            }
            let ep = if a.vllm {
                if s.kv_events_vllm_endpoint.is_empty() {
                    bail!(
                        "the master at {} has no vLLM-format stream: set \
                         --kv_events_vllm_endpoint",
                        t.master
                    );
                }
                s.kv_events_vllm_endpoint.clone()
            } else {
                s.kv_events_endpoint.clone()
            };
            let host = t.master.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            reachable(&ep, host)
        }
    };
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).context("cannot create a ZMQ socket")?;
    sub.set_subscribe(a.topic.as_bytes())?;
    sub.connect(&endpoint).with_context(|| {
        format!("cannot connect to {endpoint}: give --endpoint tcp://host:port")
    })?;
    if !json {
        eprintln!(
            "subscribed to {endpoint} (topic {:?}); Ctrl-C stops",
            a.topic
        );
    }
    let mut seen = 0u64;
    let mut last_seq: std::collections::HashMap<Vec<u8>, u64> = Default::default();
    let stdout = std::io::stdout();
    loop {
        let frames = sub.recv_multipart(0)?;
        let [topic, seq, payload] = frames.as_slice() else {
            eprintln!("skipped a message of {} frames (want 3)", frames.len());
            continue;
        };
        let seq = <[u8; 8]>::try_from(seq.as_slice()).map_or(u64::MAX, u64::from_be_bytes);
        let topic_s = String::from_utf8_lossy(topic).into_owned();
        // A jump in the sequence is lost messages (the replay endpoint has them).
        let gap = last_seq
            .insert(topic.clone(), seq)
            .filter(|prev| seq != prev.wrapping_add(1))
            .map(|prev| (prev, seq));
        let (ts, events) = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("seq {seq}: {e:#}");
                continue;
            }
        };
        let mut out = stdout.lock();
        if let Some((prev, now)) = gap {
            if json {
                let v = serde_json::json!({"gap": {"topic": topic_s, "after": prev, "at": now}});
                writeln!(out, "{v}")?;
            } else {
                writeln!(out, "-- gap on {topic_s}: {prev} then {now}")?;
            }
        }
        for ev in events {
            if json {
                let v = serde_json::json!({"topic": topic_s, "seq": seq, "ts": ts, "event": ev});
                writeln!(out, "{v}")?;
            } else {
                let (kind, rest) = event_line(&ev);
                writeln!(out, "{seq:>8} {topic_s} {kind:<16} {rest}")?;
            }
            seen += 1;
            if a.count > 0 && seen >= a.count {
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

/// An event's kind and the rest of it, for a human: the positional forms name the kind
/// first; the map forms in `type` (vLLM's tag) or `event_type` (RFC #1527).
fn event_line(ev: &serde_json::Value) -> (String, String) {
    match ev {
        serde_json::Value::Array(a) if !a.is_empty() => (
            a[0].as_str().unwrap_or("?").to_owned(),
            serde_json::Value::Array(a[1..].to_vec()).to_string(),
        ),
        serde_json::Value::Object(m) => {
            let tag = ["event_type", "type"]
                .iter()
                .find_map(|k| m.get(*k).and_then(|v| v.as_str()).map(|v| (*k, v)));
            match tag {
                Some((field, kind)) => {
                    let mut rest = m.clone();
                    rest.remove(field);
                    (kind.to_owned(), serde_json::Value::Object(rest).to_string())
                }
                None => ("?".to_owned(), ev.to_string()),
            }
        }
        other => ("?".to_owned(), other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_a_batch_with_bytes_as_hex() {
        // [1.5, [["BlockRemoved", [b"\x01\xff"], "m"]], 0]
        let mut b = vec![0x93, 0xcb];
        b.extend_from_slice(&1.5f64.to_be_bytes());
        b.extend_from_slice(&[0x91, 0x93, 0xac]);
        b.extend_from_slice(b"BlockRemoved");
        b.extend_from_slice(&[0x91, 0xc4, 0x02, 0x01, 0xff, 0xa1, b'm', 0x00]);
        let (ts, events) = decode_batch(&b).expect("decodes");
        assert_eq!(ts, 1.5);
        assert_eq!(
            events,
            vec![serde_json::json!(["BlockRemoved", ["01ff"], "m"])]
        );
        assert!(decode_batch(&[0xc1]).is_err(), "not msgpack");
    }

    #[test]
    fn decodes_an_rfc1527_batch_with_its_ms_timestamp_and_names_map_events() {
        // [1500, [{"event_type": "stored", "object_key": "k"}], 0]
        let mut b = vec![0x93, 0xcd, 0x05, 0xdc, 0x91, 0x82, 0xaa];
        b.extend_from_slice(b"event_type");
        b.extend_from_slice(&[0xa6]);
        b.extend_from_slice(b"stored");
        b.extend_from_slice(&[0xaa]);
        b.extend_from_slice(b"object_key");
        b.extend_from_slice(&[0xa1, b'k', 0x00]);
        let (ts, events) = decode_batch(&b).expect("decodes");
        assert_eq!(ts, 1.5, "milliseconds become seconds");
        let (kind, rest) = event_line(&events[0]);
        assert_eq!(kind, "stored");
        assert_eq!(rest, r#"{"object_key":"k"}"#);
        let (kind, _) = event_line(&serde_json::json!({"type": "BlockStored"}));
        assert_eq!(kind, "BlockStored", "vLLM's tagged events");
    }

    #[test]
    fn wildcard_endpoints_point_at_the_master_host() {
        assert_eq!(
            reachable("tcp://0.0.0.0:19997", "10.0.0.3"),
            "tcp://10.0.0.3:19997"
        );
        assert_eq!(
            reachable("tcp://127.0.0.1:19997", "x"),
            "tcp://127.0.0.1:19997"
        );
    }
}
