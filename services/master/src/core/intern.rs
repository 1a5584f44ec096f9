//! Shared copies of the strings that repeat across objects: client ids and segment names.
//!
//! A million objects from a handful of clients on a handful of segments would otherwise hold a
//! million heap copies of each name (about 100 bytes per object, docs/BENCH.md, "Metadata").

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;

/// Names handed out as `Arc<str>`; a name no object holds any more is dropped by [`Self::trim`].
#[derive(Default)]
pub(super) struct Interner {
    // Looked up twice per put (its client id and segment name): foldhash, as the index.
    names: Mutex<HashSet<Arc<str>, foldhash::quality::RandomState>>,
}

impl Interner {
    /// The shared copy of `name` (a leaf lock).
    pub(super) fn get(&self, name: &str) -> Arc<str> {
        let mut names = self.names.lock();
        if let Some(n) = names.get(name) {
            return n.clone();
        }
        let n: Arc<str> = Arc::from(name);
        names.insert(n.clone());
        n
    }

    /// Forgets the names only this table still holds, so ids that outside peers made up do not
    /// pile up here after their objects are gone.
    pub(super) fn trim(&self) {
        self.names.lock().retain(|n| Arc::strong_count(n) > 1);
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.names.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_copy_per_name_until_nobody_holds_it() {
        let i = Interner::default();
        let a = i.get("client-a");
        let b = i.get("client-a");
        assert!(Arc::ptr_eq(&a, &b), "the same copy");
        let c = i.get("client-c");
        assert_eq!(i.len(), 2);
        drop(c);
        i.trim();
        assert_eq!(i.len(), 1, "client-c is no longer held");
        drop((a, b));
        i.trim();
        assert_eq!(i.len(), 0);
    }
}
