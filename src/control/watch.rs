//! The watched drain file (`RAILOVER_DRAIN_FILE`): NICs named there are drained, with
//! [`Source::File`], for as long as they are named.
//!
//! The control thread reads it at start and every
//! [`DRAIN_FILE_EVERY`](super::DRAIN_FILE_EVERY). Each word of a line, up to a `#`, is a
//! NIC spec ([`super::nics`]); blank lines and comments name nothing, and a missing file
//! names nothing. What it names is compared with what this
//! watch has drained ([`plan`]): newly named NICs are drained, no longer named ones
//! undrained, undrains first (moving a drain from one NIC to another must not leave too
//! few NICs for a moment). A refused call is not recorded as done, so it is tried again
//! at the next read; each distinct refusal is logged once, and again after the file
//! changes. Names this process does not have are ignored (other processes on the node may
//! have them), with one INFO per change of the file. A file that cannot be read (not
//! merely missing) changes nothing.

use std::collections::{BTreeSet, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use super::nics::{inventory, lookup, Miss};
use super::protocol::call;
use super::{Handler, NicIdent, Request, Source};

/// Longest drain file read; a longer one is an error (it changes nothing).
pub const MAX_FILE: u64 = 64 * 1024;

/// What a drain file's text names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Named {
    /// The NICs of this process it names.
    pub nics: BTreeSet<usize>,
    /// Well-formed specs naming no NIC of this process.
    pub not_here: Vec<String>,
    /// Words that are no spec, with why.
    pub malformed: Vec<String>,
}

/// One handler call the file asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Drain(usize),
    Undrain(usize),
}

/// What `text` names among `nics`.
pub fn named(text: &str, nics: &[NicIdent]) -> Named {
    let mut out = Named::default();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        for word in line.split_whitespace() {
            match lookup(word, nics) {
                Ok(ids) => out.nics.extend(ids),
                Err(Miss::NotHere) => out.not_here.push(word.to_string()),
                Err(Miss::Malformed(why)) => out.malformed.push(format!("{word:?} ({why})")),
            }
        }
    }
    out
}

/// The calls that take the NICs drained by the file, `applied`, to what `text` names
/// (`None`: the file is missing, which names nothing): undrains, then drains, each in NIC
/// order.
pub fn plan(
    applied: &BTreeSet<usize>,
    text: Option<&str>,
    nics: &[NicIdent],
) -> (Vec<Call>, Named) {
    let named = text.map(|t| named(t, nics)).unwrap_or_default();
    let calls = applied
        .difference(&named.nics)
        .map(|&n| Call::Undrain(n))
        .chain(named.nics.difference(applied).map(|&n| Call::Drain(n)))
        .collect();
    (calls, named)
}

/// The file's state across reads.
#[derive(Debug)]
pub struct Watch {
    path: PathBuf,
    /// NICs this file has drained (the handler accepted).
    applied: BTreeSet<usize>,
    /// The content last read (`Some(None)`: missing); `None` before the first read.
    last: Option<Option<String>>,
    /// Problems already logged since the file last changed.
    logged: HashSet<String>,
}

impl Watch {
    pub fn new(path: PathBuf) -> Watch {
        Watch {
            path,
            applied: BTreeSet::new(),
            last: None,
            logged: HashSet::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The NICs the file has drained.
    pub fn applied(&self) -> &BTreeSet<usize> {
        &self.applied
    }

    /// Reads the file and applies it.
    pub fn tick(&mut self, nics: &[NicIdent], handler: &dyn Handler) {
        match read(&self.path) {
            Ok(content) => self.apply(content, nics, handler),
            Err(e) => {
                if self.logged.insert(format!("read: {e}")) {
                    tracing::warn!(
                        "railover: cannot read the drain file {}: {e}; drains stay as they are",
                        self.path.display()
                    );
                }
            }
        }
    }

    /// Applies what was read (`None`: missing).
    pub fn apply(&mut self, content: Option<String>, nics: &[NicIdent], handler: &dyn Handler) {
        let (calls, named) = plan(&self.applied, content.as_deref(), nics);
        let changed = self.last.as_ref() != Some(&content);
        if changed {
            self.logged.clear();
            if !named.not_here.is_empty() {
                tracing::info!(
                    "railover: the drain file {} names {}, which this process does not \
                     have (it has {}); ignored",
                    self.path.display(),
                    named.not_here.join(", "),
                    inventory(nics)
                );
            }
            if !named.malformed.is_empty() {
                tracing::warn!(
                    "railover: the drain file {} holds words that name no NIC: {}; \
                     expected {} per word",
                    self.path.display(),
                    named.malformed.join(", "),
                    super::nics::SPEC_ACCEPTED
                );
            }
            self.last = Some(content);
        }
        for c in calls {
            let (request, nic, verb) = match c {
                Call::Drain(nic) => (Request::Drain { nic }, nic, "drain"),
                Call::Undrain(nic) => (Request::Undrain { nic }, nic, "undrain"),
            };
            let name = nics.get(nic).map_or("?", |n| n.name.as_str());
            match call(handler, request, Source::File) {
                Ok(_) => {
                    match c {
                        Call::Drain(n) => self.applied.insert(n),
                        Call::Undrain(n) => self.applied.remove(&n),
                    };
                    tracing::info!(
                        "railover: {verb}ed {name}, as the drain file {} asks",
                        self.path.display()
                    );
                }
                Err(e) => {
                    if self.logged.insert(format!("{verb} {nic}: {e}")) {
                        tracing::warn!(
                            "railover: the drain file {} asks to {verb} {name}, which was \
                             refused: {e} (tried again every read)",
                            self.path.display()
                        );
                    }
                }
            }
        }
    }
}

/// The file's text (bad UTF-8 replaced, so those words name nothing), `None` when it is
/// missing.
fn read(path: &Path) -> Result<Option<String>, String> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(format!("it is longer than {MAX_FILE} bytes"));
    }
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::nics::tests::node;
    use parking_lot::Mutex;
    use serde_json::Value;

    fn set(v: &[usize]) -> BTreeSet<usize> {
        v.iter().copied().collect()
    }

    #[test]
    fn lines_words_and_comments() {
        let n = node();
        let text = "# maintenance, ticket 42\n\n  eth1   # flapping\nrail:0 eth7\n#eth0\nrail:x\n";
        let got = named(text, &n);
        assert_eq!(got.nics, set(&[0, 1, 2]));
        assert_eq!(got.not_here, ["eth7"]);
        assert_eq!(got.malformed.len(), 1);
        assert!(got.malformed[0].contains("rail:x"), "{:?}", got.malformed);
    }

    #[test]
    fn the_diff_drains_what_is_new_and_undrains_what_is_gone() {
        let n = node();
        // First read.
        let (calls, _) = plan(&set(&[]), Some("eth1\nmlx5_0\n"), &n);
        assert_eq!(calls, [Call::Drain(1), Call::Drain(2), Call::Drain(3)]);
        // Unchanged: nothing to do.
        let (calls, _) = plan(&set(&[1, 2, 3]), Some("eth1\nmlx5_0\n"), &n);
        assert!(calls.is_empty());
        // Moved from eth1 to eth0: the undrain comes first.
        let (calls, _) = plan(&set(&[1]), Some("eth0"), &n);
        assert_eq!(calls, [Call::Undrain(1), Call::Drain(0)]);
        // Missing and empty files name nothing.
        let (calls, _) = plan(&set(&[0, 4]), None, &n);
        assert_eq!(calls, [Call::Undrain(0), Call::Undrain(4)]);
        let (calls, named) = plan(&set(&[4]), Some("# nothing\n"), &n);
        assert_eq!(calls, [Call::Undrain(4)]);
        assert_eq!(named, Named::default());
        // Other processes' NICs change nothing here.
        let (calls, named) = plan(&set(&[]), Some("eth5 0000:99:00.0 rail:7"), &n);
        assert!(calls.is_empty());
        assert_eq!(named.not_here.len(), 3);
    }

    struct Fake {
        calls: Mutex<Vec<Request>>,
        refuse: Mutex<Option<usize>>,
    }

    impl Handler for Fake {
        fn handle(&self, request: Request, source: Source) -> Result<Value, String> {
            assert_eq!(source, Source::File);
            self.calls.lock().push(request.clone());
            match request {
                Request::Drain { nic } if Some(nic) == *self.refuse.lock() => Err("not now".into()),
                _ => Ok(Value::Null),
            }
        }
    }

    #[test]
    fn a_refused_drain_is_tried_again_at_every_read_until_accepted() {
        let n = node();
        let h = Fake {
            calls: Mutex::new(Vec::new()),
            refuse: Mutex::new(Some(1)),
        };
        let mut w = Watch::new("/nonexistent/drain".into());
        w.apply(Some("eth0 eth1".into()), &n, &h);
        assert_eq!(w.applied(), &set(&[0]));
        w.apply(Some("eth0 eth1".into()), &n, &h);
        assert_eq!(
            *h.calls.lock(),
            [
                Request::Drain { nic: 0 },
                Request::Drain { nic: 1 },
                Request::Drain { nic: 1 },
            ]
        );
        *h.refuse.lock() = None;
        w.apply(Some("eth0 eth1".into()), &n, &h);
        assert_eq!(w.applied(), &set(&[0, 1]));
        h.calls.lock().clear();
        w.apply(None, &n, &h);
        assert_eq!(
            *h.calls.lock(),
            [Request::Undrain { nic: 0 }, Request::Undrain { nic: 1 }]
        );
        assert!(w.applied().is_empty());
    }

    #[test]
    fn reads_missing_as_none_and_refuses_a_huge_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("drain");
        assert_eq!(read(&p), Ok(None));
        std::fs::write(&p, b"eth1\xff\n").unwrap();
        assert_eq!(read(&p), Ok(Some("eth1\u{fffd}\n".into())));
        std::fs::write(&p, vec![b'#'; MAX_FILE as usize + 1]).unwrap();
        assert!(read(&p).unwrap_err().contains("longer than"));
        // A directory is not a missing file: it is an error, and changes nothing.
        assert!(read(dir.path()).is_err());
    }

    #[test]
    fn an_unreadable_file_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let n = node();
        let h = Fake {
            calls: Mutex::new(Vec::new()),
            refuse: Mutex::new(None),
        };
        let p = dir.path().join("drain");
        std::fs::write(&p, "eth0\n").unwrap();
        let mut w = Watch::new(p.clone());
        w.tick(&n, &h);
        assert_eq!(w.applied(), &set(&[0]));
        // Now the path is a directory: unreadable, so eth0 stays drained.
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        w.tick(&n, &h);
        assert_eq!(w.applied(), &set(&[0]));
        assert_eq!(h.calls.lock().len(), 1);
    }
}
