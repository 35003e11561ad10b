//! The control plane as a client meets it: a real `Control` on a temporary directory, a
//! fake handler that records what it is asked, and plain `std` Unix sockets.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use railover::control::protocol::Answer;
use railover::control::{
    Control, ControlConfig, Handler, NicIdent, Request, Source, MAX_CONNECTIONS,
};
use serde_json::{json, Value};

/// How long any single wait may take before the test fails (never a pacing sleep).
const BOUND: Duration = Duration::from_secs(10);

/// Records each call on a channel; refuses anything about NIC 2.
struct Fake {
    calls: Mutex<Sender<(Request, Source)>>,
}

impl Handler for Fake {
    fn handle(&self, request: Request, source: Source) -> Result<Value, String> {
        let _ = self.calls.lock().unwrap().send((request.clone(), source));
        match request {
            Request::Status => Ok(status()),
            Request::Drain { nic: 2 } | Request::Undrain { nic: 2 } => {
                Err("ib0 is the last NIC of its rail".into())
            }
            Request::Drain { nic } => Ok(json!({ "drained": nic })),
            Request::Undrain { nic } => Ok(json!({ "undrained": nic })),
        }
    }
}

fn status() -> Value {
    json!({"pid": std::process::id(), "local_rank": 0, "comms": {"send": 1, "recv": 1}})
}

fn nics() -> Vec<NicIdent> {
    let nic = |name: &str, pci: Option<&str>, rail| NicIdent {
        name: name.into(),
        pci: pci.map(String::from),
        rail: Some(rail),
    };
    vec![
        nic("eth0", Some("/sys/devices/pci0000:00/0000:3b:00.0"), 0),
        nic("eth1", Some("/sys/devices/pci0000:00/0000:5e:00.0"), 1),
        nic("ib0", None, 0),
    ]
}

fn start(
    dir: Option<PathBuf>,
    drain_file: Option<PathBuf>,
) -> (Control, Receiver<(Request, Source)>) {
    let (tx, rx) = channel();
    let handler = Arc::new(Fake {
        calls: Mutex::new(tx),
    });
    let control = Control::start(&ControlConfig { dir, drain_file }, nics(), handler);
    (control, rx)
}

/// Sends `request` raw and returns every byte of the answer up to the server's close.
fn exchange(path: &Path, request: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    out
}

fn ask(path: &Path, request: &str) -> Answer {
    let out = exchange(path, request.as_bytes());
    assert_eq!(
        out.last(),
        Some(&b'\n'),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
    serde_json::from_slice(&out).unwrap()
}

fn next_call(rx: &Receiver<(Request, Source)>) -> (Request, Source) {
    rx.recv_timeout(BOUND).expect("the handler was called")
}

#[test]
fn status_drain_refusals_and_bad_requests() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("run/railover");
    let (mut control, rx) = start(Some(dir.clone()), None);
    let path = control.socket_path().expect("a socket").to_path_buf();
    assert_eq!(path, dir.join(format!("{}.sock", std::process::id())));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&dir), 0o700);

    let a = ask(&path, "status\n");
    assert!(a.ok, "{a:?}");
    assert_eq!(a.pid, std::process::id());
    assert_eq!(a.result, Some(status()));
    assert_eq!(next_call(&rx), (Request::Status, Source::Socket));

    // By name, by PCI address, by rail.
    let a = ask(&path, "drain eth1\n");
    assert!(a.ok, "{a:?}");
    assert_eq!(a.result, Some(json!({"drained": 1})));
    assert_eq!(a.nics, Some(vec!["eth1".to_string()]));
    assert_eq!(next_call(&rx), (Request::Drain { nic: 1 }, Source::Socket));
    let a = ask(&path, "undrain 5e:00.0\r\n");
    assert_eq!(a.result, Some(json!({"undrained": 1})));
    assert_eq!(
        next_call(&rx),
        (Request::Undrain { nic: 1 }, Source::Socket)
    );
    let a = ask(&path, "undrain rail:1\n");
    assert_eq!(a.result, Some(json!([{"undrained": 1}])));
    assert_eq!(
        next_call(&rx),
        (Request::Undrain { nic: 1 }, Source::Socket)
    );

    // The handler's refusal comes through, after what was done before it.
    let a = ask(&path, "drain rail:0\n");
    assert!(!a.ok);
    let e = a.error.unwrap();
    assert!(
        e.contains("ib0: ib0 is the last NIC of its rail") && e.contains("eth0 drained"),
        "{e}"
    );
    assert_eq!(a.done, Some(vec!["eth0".to_string()]));
    assert_eq!(next_call(&rx), (Request::Drain { nic: 0 }, Source::Socket));
    assert_eq!(next_call(&rx), (Request::Drain { nic: 2 }, Source::Socket));

    // Without a line end, when the client closes its side.
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    s.write_all(b"status").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("{\"ok\":true"), "{out}");
    assert_eq!(next_call(&rx), (Request::Status, Source::Socket));

    for (request, says) in [
        (&b"frob\n"[..], "unknown request"),
        (b"drain\n", "drain needs a NIC"),
        (b"drain eth0 eth1\n", "takes one NIC"),
        (b"status please\n", "takes no argument"),
        (b"drain eth9\n", "no NIC \"eth9\""),
        (b"undrain \xff\n", "not UTF-8"),
        (b"\n", "empty request"),
    ] {
        let out = exchange(&path, request);
        let a: Answer = serde_json::from_slice(&out).unwrap();
        assert!(!a.ok);
        let e = a.error.unwrap();
        assert!(e.contains(says), "{request:?}: {e}");
    }
    assert!(rx.try_recv().is_err(), "a bad request reached the handler");

    control.shutdown();
    assert!(!path.exists(), "shutdown removes the socket");
    assert!(UnixStream::connect(&path).is_err());
    control.shutdown();
}

#[test]
fn silent_and_oversized_clients_hold_up_no_one() {
    let base = tempfile::tempdir().unwrap();
    let (control, rx) = start(Some(base.path().join("c")), None);
    let path = control.socket_path().unwrap().to_path_buf();

    // More idle clients than the server keeps; the oldest make room for those after.
    let mut idle: Vec<UnixStream> = (0..MAX_CONNECTIONS * 2)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    let mut silent = UnixStream::connect(&path).unwrap();
    let mut big = UnixStream::connect(&path).unwrap();
    big.set_read_timeout(Some(BOUND)).unwrap();
    big.write_all(&[b'x'; 2048]).unwrap();

    let a = ask(&path, "status\n");
    assert!(a.ok);
    assert_eq!(next_call(&rx), (Request::Status, Source::Socket));
    // The good client was answered while the silent one was still waiting: its deadline
    // (2 s) has not passed, so nothing has come for it yet.
    silent.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        silent.read(&mut byte).unwrap_err().kind(),
        ErrorKind::WouldBlock
    );

    // The oversized request is refused, and the answer ends cleanly (not a reset).
    let mut out = String::new();
    big.read_to_string(&mut out).unwrap();
    let a: Answer = serde_json::from_str(&out).unwrap();
    assert!(!a.ok);
    assert!(a.error.unwrap().contains("longer than 1024 bytes"));

    // The silent one is told why at its deadline, then closed.
    silent.set_nonblocking(false).unwrap();
    silent.set_read_timeout(Some(BOUND)).unwrap();
    let mut out = String::new();
    silent.read_to_string(&mut out).unwrap();
    let a: Answer = serde_json::from_str(&out).unwrap();
    assert!(
        a.error.unwrap().contains("no complete request line"),
        "{out}"
    );
    // The first idle client was closed to make room, and told so.
    idle[0].set_read_timeout(Some(BOUND)).unwrap();
    let mut out = String::new();
    idle[0].read_to_string(&mut out).unwrap();
    assert!(out.contains("make room"), "{out}");
    drop(idle);
    assert!(rx.try_recv().is_err());
}

#[test]
fn the_drain_file_drives_the_handler() {
    let base = tempfile::tempdir().unwrap();
    let file = base.path().join("drain");
    let (mut control, rx) = start(Some(base.path().join("c")), Some(file.clone()));
    assert!(control.socket_path().is_some());

    // Written whole under another name, then renamed, as an orchestrator should, so no
    // read sees half a file.
    let write = |text: &str| {
        let tmp = base.path().join("drain.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    write("# node maintenance\neth9 # another process's\neth1\n");
    assert_eq!(next_call(&rx), (Request::Drain { nic: 1 }, Source::File));
    write("rail:0\n");
    assert_eq!(next_call(&rx), (Request::Undrain { nic: 1 }, Source::File));
    assert_eq!(next_call(&rx), (Request::Drain { nic: 0 }, Source::File));
    // ib0 is refused, so it is asked again at the next read.
    assert_eq!(next_call(&rx), (Request::Drain { nic: 2 }, Source::File));
    assert_eq!(next_call(&rx), (Request::Drain { nic: 2 }, Source::File));
    std::fs::remove_file(&file).unwrap();
    // Gone: what it drained is undrained (ib0 may be tried once more before that).
    let mut call = next_call(&rx);
    while call == (Request::Drain { nic: 2 }, Source::File) {
        call = next_call(&rx);
    }
    assert_eq!(call, (Request::Undrain { nic: 0 }, Source::File));
    control.shutdown();
}

#[test]
fn without_a_socket_the_drain_file_is_still_watched() {
    let base = tempfile::tempdir().unwrap();
    // The directory cannot be made: a file is in the way.
    let blocked = base.path().join("blocked");
    std::fs::write(&blocked, b"").unwrap();
    let file = base.path().join("drain");
    std::fs::write(&file, "eth0\n").unwrap();
    let (mut control, rx) = start(Some(blocked.join("dir")), Some(file));
    assert_eq!(control.socket_path(), None);
    assert_eq!(next_call(&rx), (Request::Drain { nic: 0 }, Source::File));
    control.shutdown();

    // Nothing to do: no thread, nothing to join.
    let (mut off, _rx) = start(None, None);
    assert_eq!(off.socket_path(), None);
    off.shutdown();
}
