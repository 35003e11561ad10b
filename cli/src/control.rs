//! `railover drain NIC`, `railover undrain NIC`, `railover status`: the operator's side of
//! the control sockets every railover process opens (`docs/control.md`).
//!
//! Processes are found by listing `*.sock` in the control directory: `--dir DIR` alone
//! when given; else `RAILOVER_CONTROL_DIR` or the same default as the plugin's
//! (`$XDG_RUNTIME_DIR/railover`, `/run/railover` as root, `/tmp/railover-UID`), and, as
//! root, every user's (`/run/user/*/railover`, `/tmp/railover-*`, `/run/railover`).
//! A socket nobody listens on, or whose listening process is gone, is stale: skipped and
//! named on stderr. Who serves a socket is taken from the kernel (`SO_PEERCRED`), not
//! from its name, so a process in another pid namespace shows both pids.
//!
//! Exit codes: 0 when every process found accepted (drain, undrain) or answered
//! (status); 1 when one refused or did not answer, or none was found; 2 on a bad
//! argument or setting.

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use railover::control::dir::{ROOT_DIR, TMP_PREFIX};
use railover::control::nics::SPEC_ACCEPTED;
use railover::control::protocol::Answer;
use railover::control::{self, ControlConfig, DRAIN_FILE_VAR};
use serde_json::Value;

/// How long a process has to answer: its own deadline is 2 s, plus what the request
/// takes inside it (the plugin waits up to 5 s for its reactor per NIC).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest answer read.
const MAX_ANSWER: u64 = 4 * 1024 * 1024;

const EXIT_STATUS: &str = "Exit status: 0 when every process found accepted; 1 when one \
refused or did not answer, or none was found; 2 on a bad argument or setting.";

/// Where to look, and for whom.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Find {
    /// Control directory to search, alone [default: $RAILOVER_CONTROL_DIR, else
    /// $XDG_RUNTIME_DIR/railover, else /run/railover as root or /tmp/railover-UID; as root
    /// also every user's]
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Only the process with this pid
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,
}

#[derive(Debug, Clone, clap::Args)]
#[command(after_help = EXIT_STATUS)]
pub struct DrainArgs {
    /// The NIC: a name (eth1, mlx5_0), a PCI address (0000:3b:00.0 or 3b:00.0), or rail:N
    /// for every NIC on rail N
    #[arg(value_name = "NIC", value_parser = nic_spec)]
    pub nic: String,
    #[command(flatten)]
    pub find: Find,
    /// Print the processes' answers as a JSON array
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Exit status: 0 when every process found answered; 1 when one did \
not, or none was found; 2 on a bad argument or setting."
)]
pub struct StatusArgs {
    #[command(flatten)]
    pub find: Find,
    /// Print the processes' states as a JSON array (one line per round with --watch)
    #[arg(long)]
    pub json: bool,
    /// Ask again every SECS seconds until interrupted
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub watch: Option<u64>,
    /// With --watch: stop after N rounds
    #[arg(long, value_name = "N", requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
}

/// A NIC spec as the request line carries it: one word.
fn nic_spec(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 256 || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "expected {SPEC_ACCEPTED}: one word of at most 256 bytes"
        ));
    }
    Ok(v.to_string())
}

/// Runs `railover drain` (`drain`) or `railover undrain`; returns the exit code.
pub fn drain(args: &DrainArgs, drain: bool) -> i32 {
    let verb = if drain { "drain" } else { "undrain" };
    let found = match find(&args.find) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("railover {verb}: {e}");
            return 2;
        }
    };
    let replies = found.ask(&format!("{verb} {}\n", args.nic), args.find.pid);
    if replies.is_empty() {
        return found.none_found(verb, args.find.pid);
    }
    if args.json {
        let answers: Vec<Answer> = replies.iter().map(Reply::answer).collect();
        println!("{}", serde_json::to_string(&answers).unwrap_or_default());
    } else {
        for r in &replies {
            match &r.outcome {
                Ok(a) if a.ok => println!("{}: {}", r.label(), done_line(verb, &args.nic, a)),
                Ok(a) => println!(
                    "{}: refused: {}",
                    r.label(),
                    clean(a.error.as_deref().unwrap_or("(no reason given)"))
                ),
                Err(e) => println!("{}: no answer: {e}", r.label()),
            }
        }
    }
    i32::from(!replies.iter().all(|r| matches!(&r.outcome, Ok(a) if a.ok)))
}

/// What the process said it did, when it said it in words (`drained eth1: its traffic
/// moves to other NICs`, one clause per NIC); else `drained eth1`, or `drained rail:0
/// (eth0, ib0)` when the spec is not the one NIC's name.
fn done_line(verb: &str, spec: &str, a: &Answer) -> String {
    let said: Option<Vec<&str>> = match &a.result {
        Some(Value::String(s)) => Some(vec![s.as_str()]),
        Some(Value::Array(v)) if !v.is_empty() => v.iter().map(Value::as_str).collect(),
        _ => None,
    };
    if let Some(said) = said {
        return said.into_iter().map(clean).collect::<Vec<_>>().join("; ");
    }
    match a.nics.as_deref() {
        Some([one]) if one == spec => format!("{verb}ed {}", clean(spec)),
        Some(names) if !names.is_empty() => format!(
            "{verb}ed {} ({})",
            clean(spec),
            names
                .iter()
                .map(|n| clean(n))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => format!("{verb}ed {}", clean(spec)),
    }
}

/// Runs `railover status`; returns the exit code.
pub fn status(args: &StatusArgs) -> i32 {
    let mut round = 0u64;
    loop {
        round += 1;
        let code = status_once(args);
        let Some(secs) = args.watch else {
            return code;
        };
        if args.count.is_some_and(|n| round >= n) {
            return code;
        }
        if !args.json {
            println!();
        }
        std::thread::sleep(Duration::from_secs(secs));
    }
}

fn status_once(args: &StatusArgs) -> i32 {
    let found = match find(&args.find) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("railover status: {e}");
            return 2;
        }
    };
    let replies = found.ask("status\n", args.find.pid);
    if replies.is_empty() {
        return found.none_found("status", args.find.pid);
    }
    if args.json {
        let states: Vec<Value> = replies
            .iter()
            .map(|r| match &r.outcome {
                Ok(Answer {
                    ok: true,
                    result: Some(Value::Object(m)),
                    ..
                }) => {
                    let mut m = m.clone();
                    m.entry("pid").or_insert(r.pid.into());
                    Value::Object(m)
                }
                _ => {
                    let a = r.answer();
                    serde_json::json!({"pid": r.pid, "error": a.error, "result": a.result})
                }
            })
            .collect();
        println!("{}", serde_json::to_string(&states).unwrap_or_default());
    } else {
        let states: Vec<(String, &Value)> = replies
            .iter()
            .filter_map(|r| match &r.outcome {
                Ok(Answer {
                    ok: true,
                    result: Some(v),
                    ..
                }) => Some((r.label(), v)),
                _ => None,
            })
            .collect();
        if !states.is_empty() {
            print!("{}", render_table(&states));
        }
        for r in &replies {
            match &r.outcome {
                Ok(a) if a.ok && a.result.is_some() => {}
                Ok(a) => println!(
                    "{}: refused: {}",
                    r.label(),
                    clean(a.error.as_deref().unwrap_or("(no state given)"))
                ),
                Err(e) => println!("{}: no answer: {e}", r.label()),
            }
        }
    }
    i32::from(!replies.iter().all(|r| matches!(&r.outcome, Ok(a) if a.ok)))
}

/// The status table: one row per process; what a state lacks prints as `-`.
pub fn render_table(states: &[(String, &Value)]) -> String {
    let header = [
        "PROCESS",
        "RANK",
        "COMMS S/R",
        "FAILOVERS",
        "FAILBACKS",
        "DRAINS",
        "NICS",
        "DEGRADED",
    ];
    let rows: Vec<[String; 8]> = states
        .iter()
        .map(|(label, s)| {
            let comms = match (s.pointer("/comms/send"), s.pointer("/comms/recv")) {
                (None, None) => "-".to_string(),
                (send, recv) => format!("{}/{}", scalar(send), scalar(recv)),
            };
            [
                label.clone(),
                scalar(s.get("local_rank")),
                comms,
                scalar(s.get("failovers")),
                scalar(s.get("failbacks")),
                scalar(s.get("drains")),
                nics_cell(s.get("nics")),
                degraded_cell(s.get("degraded")),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                l.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

/// A number or a string as it reads, else `-`.
fn scalar(v: Option<&Value>) -> String {
    match v {
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::String(s)) => clean(s),
        Some(Value::Bool(b)) => b.to_string(),
        _ => "-".into(),
    }
}

/// `eth0 up 12 400000Mbit/s, eth1 drained(socket) 0, eth2 down 3`: name, state, comms,
/// and the capacity backups are weighed by when known.
fn nics_cell(v: Option<&Value>) -> String {
    let Some(Value::Array(nics)) = v else {
        return "-".into();
    };
    if nics.is_empty() {
        return "none".into();
    }
    nics.iter()
        .map(|n| {
            let drained_by: Vec<String> = match n.get("drained_by") {
                Some(Value::Array(by)) => by
                    .iter()
                    .map(|b| b.as_str().map_or_else(|| "-".into(), clean))
                    .collect(),
                _ => Vec::new(),
            };
            let state = match (n.get("drained"), n.get("up")) {
                (Some(Value::Bool(true)), _) if drained_by.is_empty() => "drained".to_string(),
                (Some(Value::Bool(true)), _) => format!("drained({})", drained_by.join("+")),
                (_, Some(Value::Bool(true))) => "up".into(),
                (_, Some(Value::Bool(false))) => "down".into(),
                _ => "-".into(),
            };
            // What the router weighs it by, when it knows: a rate below the link speed
            // is one the NIC showed while backed up.
            let capacity = match n.get("capacity_mbit").and_then(Value::as_u64) {
                Some(m) => format!(" {m}Mbit/s"),
                None => String::new(),
            };
            format!(
                "{} {state} {}{capacity}",
                scalar(n.get("name")),
                scalar(n.get("comms"))
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `comm 5 for 12.3s, comm 7 for 3.0s`, or `none`.
fn degraded_cell(v: Option<&Value>) -> String {
    let Some(Value::Array(d)) = v else {
        return "-".into();
    };
    if d.is_empty() {
        return "none".into();
    }
    d.iter()
        .map(|c| {
            let since = match c.get("since_s").and_then(Value::as_f64) {
                Some(s) => format!("{s:.1}s"),
                None => "-".into(),
            };
            format!("comm {} for {since}", scalar(c.get("comm")))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Text from a process, with control characters escaped so it cannot drive the terminal.
fn clean(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// The sockets found and the directories searched.
#[derive(Debug)]
struct Found {
    dirs: Vec<PathBuf>,
    /// `(pid in the name, path)`, in directory then pid order.
    sockets: Vec<(u32, PathBuf)>,
}

/// One process's reply.
struct Reply {
    /// The pid its socket's name carries.
    pid: u32,
    /// The listening process's pid here, when it is not `pid` (another pid namespace).
    pid_here: Option<i32>,
    outcome: Result<Answer, String>,
}

impl Reply {
    fn label(&self) -> String {
        match self.pid_here {
            Some(here) => format!("pid {} (pid {here} here)", self.pid),
            None => format!("pid {}", self.pid),
        }
    }

    /// The answer, or a refusal standing for a process that gave none.
    fn answer(&self) -> Answer {
        match &self.outcome {
            Ok(a) => a.clone(),
            Err(e) => Answer::refusal(self.pid, format!("no answer: {e}")),
        }
    }
}

/// The directories to search for `find`.
fn find(find: &Find) -> Result<Found, String> {
    let dirs = match &find.dir {
        Some(d) => vec![d.clone()],
        None => {
            let euid = control::effective_uid()
                .map_err(|e| format!("cannot tell this process's uid: {e}"))?;
            // Only the directory matters here; a drain file set in this shell is the
            // plugin's business, not the command's.
            let cfg = ControlConfig::from_lookup(
                |k| {
                    if k == DRAIN_FILE_VAR {
                        None
                    } else {
                        std::env::var(k).ok()
                    }
                },
                euid,
            )
            .map_err(|e| e.to_string())?;
            let Some(dir) = cfg.dir else {
                return Err(format!(
                    "{}=off here, so there is no control directory to search: give --dir DIR",
                    control::DIR_VAR
                ));
            };
            let mut dirs = vec![dir];
            if euid == 0 {
                dirs.extend(every_users_dirs());
            }
            let mut seen = BTreeSet::new();
            dirs.retain(|d| seen.insert(d.clone()));
            dirs
        }
    };
    let mut sockets = Vec::new();
    for dir in &dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => {
                eprintln!("railover: cannot list {}: {e}", dir.display());
                continue;
            }
        };
        let mut here: Vec<(u32, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let pid = control::parse_socket_name(e.file_name().to_str()?)?;
                Some((pid, e.path()))
            })
            .collect();
        here.sort();
        sockets.extend(here);
    }
    Ok(Found { dirs, sockets })
}

/// Root's view: every user's directory that exists.
fn every_users_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from(ROOT_DIR)];
    let subdirs = |parent: &str| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(parent)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .collect();
        v.sort();
        v
    };
    for user in subdirs("/run/user") {
        let d = user.join("railover");
        if d.is_dir() {
            dirs.push(d);
        }
    }
    let (tmp, prefix) = TMP_PREFIX.rsplit_once('/').unwrap_or(("/tmp", "railover-"));
    for d in subdirs(tmp) {
        let ours = d
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix));
        if ours && d.is_dir() {
            dirs.push(d);
        }
    }
    dirs
}

impl Found {
    /// Sends `request` to every live process (only `pid`'s, when given) and collects
    /// their replies; stale sockets are named on stderr.
    fn ask(&self, request: &str, pid: Option<u32>) -> Vec<Reply> {
        let mut replies = Vec::new();
        for (name_pid, path) in &self.sockets {
            match exchange(*name_pid, path, request, pid) {
                Exchange::Stale(why) => eprintln!("stale: {} ({why})", path.display()),
                Exchange::Skipped => {}
                Exchange::Done(r) => replies.push(r),
            }
        }
        replies
    }

    /// Says no process was found, and where it looked; the exit code.
    fn none_found(&self, what: &str, pid: Option<u32>) -> i32 {
        let whom = match pid {
            Some(p) => format!("with pid {p}"),
            None => "at all".into(),
        };
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        eprintln!(
            "railover {what}: no railover process found {whom} (looked for *.sock in {})",
            dirs.join(", ")
        );
        1
    }
}

enum Exchange {
    Stale(String),
    /// Not the process asked for.
    Skipped,
    Done(Reply),
}

fn exchange(name_pid: u32, path: &Path, request: &str, want: Option<u32>) -> Exchange {
    let gone = |pid: i64| !Path::new("/proc").join(pid.to_string()).exists();
    let mut stream = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e)
            if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound)
                || gone(name_pid.into()) =>
        {
            if want.is_some_and(|w| w != name_pid) {
                return Exchange::Skipped;
            }
            return Exchange::Stale(format!("nobody listens: {e}"));
        }
        Err(e) => {
            if want.is_some_and(|w| w != name_pid) {
                return Exchange::Skipped;
            }
            let hint = if e.kind() == ErrorKind::PermissionDenied {
                " (another user's process: run as that user or root)"
            } else {
                ""
            };
            return Exchange::Done(Reply {
                pid: name_pid,
                pid_here: None,
                outcome: Err(format!("cannot connect to {}: {e}{hint}", path.display())),
            });
        }
    };
    // The listening process as the kernel knows it. A listener outliving its process (held
    // by a child forked without the control thread) never answers: stale.
    let here = control::peer(&stream).ok().map(|p| p.pid);
    if want.is_some_and(|w| w != name_pid && here != i32::try_from(w).ok()) {
        return Exchange::Skipped;
    }
    if let Some(p) = here {
        if gone(p.into()) {
            return Exchange::Stale(format!("its process {p} is gone"));
        }
    }
    let reply = |outcome| {
        Exchange::Done(Reply {
            pid: name_pid,
            pid_here: here.filter(|&h| i64::from(h) != i64::from(name_pid)),
            outcome,
        })
    };
    let sent = stream
        .set_read_timeout(Some(ANSWER_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(ANSWER_TIMEOUT)))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .and_then(|()| stream.shutdown(std::net::Shutdown::Write));
    if let Err(e) = sent {
        return reply(Err(format!("cannot send the request: {e}")));
    }
    let mut bytes = Vec::new();
    if let Err(e) = (&mut stream).take(MAX_ANSWER).read_to_end(&mut bytes) {
        let e = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            format!("nothing within {} s", ANSWER_TIMEOUT.as_secs())
        } else {
            e.to_string()
        };
        return reply(Err(e));
    }
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    match serde_json::from_slice::<Answer>(line) {
        Ok(a) => reply(Ok(a)),
        Err(e) if line.is_empty() => reply(Err(format!("it closed without an answer ({e})"))),
        Err(e) => reply(Err(format!(
            "not a railover answer ({e}): {}",
            clean(&String::from_utf8_lossy(&line[..line.len().min(200)]))
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table_renders_what_is_there_and_dashes_the_rest() {
        let full = json!({
            "pid": 123, "local_rank": 0,
            "nics": [
                {"index": 0, "name": "rv0", "rail": 0, "up": true, "drained": false,
                 "drained_by": [], "comms": 12, "capacity_mbit": 200},
                {"index": 1, "name": "rv1", "rail": 1, "up": true, "drained": true,
                 "drained_by": ["socket", "file"], "comms": 0},
                {"index": 2, "name": "rv2", "up": false, "drained": false, "comms": 3}
            ],
            "comms": {"send": 8, "recv": 7},
            "failovers": 3, "failbacks": 2, "drains": 1,
            "degraded": [{"comm": 5, "since_s": 12.34, "pairs": "rv2->rv0"}]
        });
        let sparse = json!({"pid": 9});
        let table = render_table(&[("pid 123".into(), &full), ("pid 9".into(), &sparse)]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(
            lines[0].starts_with("PROCESS") && lines[0].ends_with("DEGRADED"),
            "{table}"
        );
        let row: Vec<&str> = lines[1].split("  ").filter(|c| !c.is_empty()).collect();
        assert_eq!(
            row.iter().map(|c| c.trim()).collect::<Vec<_>>(),
            [
                "pid 123",
                "0",
                "8/7",
                "3",
                "2",
                "1",
                "rv0 up 12 200Mbit/s, rv1 drained(socket+file) 0, rv2 down 3",
                "comm 5 for 12.3s"
            ],
            "{table}"
        );
        let sparse_row: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(sparse_row, ["pid", "9", "-", "-", "-", "-", "-", "-", "-"]);
        // Columns line up: the NICS column starts at the same place on every line.
        let at = lines[0].find("NICS").unwrap();
        assert_eq!(&lines[1][at..at + 3], "rv0");
    }

    #[test]
    fn empty_lists_say_none() {
        let s = json!({"nics": [], "degraded": [], "comms": {"send": 1}});
        let table = render_table(&[("pid 1".into(), &s)]);
        let row = table.lines().nth(1).unwrap();
        assert!(row.contains("1/-"), "{table}");
        assert_eq!(row.matches("none").count(), 2, "{table}");
    }

    #[test]
    fn text_from_a_process_cannot_drive_the_terminal() {
        assert_eq!(clean("ok\u{1b}[2J\n"), "ok\\u{1b}[2J\\n");
        assert_eq!(clean("eth0 é"), "eth0 é");
    }

    #[test]
    fn done_lines_name_the_nics_a_spec_stood_for() {
        let mut a = Answer::refusal(1, String::new());
        a.ok = true;
        a.nics = Some(vec!["eth1".into()]);
        assert_eq!(done_line("drain", "eth1", &a), "drained eth1");
        a.nics = Some(vec!["eth0".into(), "ib0".into()]);
        assert_eq!(
            done_line("undrain", "rail:0", &a),
            "undrained rail:0 (eth0, ib0)"
        );
        a.nics = None;
        assert_eq!(done_line("drain", "x", &a), "drained x");
        // The process's own words win.
        a.result = Some(json!("drained eth1: its traffic moves to other NICs"));
        assert_eq!(
            done_line("drain", "eth1", &a),
            "drained eth1: its traffic moves to other NICs"
        );
        a.result = Some(json!(["drained eth0: moves", "eth1 was already drained\n"]));
        assert_eq!(
            done_line("drain", "rail:0", &a),
            "drained eth0: moves; eth1 was already drained\\n"
        );
    }

    #[test]
    fn nic_specs_are_one_word() {
        assert_eq!(nic_spec("rail:1").unwrap(), "rail:1");
        for bad in ["", "eth0 eth1", "eth0\n", "a\u{0}", &"x".repeat(257)] {
            let e = nic_spec(bad).unwrap_err();
            assert!(e.contains("rail:N"), "{e}");
        }
    }
}
