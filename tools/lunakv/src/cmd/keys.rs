//! `lunakv keys [--prefix P] [--limit N]`: the pool's keys (the default tenant's), from the
//! master's admin port (upstream's `GET /get_all_keys`, streamed one index shard at a time), in
//! the order the index holds them. `--limit` bounds what is printed (default 1000, 0: all);
//! the count is always of every matching key.

use std::process::ExitCode;

use crate::args::KeysArgs;
use crate::cmd::admin::{Admin, admin_base};
use crate::output::print_json;

pub fn run(a: &KeysArgs, master: &str, json: bool) -> anyhow::Result<ExitCode> {
    let admin = Admin::new(admin_base(a.admin.as_deref(), master)?)?;
    let listing = admin.text("/get_all_keys")?;
    let prefix = a.prefix.as_deref().unwrap_or("");
    let matching: Vec<&str> = listing
        .lines()
        .filter(|k| !k.is_empty() && k.starts_with(prefix))
        .collect();
    let shown = if a.limit == 0 {
        matching.len()
    } else {
        a.limit.min(matching.len())
    };
    if json {
        print_json(&serde_json::json!({
            "ok": true,
            "count": matching.len(),
            "keys": &matching[..shown],
            "truncated": shown < matching.len(),
        }))?;
    } else {
        for k in &matching[..shown] {
            println!("{k}");
        }
        if shown < matching.len() {
            eprintln!(
                "{} of {} keys shown: --limit 0 prints all, --prefix narrows them",
                shown,
                matching.len()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
