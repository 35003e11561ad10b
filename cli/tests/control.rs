//! `railover drain|undrain|status` against control sockets served in the test: a fake
//! process's socket named with this test's own pid (which exists, so it is not stale),
//! and a stale one.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Output};
use std::thread::JoinHandle;

fn railover(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_railover"))
        .args(args)
        .output()
        .expect("run railover")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn pid() -> u32 {
    std::process::id()
}

/// Serves `replies` in order, one per connection that sends a request, on
/// `<dir>/<pid>.sock`; returns the request lines it got.
fn fake(dir: &Path, replies: Vec<String>) -> JoinHandle<Vec<String>> {
    let listener = UnixListener::bind(dir.join(format!("{}.sock", pid()))).unwrap();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        while got.len() < replies.len() {
            let (mut s, _) = listener.accept().unwrap();
            let mut request = String::new();
            s.read_to_string(&mut request).unwrap();
            if request.is_empty() {
                continue;
            }
            s.write_all(replies[got.len()].as_bytes()).unwrap();
            got.push(request);
        }
        got
    })
}

/// A socket file nobody listens on, for a pid no process has.
fn stale(dir: &Path) -> String {
    let path = dir.join("999999999.sock");
    drop(UnixListener::bind(&path).unwrap());
    path.display().to_string()
}

fn dir_arg(dir: &Path) -> String {
    dir.display().to_string()
}

#[test]
fn no_process_found_says_so_and_exits_1() {
    let empty = tempfile::tempdir().unwrap();
    let d = dir_arg(empty.path());
    let o = railover(&["status", "--dir", &d]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no railover process found"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains(&d), "{}", stderr(&o));
    assert!(stdout(&o).is_empty());
    // A directory that does not exist is no process either; a stale socket neither.
    let stale_path = stale(empty.path());
    let o = railover(&["drain", "eth0", "--dir", &d]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!("stale: {stale_path}")),
        "{}",
        stderr(&o)
    );
    let gone = empty.path().join("nowhere");
    let o = railover(&["undrain", "eth0", "--dir", &dir_arg(&gone)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no railover process found"));
}

#[test]
fn drain_prints_one_line_per_process_and_exits_0_when_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let stale_path = stale(dir.path());
    let server = fake(
        dir.path(),
        vec![
            format!(
                "{{\"ok\":true,\"pid\":{},\"result\":{{\"drained\":1}},\"nics\":[\"x\"]}}\n",
                pid()
            ),
            format!(
                "{{\"ok\":true,\"pid\":{},\"result\":[{{}},{{}}],\"nics\":[\"eth0\",\"ib0\"]}}\n",
                pid()
            ),
            format!(
                "{{\"ok\":true,\"pid\":{},\"result\":\"eth0 was already drained\",\"nics\":[\"eth0\"]}}\n",
                pid()
            ),
        ],
    );
    let d = dir_arg(dir.path());
    let o = railover(&["drain", "x", "--dir", &d]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("pid {}: drained x\n", pid()));
    assert!(
        stderr(&o).contains(&format!("stale: {stale_path}")),
        "{}",
        stderr(&o)
    );
    let o = railover(&[
        "undrain",
        "rail:0",
        "--dir",
        &d,
        "--pid",
        &pid().to_string(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        format!("pid {}: undrained rail:0 (eth0, ib0)\n", pid())
    );
    // The process's own words, when it gives them.
    let o = railover(&["drain", "eth0", "--dir", &d]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        format!("pid {}: eth0 was already drained\n", pid())
    );
    assert_eq!(
        server.join().unwrap(),
        ["drain x\n", "undrain rail:0\n", "drain eth0\n"]
    );
}

#[test]
fn a_refusal_is_printed_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let refusal = format!(
        "{{\"ok\":false,\"pid\":{},\"error\":\"no NIC \\\"x\\\" in this process, which has eth0\"}}\n",
        pid()
    );
    let server = fake(dir.path(), vec![refusal.clone(), refusal]);
    let d = dir_arg(dir.path());
    let o = railover(&["drain", "x", "--dir", &d]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        format!(
            "pid {}: refused: no NIC \"x\" in this process, which has eth0\n",
            pid()
        )
    );
    let o = railover(&["drain", "x", "--dir", &d, "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON document");
    assert_eq!(v[0]["ok"], false);
    assert_eq!(v[0]["pid"], pid());
    assert!(v[0]["error"].as_str().unwrap().contains("no NIC"));
    assert_eq!(server.join().unwrap(), ["drain x\n", "drain x\n"]);
}

#[test]
fn another_pid_is_not_asked() {
    let dir = tempfile::tempdir().unwrap();
    // Bound but never accepting: the command must not send it anything.
    let _listener = UnixListener::bind(dir.path().join(format!("{}.sock", pid()))).unwrap();
    let o = railover(&["drain", "x", "--dir", &dir_arg(dir.path()), "--pid", "1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no railover process found with pid 1"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn status_prints_a_table_json_and_watches() {
    let dir = tempfile::tempdir().unwrap();
    let state = format!(
        r#"{{"ok":true,"pid":{p},"result":{{"pid":{p},"local_rank":3,"nics":[{{"index":0,"name":"rv0","rail":0,"up":true,"drained":true,"drained_by":["file"],"comms":2}}],"comms":{{"send":2,"recv":1}},"failovers":4,"failbacks":1,"drains":1,"degraded":[]}}}}"#,
        p = pid()
    ) + "\n";
    let server = fake(dir.path(), vec![state.clone(); 4]);
    let d = dir_arg(dir.path());
    let o = railover(&["status", "--dir", &d]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("PROCESS"), "{out}");
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        row,
        [
            "pid",
            &pid().to_string(),
            "3",
            "2/1",
            "4",
            "1",
            "1",
            "rv0",
            "drained(file)",
            "2",
            "none"
        ],
        "{out}"
    );
    let o = railover(&["status", "--dir", &d, "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON document");
    assert_eq!(v[0]["pid"], pid());
    assert_eq!(v[0]["nics"][0]["name"], "rv0");
    // Two rounds, then it stops by itself.
    let o = railover(&["status", "--dir", &d, "--watch", "1", "--count", "2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o).matches("PROCESS").count(), 2, "{}", stdout(&o));
    assert_eq!(server.join().unwrap(), vec!["status\n"; 4]);
}

#[test]
fn the_commands_have_help_with_their_options() {
    for (cmd, opts) in [
        ("drain", &["--dir", "--pid", "--json", "rail:N"][..]),
        ("undrain", &["--dir", "--pid", "--json"]),
        (
            "status",
            &["--dir", "--pid", "--json", "--watch", "--count"],
        ),
    ] {
        let o = railover(&[cmd, "--help"]);
        assert_eq!(o.status.code(), Some(0), "{cmd}: {}", stderr(&o));
        for opt in opts {
            assert!(stdout(&o).contains(opt), "{cmd} --help lacks {opt}");
        }
    }
}
