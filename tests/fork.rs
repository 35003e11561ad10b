//! A child forked from a process whose plugin is initialised gets `ncclSystemError` from
//! every call at once, with one WARN saying why, instead of waiting forever for a reactor
//! thread it does not have; the parent goes on as if nothing happened. In its own test
//! binary: it forks the test process, and the child must find nothing else running in it.
// fork, pipe2, waitpid and kill have no safe wrapper here; each block says why it is sound.
#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use railover::telemetry::log::{self, Severity};
use railover_testkit::driver::{connect_pair, pattern, Code, Ctx, Listener, Request};

/// ncclSystemError.
const SYSTEM: i32 = 2;
/// How long the child may take for all its calls: each must fail at once (before, `listen`
/// alone waited 30 s for a reactor that does not exist in the child).
const CHILD_LIMIT: Duration = Duration::from_secs(10);

fn outcome(req: &mut Request) -> Result<usize, Code> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(n) = req.test()? {
            return Ok(n);
        }
        assert!(Instant::now() < end, "request still pending after 30 s");
        std::thread::yield_now();
    }
}

/// The code a driver call returned: 0 for success, else its `ncclResult_t`.
fn code<T>(r: Result<T, Code>) -> i32 {
    r.map_or_else(|Code(c)| c, |_| 0)
}

fn fork_warns() -> Vec<String> {
    log::captured()
        .into_iter()
        .filter(|(sev, line)| *sev == Severity::Warn && line.contains("forked"))
        .map(|(_, line)| line)
        .collect()
}

/// A pipe whose ends close on exec: (read, write).
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [-1; 2];
    // SAFETY: `fds` is a writable array of two ints, as pipe2 requires.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: pipe2 succeeded, so both are open descriptors that nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

#[test]
fn a_forked_child_fails_at_once_and_the_parent_keeps_working() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_PORT", "off");
    log::capture();
    let ctx = Ctx::init().unwrap();
    let (handle, l): ([u8; 128], Listener) = ctx.listen(0).unwrap();
    let mut h = handle;
    let (s, r) = connect_pair(&ctx, 0, &mut h, &l, Duration::from_secs(30)).unwrap();
    let mut sbuf = s.register(64).unwrap();
    sbuf.bytes_mut().unwrap().copy_from_slice(&pattern(1, 64));
    let mut rbuf = r.register(64).unwrap();
    let mut rq = r.irecv(&mut rbuf, 64).unwrap().expect("a request slot");
    let mut sq = s.isend_patiently(&sbuf, 64, 0).unwrap().expect("taken");
    assert_eq!(outcome(&mut sq), Ok(64));
    assert_eq!(outcome(&mut rq), Ok(64));
    // In flight at the fork: a receive nothing has been sent to yet.
    let mut pending_buf = r.register(64).unwrap();
    let mut pending = r.irecv(&mut pending_buf, 64).unwrap().expect("a slot");
    let mut spare = r.register(64).unwrap();

    let parent = std::process::id();
    let (rd, wr) = pipe();
    // SAFETY: the child only calls the plugin through its C ABI, writes to the pipe and
    // leaves with `_exit`: it never returns into the test harness, whose other state
    // (threads, locks) the fork copied half-made.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(rd);
        let report = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            log::capture();
            let start = Instant::now();
            let mut h = handle;
            let calls = [
                ("devices", code(ctx.devices())),
                ("getProperties", code(ctx.properties(0))),
                ("listen", code(ctx.listen(0))),
                ("connect", code(ctx.connect(0, &mut h))),
                ("accept", code(l.accept())),
                ("regMr", code(s.register(64))),
                ("isend", code(s.isend(&sbuf, 64))),
                ("irecv", code(r.irecv(&mut spare, 64))),
                ("test", code(pending.test())),
                ("closeSend", code(s.close())),
                ("closeRecv", code(r.close())),
                ("finalize", code(ctx.finalize())),
                ("init", code(Ctx::init())),
            ];
            let mut out = String::new();
            for (name, c) in calls {
                out += &format!("{name} {c}\n");
            }
            out += &format!("elapsed_ms {}\n", start.elapsed().as_millis());
            for w in fork_warns() {
                out += &format!("warn {w}\n");
            }
            out += &format!("pid {}\n", std::process::id());
            out
        }));
        let (text, status) = match report {
            Ok(text) => (text, 0),
            Err(_) => ("panic in the child\n".to_string(), 101),
        };
        let _ = std::fs::File::from(wr).write_all(text.as_bytes());
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(status) };
    }
    drop(wr);

    // The child's report, or a hang: its calls must all return within the limit.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::fs::File::from(rd).read_to_string(&mut text);
        let _ = tx.send(text);
    });
    let report = match rx.recv_timeout(CHILD_LIMIT) {
        Ok(text) => text,
        Err(_) => {
            // SAFETY: `pid` is our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; a NULL status is allowed.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
            panic!("the forked child's calls did not return within {CHILD_LIMIT:?}");
        }
    };
    let mut status = 0;
    // SAFETY: `pid` is our own child, and `status` is a writable int.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x}:\n{report}"
    );

    let field = |name: &str| -> Vec<&str> {
        report
            .lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .collect()
    };
    for call in [
        "devices",
        "getProperties",
        "listen",
        "connect",
        "accept",
        "regMr",
        "isend",
        "irecv",
        "test",
        "closeSend",
        "closeRecv",
        "finalize",
        "init",
    ] {
        assert_eq!(
            field(call),
            [SYSTEM.to_string()],
            "{call} in the child:\n{report}"
        );
    }
    let elapsed: u64 = field("elapsed_ms")[0].parse().unwrap();
    assert!(elapsed < 5000, "the child's calls took {elapsed} ms");
    let child: u32 = field("pid")[0].parse().unwrap();
    let warns = field("warn");
    assert_eq!(warns.len(), 1, "one WARN in the child:\n{report}");
    assert!(
        warns[0].contains(&format!("initialised in process {parent}"))
            && warns[0].contains(&format!("child {child} forked from it"))
            && warns[0].starts_with("railover devices: system error:"),
        "{}",
        warns[0]
    );

    // The parent is untouched: no WARN here, the receive in flight at the fork completes,
    // its comms move data, and new comms connect.
    assert!(fork_warns().is_empty(), "{:?}", fork_warns());
    let mut sq = s.isend_patiently(&sbuf, 64, 0).unwrap().expect("taken");
    assert_eq!(outcome(&mut sq), Ok(64));
    assert_eq!(outcome(&mut pending), Ok(64));
    assert_eq!(pending_buf.bytes().unwrap(), &pattern(1, 64)[..]);
    let mut h = handle;
    let (s2, r2) = connect_pair(&ctx, 0, &mut h, &l, Duration::from_secs(30)).unwrap();
    let mut sbuf2 = s2.register(4096).unwrap();
    sbuf2
        .bytes_mut()
        .unwrap()
        .copy_from_slice(&pattern(2, 4096));
    let mut rbuf2 = r2.register(4096).unwrap();
    let mut rq = r2.irecv(&mut rbuf2, 4096).unwrap().expect("a slot");
    let mut sq = s2.isend_patiently(&sbuf2, 4096, 0).unwrap().expect("taken");
    assert_eq!(outcome(&mut sq), Ok(4096));
    assert_eq!(outcome(&mut rq), Ok(4096));
    assert_eq!(rbuf2.bytes().unwrap(), &pattern(2, 4096)[..]);
    drop((sbuf, rbuf, pending_buf, spare, sbuf2, rbuf2));
    s.close().unwrap();
    r.close().unwrap();
    drop((s2, r2, l));
    ctx.finalize().unwrap();
    assert!(fork_warns().is_empty(), "{:?}", fork_warns());
}
