//! Where control sockets live, and how one is put there without letting another user
//! plant or swap a socket.
//!
//! The directory is this uid's, mode 0700 when railover creates it; one that exists is
//! used only when this uid owns it (or it is root's [`ROOT_DIR`]) and no other user may
//! replace files in it. The socket is bound under a temporary name, given mode 0600, then
//! renamed over `<pid>.sock`: so it is never reachable with a looser mode, and a stale
//! file of that name (a dead process whose pid came back) is replaced in one step.

use std::fs::DirBuilder;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use mio::net::{UnixListener, UnixStream};

use super::socket_name;

/// The default directory of processes running as root without `XDG_RUNTIME_DIR`.
pub const ROOT_DIR: &str = "/run/railover";
/// Other users' default directories are this followed by their uid.
pub const TMP_PREFIX: &str = "/tmp/railover-";

/// The directory used when `RAILOVER_CONTROL_DIR` is unset: `$XDG_RUNTIME_DIR/railover`
/// when that is an absolute path (the XDG spec says to ignore any other value), else
/// [`ROOT_DIR`] for root, else `/tmp/railover-<uid>`.
pub fn default_dir(xdg_runtime_dir: Option<&str>, euid: u32) -> PathBuf {
    match xdg_runtime_dir {
        Some(x) if Path::new(x).is_absolute() => Path::new(x).join("railover"),
        _ if euid == 0 => PathBuf::from(ROOT_DIR),
        _ => PathBuf::from(format!("{TMP_PREFIX}{euid}")),
    }
}

/// Creates `dir` (and its missing parents) with mode 0700, or checks the one there: it
/// must be a directory that `uid` owns, or [`ROOT_DIR`] owned by root, and must not let
/// other users replace files in it (writable by group or others without the sticky bit).
/// `Err` says why, for a WARN.
pub fn prepare(dir: &Path, uid: u32) -> Result<(), String> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create it: {e}"))?;
    // The link itself first: someone else's symbolic link could point at a directory we
    // own and still be swapped for another one later.
    let link = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot read it: {e}"))?;
    if link.file_type().is_symlink() {
        check_owner(dir, link.uid(), uid, "it is a symbolic link")?;
    }
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_dir() {
        return Err("it is not a directory".into());
    }
    check_owner(dir, meta.uid(), uid, "it")?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "it is writable by other users (mode {mode:04o}) without the sticky bit, so \
             they could replace the socket"
        ));
    }
    Ok(())
}

/// Refuses an owner other than `uid`, except root owning [`ROOT_DIR`] (a directory an
/// administrator may share on purpose). `what` names the thing checked.
fn check_owner(dir: &Path, owner: u32, uid: u32, what: &str) -> Result<(), String> {
    if owner == uid || (owner == 0 && dir == Path::new(ROOT_DIR)) {
        return Ok(());
    }
    Err(format!(
        "{what} is owned by uid {owner}, not by this process's uid {uid}: another user \
         could plant sockets there"
    ))
}

/// Binds `<dir>/<pid>.sock` with mode 0600, replacing a stale file of that name. Refuses
/// when a live process already serves that name (another pid namespace sharing the
/// directory). Returns the listener and the path.
pub fn bind(dir: &Path, pid: u32) -> Result<(UnixListener, PathBuf), String> {
    let path = dir.join(socket_name(pid));
    // A non-blocking connect: queued (or a full backlog) means someone listens there.
    match UnixStream::connect(&path) {
        Ok(_) => return Err(live(&path)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(live(&path)),
        Err(_) => {}
    }
    let tmp = dir.join(format!("{pid}.tmp"));
    remove_if_there(&tmp).map_err(|e| format!("cannot remove {}: {e}", tmp.display()))?;
    let listener = UnixListener::bind(&tmp).map_err(|e| format!("cannot bind: {e}"))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot make it mode 0600: {e}"))
        .and_then(|()| {
            std::fs::rename(&tmp, &path).map_err(|e| format!("cannot move it to its name: {e}"))
        });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((listener, path))
}

fn live(path: &Path) -> String {
    format!(
        "{} is served by a live process (another pid namespace sharing this directory?)",
        path.display()
    )
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::effective_uid;

    #[test]
    fn default_is_a_pure_function_of_xdg_and_uid() {
        assert_eq!(
            default_dir(Some("/run/user/42"), 42),
            Path::new("/run/user/42/railover")
        );
        assert_eq!(default_dir(None, 0), Path::new("/run/railover"));
        assert_eq!(default_dir(None, 42), Path::new("/tmp/railover-42"));
        assert_eq!(default_dir(Some("rel"), 42), Path::new("/tmp/railover-42"));
        assert_eq!(default_dir(Some(""), 0), Path::new("/run/railover"));
    }

    #[test]
    fn creates_missing_directories_private() {
        let base = tempfile::tempdir().unwrap();
        let uid = effective_uid().unwrap();
        let dir = base.path().join("a/b");
        prepare(&dir, uid).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Again: it is there and ours.
        prepare(&dir, uid).unwrap();
    }

    #[test]
    fn refuses_another_users_directory_a_file_and_a_shared_one() {
        let base = tempfile::tempdir().unwrap();
        let uid = effective_uid().unwrap();
        let dir = base.path().join("d");
        prepare(&dir, uid).unwrap();
        // As another uid would see it.
        let other = uid.wrapping_add(1);
        let e = prepare(&dir, other).unwrap_err();
        assert!(
            e.contains(&format!("uid {uid}")) && e.contains(&format!("uid {other}")),
            "{e}"
        );
        let file = base.path().join("f");
        std::fs::write(&file, b"").unwrap();
        let e = prepare(&file, uid).unwrap_err();
        assert!(
            e.contains("cannot create") || e.contains("not a directory"),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare(&dir, uid).unwrap_err();
        assert!(e.contains("0777") && e.contains("sticky"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        prepare(&dir, uid).unwrap();
    }

    #[test]
    fn a_link_is_judged_by_its_own_owner_and_its_target() {
        let base = tempfile::tempdir().unwrap();
        let uid = effective_uid().unwrap();
        let target = base.path().join("t");
        prepare(&target, uid).unwrap();
        let link = base.path().join("l");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        prepare(&link, uid).unwrap();
        let e = prepare(&link, uid.wrapping_add(1)).unwrap_err();
        assert!(e.starts_with("it is a symbolic link"), "{e}");
    }

    #[test]
    fn root_may_share_its_run_directory_and_nothing_else() {
        assert!(check_owner(Path::new(ROOT_DIR), 0, 1000, "it").is_ok());
        assert!(check_owner(Path::new("/tmp/railover-1000"), 0, 1000, "it").is_err());
        assert!(check_owner(Path::new(ROOT_DIR), 7, 1000, "it").is_err());
        assert!(check_owner(Path::new("/x"), 1000, 1000, "it").is_ok());
    }

    #[test]
    fn binds_0600_and_replaces_a_stale_socket_but_not_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("77.sock");
        // A stale socket: bound, then its listener gone.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (listener, got) = bind(dir.path(), 77).unwrap();
        assert_eq!(got, path);
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!dir.path().join("77.tmp").exists());
        // Now it is live: a second process with that pid (another namespace) is refused.
        let e = bind(dir.path(), 77).unwrap_err();
        assert!(e.contains("live process"), "{e}");
        drop(listener);
        bind(dir.path(), 77).unwrap();
    }
}
