//! docs/ENV.md lists every `LUNAKV_*` variable the sources read, and its master-key table is
//! the one the code declares.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use lunakv_config::master::{ALIASES, ENV_PREFIX, KEYS, MasterConfig, UPSTREAM_KEYS};

/// Names the sources spell that are not variables lunakv reads: a test's example of an
/// unrelated variable under the master's prefix.
const NOT_VARIABLES: &[&str] = &["LUNAKV_MASTER_ADDR"];

const BEGIN: &str = "<!-- master keys: begin -->";
const END: &str = "<!-- master keys: end -->";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every text file under `dir`, documentation and build outputs left out.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if path.is_dir() {
            if !matches!(
                name.as_str(),
                "target" | ".venv" | "__pycache__" | "node_modules" | ".git"
            ) {
                sources(&path, out);
            }
        } else if !name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// `LUNAKV_[A-Z0-9_]+` in `text`, each starting at a word boundary.
fn names_in(text: &str, into: &mut BTreeSet<String>) {
    let bytes = text.as_bytes();
    for (i, _) in text.match_indices("LUNAKV_") {
        if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
            continue;
        }
        let end = text[i..]
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .map_or(text.len(), |n| i + n);
        into.insert(text[i..end].to_string());
    }
}

fn env_md() -> String {
    std::fs::read_to_string(root().join("docs/ENV.md")).expect("docs/ENV.md")
}

/// The variables of the table's rows (the master-key table below it is checked apart).
fn listed(doc: &str) -> BTreeSet<String> {
    doc[..doc.find(BEGIN).unwrap_or(doc.len())]
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        // `LUNAKV_MASTER_<KEY>` stands for the key table.
        .filter(|n| n.starts_with("LUNAKV_") && !n.contains('<'))
        .map(str::to_string)
        .collect()
}

fn is_master_key(name: &str) -> bool {
    name.strip_prefix(ENV_PREFIX).is_some_and(|k| {
        let k = k.to_ascii_lowercase();
        KEYS.iter().any(|key| key.name == k)
            || UPSTREAM_KEYS.iter().any(|u| u.name == k)
            || ALIASES.iter().any(|(alias, _)| *alias == k)
    })
}

#[test]
fn every_variable_the_sources_read_is_in_the_table_and_no_other() {
    let root = root();
    let mut files = Vec::new();
    for dir in ["libs", "services", "tools", "bindings", "deploy"] {
        sources(&root.join(dir), &mut files);
    }
    files.extend(["compose.yaml", "Makefile"].map(|f| root.join(f)));
    let mut found = BTreeSet::new();
    for f in &files {
        if let Ok(text) = std::fs::read_to_string(f) {
            names_in(&text, &mut found);
        }
    }
    let doc = env_md();
    let table = listed(&doc);
    let missing: Vec<&String> = found
        .iter()
        .filter(|n| !table.contains(*n))
        .filter(|n| !NOT_VARIABLES.contains(&n.as_str()))
        .filter(|n| !(n.starts_with(ENV_PREFIX) && is_master_key(n)))
        // A prefix the code matches on (`LUNAKV_TLS_`, `LUNAKV_ETCD`), not a variable.
        .filter(|n| {
            !table
                .iter()
                .any(|t| t.len() > n.len() && t.starts_with(n.as_str()))
                && !ENV_PREFIX.starts_with(n.as_str())
        })
        .collect();
    assert!(
        missing.is_empty(),
        "read in the sources but not in docs/ENV.md (add a row): {missing:?}"
    );
    let stale: Vec<&String> = table.iter().filter(|n| !found.contains(*n)).collect();
    assert!(
        stale.is_empty(),
        "in docs/ENV.md but read nowhere any more (remove the row): {stale:?}"
    );
}

#[test]
fn the_master_key_table_is_the_codes() {
    let mut expected = String::from("| Variable | `--help` |\n|---|---|\n");
    for key in KEYS {
        let default = MasterConfig::default_text(key.name).unwrap_or_default();
        expected.push_str(&format!(
            "| `{ENV_PREFIX}{}` | {} |\n",
            key.name.to_ascii_uppercase(),
            key.help_with(&default).replace('|', "\\|")
        ));
    }
    let doc = env_md();
    let start = doc.find(BEGIN).expect("begin marker") + BEGIN.len() + 1;
    let end = doc.find(END).expect("end marker");
    assert!(
        doc[start..end] == expected,
        "docs/ENV.md's master-key table differs from the code; put this between the markers:\n{expected}"
    );
}
