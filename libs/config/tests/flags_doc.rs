//! docs/FLAGS.md lists every upstream flag the services ignore or refuse, as the code does.

use lunakv_config::gflags::{Upstream, UpstreamFlag};

fn check(table: &[UpstreamFlag]) {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/FLAGS.md"))
        .expect("docs/FLAGS.md");
    for u in table {
        let kind = match u.treatment {
            Upstream::Ignored(_) => "ignored".to_string(),
            Upstream::Refused(_) => "refused".to_string(),
            Upstream::OnlyValue { value, .. } => format!("only `{value}`"),
        };
        let row = format!("| `{}` | {kind} |", u.name);
        assert!(doc.contains(&row), "docs/FLAGS.md lacks the row {row}");
    }
}

#[test]
fn the_flags_doc_matches_the_tables_in_the_code() {
    check(lunakv_config::master::UPSTREAM_KEYS);
    check(lunakv_config::store::UPSTREAM_FLAGS);
}
