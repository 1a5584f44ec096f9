//! `put`, `get`, `exists`, `rm`: one object at a time through [`StoreClient`], the same client
//! library engines use, as a pure requester (standalone-store mode: it contributes no memory).

use std::io::{Read, Write};
use std::process::ExitCode;

use anyhow::Context;
use lunakv_client::{ClientOptions, StoreClient};
use lunakv_proto::ErrorCode;
use serde_json::json;

use crate::error::Coded;
use crate::output::{base64, print_json};
use crate::target::Target;

pub(crate) fn connect(t: &Target) -> anyhow::Result<StoreClient> {
    let client = StoreClient::connect(ClientOptions {
        master_server_address: t.master.clone(),
        global_segment_size: 0,
        enable_shm: t.enable_shm,
        ..ClientOptions::default()
    })?;
    Ok(client)
}

/// Reads FILE, or stdin for `-`.
fn read_input(file: &str) -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    if file == "-" {
        std::io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .map_err(|e| Coded::new(ErrorCode::InvalidParams, format!("cannot read stdin: {e}")))?;
    } else {
        buf = std::fs::read(file).map_err(|e| {
            Coded::new(ErrorCode::InvalidParams, format!("cannot read {file}: {e}"))
        })?;
    }
    Ok(buf)
}

pub fn put(t: &Target, key: &str, file: &str, json: bool) -> anyhow::Result<ExitCode> {
    let value = read_input(file)?;
    let client = connect(t)?;
    client.put(key, &value)?;
    client.close()?;
    if json {
        print_json(&json!({"ok": true, "key": key, "size": value.len()}))?;
    } else {
        println!("stored '{key}' ({} bytes)", value.len());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn get(t: &Target, key: &str, file: Option<&str>, json: bool) -> anyhow::Result<ExitCode> {
    let client = connect(t)?;
    let value = client.get(key)?;
    client.close()?;
    match file {
        Some(path) if path != "-" => {
            std::fs::write(path, &value).map_err(|e| {
                Coded::new(
                    ErrorCode::InvalidParams,
                    format!("cannot write {path}: {e}"),
                )
            })?;
            if json {
                print_json(&json!({"ok": true, "key": key, "size": value.len(), "file": path}))?;
            } else {
                eprintln!("wrote '{key}' ({} bytes) to {path}", value.len());
            }
        }
        _ if json => {
            // stdout carries the JSON object, so the value goes inside it: always as base64,
            // and also as text when it is valid UTF-8 (the common case for hand-made values).
            let mut obj = json!({"ok": true, "key": key, "size": value.len(), "value_base64": base64(&value)});
            if let Ok(text) = std::str::from_utf8(&value) {
                obj["value"] = json!(text);
            }
            print_json(&obj)?;
        }
        _ => {
            let mut out = std::io::stdout().lock();
            match out.write_all(&value).and_then(|()| out.flush()) {
                // `lunakv get k | head -c 10` is not an error.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                r => r.context("cannot write to stdout")?,
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn exists(t: &Target, key: &str, json: bool) -> anyhow::Result<ExitCode> {
    let client = connect(t)?;
    let present = client.exists(key)?;
    client.close()?;
    if json {
        print_json(&json!({"ok": true, "key": key, "exists": present}))?;
    } else {
        println!("{}", if present { "yes" } else { "no" });
    }
    Ok(if present {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn rm(t: &Target, key: &str, force: bool, json: bool) -> anyhow::Result<ExitCode> {
    let client = connect(t)?;
    match client.remove(key, force) {
        // Any get or exists (this CLI's too) leases the object for a few seconds.
        Err(e) if e.code() == ErrorCode::ObjectHasLease => {
            return Err(Coded::new(
                ErrorCode::ObjectHasLease,
                format!("{e}; `lunakv rm {key} --force` removes it now"),
            )
            .into());
        }
        r => r?,
    }
    client.close()?;
    if json {
        print_json(&json!({"ok": true, "key": key, "removed": true}))?;
    } else {
        println!("removed '{key}'");
    }
    Ok(ExitCode::SUCCESS)
}
