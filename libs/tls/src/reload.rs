//! A value loaded from files and loaded again when they change.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use parking_lot::Mutex;

use crate::{RELOAD_CHECK, TlsError};

/// What tells a changed file: its mtime, its length and its inode (a Kubernetes Secret is
/// updated by swapping a symlink, a careful writer renames a new file into place).
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamps(files: &[PathBuf]) -> Vec<Stamp> {
    files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).ok()?;
            Some((m.modified().ok()?, m.len(), m.ino()))
        })
        .collect()
}

type Loader<T> = Box<dyn Fn() -> Result<T, TlsError> + Send + Sync>;

struct State<T> {
    current: Arc<T>,
    stamps: Vec<Stamp>,
    checked: Instant,
}

/// `T` built from `files`; [`Watched::get`] looks at most once per [`RELOAD_CHECK`] whether
/// they changed and loads them again if so. A load that fails keeps the old value and logs the
/// reason once per change of the files.
pub struct Watched<T> {
    what: &'static str,
    files: Vec<PathBuf>,
    load: Loader<T>,
    state: Mutex<State<T>>,
}

impl<T> std::fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("what", &self.what)
            .field("files", &self.files)
            .finish()
    }
}

impl<T> Watched<T> {
    /// Loads now (a failure here is the caller's startup error) and watches `files`.
    /// `what` names the value in log lines ("the master's certificate").
    pub fn new(
        what: &'static str,
        files: Vec<PathBuf>,
        load: impl Fn() -> Result<T, TlsError> + Send + Sync + 'static,
    ) -> Result<Watched<T>, TlsError> {
        let stamps = stamps(&files);
        let current = Arc::new(load()?);
        Ok(Watched {
            what,
            files,
            load: Box::new(load),
            state: Mutex::new(State {
                current,
                stamps,
                checked: Instant::now(),
            }),
        })
    }

    /// The current value, loaded again first if the files changed.
    pub fn get(&self) -> Arc<T> {
        let mut st = self.state.lock();
        if st.checked.elapsed() >= RELOAD_CHECK {
            st.checked = Instant::now();
            let now = stamps(&self.files);
            if now != st.stamps {
                st.stamps = now;
                match (self.load)() {
                    Ok(v) => {
                        st.current = Arc::new(v);
                        tracing::info!(files = ?self.files, "{} reloaded: the files changed", self.what);
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "{} not reloaded, the old one stays in use: {e}",
                        self.what
                    ),
                }
            }
        }
        st.current.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn a_changed_file_is_loaded_again_and_a_broken_one_keeps_the_old_value() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("v");
        std::fs::write(&f, "1").unwrap();
        let loads = Arc::new(AtomicU32::new(0));
        let (path, n) = (f.clone(), loads.clone());
        let w = Watched::new("the value", vec![f.clone()], move || {
            n.fetch_add(1, Ordering::Relaxed);
            let s = std::fs::read_to_string(&path).unwrap();
            s.trim()
                .parse::<u32>()
                .map_err(|e| TlsError::Setup(e.to_string()))
        })
        .unwrap();
        assert_eq!(*w.get(), 1);
        let replace = |text: &str| {
            let tmp = dir.path().join(".v");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &f).unwrap();
        };
        replace("2");
        w.state.lock().checked -= RELOAD_CHECK;
        assert_eq!(*w.get(), 2);
        replace("not a number");
        w.state.lock().checked -= RELOAD_CHECK;
        assert_eq!(*w.get(), 2, "a broken file keeps the old value");
        let before = loads.load(Ordering::Relaxed);
        w.state.lock().checked -= RELOAD_CHECK;
        assert_eq!(*w.get(), 2);
        assert_eq!(
            loads.load(Ordering::Relaxed),
            before,
            "unchanged files are not reread"
        );
    }
}
