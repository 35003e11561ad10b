//! The control plane: what lets an operator drain a NIC, undrain it and see a process's
//! state while the job runs (`railover drain|undrain|status`, `docs/control.md`).
//!
//! Each process opens a Unix socket, `<dir>/<pid>.sock` (mode 0600, in a directory of
//! mode 0700 that this uid owns, [`dir`]), served by one joinable thread `rlvr-control`
//! ([`Control`], `server.rs`) the way the metrics endpoint is served: `mio`, non-blocking
//! connections with a deadline and a cap, so a slow or silent client holds up no one. A
//! connection carries one request line and gets one JSON answer line ([`protocol`]). Only
//! this process's own uid and root are served (`SO_PEERCRED`). The same thread watches an
//! optional drain file ([`watch`]) for orchestrators that cannot reach the socket (a
//! Kubernetes DaemonSet in another network namespace can still share a hostPath file).
//!
//! What a request does to the process is not decided here: the plugin implements
//! [`Handler`] by asking its reactor. So this module imports only `config` (the variables'
//! errors), and nothing above it: `tests/layers.rs` places it just below `plugin`.

pub mod dir;
pub mod nics;
pub mod protocol;
mod server;
pub mod watch;

use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use mio::Waker;
use nix::sys::socket::{getsockopt, sockopt};

use crate::config::{ConfigError, EnvReader};

pub use dir::default_dir;
pub use nics::resolve;

/// The control directory variable: a directory, or `off`.
pub const DIR_VAR: &str = "RAILOVER_CONTROL_DIR";
/// The watched drain file variable: a path; unset, no file is watched.
pub const DRAIN_FILE_VAR: &str = "RAILOVER_DRAIN_FILE";
/// Where the default directory goes when it is set to an absolute path.
pub const XDG_VAR: &str = "XDG_RUNTIME_DIR";
/// A control socket's file name is the process id and this suffix.
pub const SOCKET_SUFFIX: &str = ".sock";
/// Longest request line, without its line end.
pub const MAX_REQUEST: usize = 1024;
/// Connections open at once; a new one past this closes the one that has waited longest
/// for its request.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a connection may take from accept to the end of its answer.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(2);
/// How often the drain file is read.
pub const DRAIN_FILE_EVERY: Duration = Duration::from_secs(1);

/// Longest directory a socket path fits under: `sun_path` holds 108 bytes with its NUL,
/// and the name is at most 10 digits of pid and [`SOCKET_SUFFIX`].
pub const MAX_DIR_LEN: usize = 107 - 1 - 10 - SOCKET_SUFFIX.len();

const DIR_ACCEPTED: &str =
    "off, or an absolute directory path of at most 91 bytes (created with mode 0700 if missing)";
const DRAIN_FILE_ACCEPTED: &str =
    "an absolute path of a file (it need not exist yet; a missing file drains nothing)";

/// What an operator asks of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Status,
    Drain { nic: usize },
    Undrain { nic: usize },
}

/// Where a drain came from: the socket and the watched file each keep their own set; a
/// NIC is drained while either names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Socket,
    File,
}

/// The process side: the plugin implements it by asking the reactor. `Ok(value)` is put
/// in the answer's `"result"`; `Err(text)` is a refusal.
///
/// Called on the control thread, one call at a time; while a call runs that thread serves
/// nothing else (no other client, no drain-file read), so a call should wait on the
/// reactor for a bounded time. A panic in it is caught and answered as a refusal.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: Request, source: Source) -> Result<serde_json::Value, String>;
}

/// How a local NIC can be named by an operator.
#[derive(Debug, Clone)]
pub struct NicIdent {
    /// The interface or device name (`eth1`; a verbs port is `mlx5_0:1`).
    pub name: String,
    /// The PCI device: an address or a sysfs path, whose last component is the address.
    pub pci: Option<String>,
    pub rail: Option<u32>,
}

/// `RAILOVER_CONTROL_DIR` (a directory, or `off`) and `RAILOVER_DRAIN_FILE` (a path;
/// unset = no file), parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlConfig {
    /// Where the socket goes; `None` when `RAILOVER_CONTROL_DIR=off`.
    pub dir: Option<PathBuf>,
    pub drain_file: Option<PathBuf>,
}

impl ControlConfig {
    /// Reads the process environment. A value that is not UTF-8 is an error, not unset.
    /// When this process's uid cannot be told, the default directory cannot be chosen
    /// safely: the socket is then off, with a WARN.
    pub fn from_env() -> Result<ControlConfig, ConfigError> {
        let uid = match effective_uid() {
            Ok(uid) => Some(uid),
            Err(e) => {
                tracing::warn!(
                    "railover: control socket off: cannot tell this process's uid ({e})"
                );
                None
            }
        };
        let env = EnvReader::default();
        // XDG_RUNTIME_DIR is not ours to judge: a value that is not UTF-8 is ignored, as
        // the XDG spec says of a relative one, rather than failing NCCL's init.
        let lookup = |k| match k {
            XDG_VAR => std::env::var(k).ok(),
            _ => env.get(k),
        };
        let parsed = Self::from_lookup(lookup, uid.unwrap_or(u32::MAX));
        let mut parsed = env.finish(parsed)?;
        if uid.is_none() {
            parsed.dir = None;
        }
        Ok(parsed)
    }

    /// Parses from any key lookup (tests pass a map), for a process whose effective uid
    /// is `euid`: that and `XDG_RUNTIME_DIR` choose the default directory
    /// ([`default_dir`]).
    pub fn from_lookup(
        get: impl Fn(&'static str) -> Option<String>,
        euid: u32,
    ) -> Result<ControlConfig, ConfigError> {
        let dir = match get(DIR_VAR) {
            Some(v) if v.eq_ignore_ascii_case("off") => None,
            Some(v) => {
                let p = PathBuf::from(&v);
                if !p.is_absolute() || v.len() > MAX_DIR_LEN || v.contains('\0') {
                    return Err(ConfigError {
                        var: DIR_VAR,
                        value: v,
                        accepted: DIR_ACCEPTED,
                    });
                }
                Some(p)
            }
            None => Some(default_dir(get(XDG_VAR).as_deref(), euid)),
        };
        let drain_file = match get(DRAIN_FILE_VAR) {
            None => None,
            Some(v) => {
                let p = PathBuf::from(&v);
                if !p.is_absolute() || v.ends_with('/') || v.contains('\0') {
                    return Err(ConfigError {
                        var: DRAIN_FILE_VAR,
                        value: v,
                        accepted: DRAIN_FILE_ACCEPTED,
                    });
                }
                Some(p)
            }
        };
        Ok(ControlConfig { dir, drain_file })
    }
}

impl std::fmt::Display for ControlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.dir {
            None => write!(f, "control=off")?,
            Some(d) => write!(f, "control={}", d.display())?,
        }
        if let Some(p) = &self.drain_file {
            write!(f, " drain_file={}", p.display())?;
        }
        Ok(())
    }
}

/// The file name of process `pid`'s socket.
pub fn socket_name(pid: u32) -> String {
    format!("{pid}{SOCKET_SUFFIX}")
}

/// The pid a control socket's file name carries (`1234.sock`), or `None` for any other
/// name.
pub fn parse_socket_name(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(SOCKET_SUFFIX)?;
    crate::config::strict_u64(digits)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n > 0)
}

/// Who is at the other end of a Unix socket, as the kernel says (`SO_PEERCRED`): for a
/// connected client, the process that listened; for an accepted connection, the client.
/// The pid is as seen from this process's pid namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub pid: i32,
    pub uid: u32,
}

/// The credentials of `socket`'s peer.
pub fn peer(socket: &impl AsFd) -> io::Result<Peer> {
    let cred = getsockopt(socket, sockopt::PeerCredentials)?;
    Ok(Peer {
        pid: cred.pid(),
        uid: cred.uid(),
    })
}

/// This process's effective uid. Read through a socket pair's peer credentials, which the
/// kernel fills with the creating process's effective uid: nothing to parse, no `unsafe`.
pub fn effective_uid() -> io::Result<u32> {
    let (a, _b) = std::os::unix::net::UnixStream::pair()?;
    Ok(peer(&a)?.uid)
}

/// The running control plane: its thread (if any), what wakes it, its socket.
#[derive(Debug)]
pub struct Control {
    /// The process that started it: a child forked since has neither the thread nor any
    /// claim on the socket.
    owner: u32,
    socket: Option<PathBuf>,
    stop: Arc<AtomicBool>,
    waker: Option<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Control {
    /// Starts the server thread. A socket that cannot be created is not an error: one
    /// WARN saying why and where, and the process runs on (the file watch still runs).
    /// With neither a socket nor a drain file no thread is started.
    pub fn start(
        config: &ControlConfig,
        nics: Vec<NicIdent>,
        handler: Arc<dyn Handler>,
    ) -> Control {
        server::start(config, nics, handler)
    }

    /// The socket's path, while it is served.
    pub fn socket_path(&self) -> Option<&Path> {
        self.socket.as_deref()
    }

    /// Wakes and joins the thread and removes the socket file. Idempotent; also on Drop.
    pub fn shutdown(&mut self) {
        if std::process::id() != self.owner {
            // A forked child: the thread is not there to join, and the socket is the
            // parent's. Leave both alone (the handle is forgotten, not detached).
            std::mem::forget(self.thread.take());
            self.waker = None;
            self.socket = None;
            return;
        }
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = &self.waker {
            if let Err(e) = w.wake() {
                // Cannot happen with a live eventfd; the thread still sees `stop` within
                // its idle wake-up, so the join below ends.
                tracing::warn!("railover: waking the control thread failed: {e}");
            }
        }
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("railover: the control thread panicked");
            }
        }
        // Only now: closing the waker's eventfd takes it out of the thread's epoll set
        // with its wake-up unread, and the thread would sleep out its idle timeout.
        self.waker = None;
        if let Some(path) = self.socket.take() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(
                    "railover: cannot remove the control socket {}: {e}",
                    path.display()
                ),
            }
        }
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)], euid: u32) -> Result<ControlConfig, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ControlConfig::from_lookup(|k| map.get(k).cloned(), euid)
    }

    #[test]
    fn default_directory_follows_xdg_then_root_then_tmp() {
        let c = cfg(&[], 1000).unwrap();
        assert_eq!(c.dir, Some(PathBuf::from("/tmp/railover-1000")));
        assert_eq!(c.drain_file, None);
        let c = cfg(&[], 0).unwrap();
        assert_eq!(c.dir, Some(PathBuf::from("/run/railover")));
        let c = cfg(&[("XDG_RUNTIME_DIR", "/run/user/1000")], 1000).unwrap();
        assert_eq!(c.dir, Some(PathBuf::from("/run/user/1000/railover")));
        let c = cfg(&[("XDG_RUNTIME_DIR", "/run/user/0")], 0).unwrap();
        assert_eq!(c.dir, Some(PathBuf::from("/run/user/0/railover")));
        // The XDG spec: a relative or empty value is to be ignored.
        for bad in ["", "run/user/7"] {
            let c = cfg(&[("XDG_RUNTIME_DIR", bad)], 7).unwrap();
            assert_eq!(c.dir, Some(PathBuf::from("/tmp/railover-7")), "{bad:?}");
        }
        // The variable wins over every default.
        let c = cfg(
            &[
                ("RAILOVER_CONTROL_DIR", "/var/run/rv"),
                ("XDG_RUNTIME_DIR", "/run/user/0"),
            ],
            0,
        )
        .unwrap();
        assert_eq!(c.dir, Some(PathBuf::from("/var/run/rv")));
    }

    #[test]
    fn off_and_a_drain_file() {
        for off in ["off", "OFF", "Off"] {
            let c = cfg(&[("RAILOVER_CONTROL_DIR", off)], 0).unwrap();
            assert_eq!(c.dir, None);
        }
        let c = cfg(&[("RAILOVER_DRAIN_FILE", "/etc/railover/drain")], 0).unwrap();
        assert_eq!(c.drain_file, Some(PathBuf::from("/etc/railover/drain")));
        assert_eq!(
            c.to_string(),
            "control=/run/railover drain_file=/etc/railover/drain"
        );
    }

    #[test]
    fn bad_values_name_variable_value_and_accepted() {
        let long = format!("/{}", "d".repeat(MAX_DIR_LEN));
        for (var, value, says) in [
            ("RAILOVER_CONTROL_DIR", "", "absolute"),
            ("RAILOVER_CONTROL_DIR", "relative/dir", "absolute"),
            ("RAILOVER_CONTROL_DIR", " off", "absolute"),
            ("RAILOVER_CONTROL_DIR", long.as_str(), "91 bytes"),
            ("RAILOVER_DRAIN_FILE", "", "absolute"),
            ("RAILOVER_DRAIN_FILE", "drain.txt", "absolute"),
            ("RAILOVER_DRAIN_FILE", "/etc/railover/", "file"),
        ] {
            let e = cfg(&[(var, value)], 1000).unwrap_err();
            assert_eq!((e.var, e.value.as_str()), (var, value));
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("{var}=")) && msg.contains(says),
                "{msg}"
            );
        }
        assert_eq!(MAX_DIR_LEN, 91, "DIR_ACCEPTED names it");
        // Exactly the longest directory that still fits a socket path.
        let fits = format!("/{}", "d".repeat(MAX_DIR_LEN - 1));
        assert_eq!(fits.len(), MAX_DIR_LEN);
        assert!(cfg(&[("RAILOVER_CONTROL_DIR", &fits)], 0).is_ok());
        let path = Path::new(&fits).join(socket_name(u32::MAX));
        assert_eq!(path.as_os_str().len(), 107);
    }

    #[test]
    fn socket_names_carry_the_pid() {
        assert_eq!(socket_name(1234), "1234.sock");
        assert_eq!(parse_socket_name("1234.sock"), Some(1234));
        assert_eq!(parse_socket_name(&socket_name(u32::MAX)), Some(u32::MAX));
        for other in [
            "0.sock",
            ".sock",
            "12a.sock",
            "+12.sock",
            "1234.tmp",
            "1234.sock.tmp",
            "4294967296.sock",
        ] {
            assert_eq!(parse_socket_name(other), None, "{other}");
        }
    }

    #[test]
    fn the_runtime_can_keep_it_anywhere() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Control>();
    }

    #[test]
    fn own_uid_is_what_files_we_create_are_owned_by() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"").unwrap();
        let owner = std::fs::metadata(&f).unwrap().uid();
        assert_eq!(effective_uid().unwrap(), owner);
    }
}
