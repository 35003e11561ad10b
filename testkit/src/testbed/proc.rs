//! A child process whose stdout lines are collected (with the time each arrived) by a
//! reader thread, so a test can wait for a line with a deadline instead of sleeping.
//! The child is killed on drop.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Stderr lines kept per child (the newest).
const KEPT_STDERR_LINES: usize = 50_000;

#[derive(Debug, Default)]
struct Shared {
    lines: Vec<String>,
    stderr: std::collections::VecDeque<String>,
    eof: bool,
}

#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<(Mutex<Shared>, Condvar)>,
    readers: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn spawn(mut cmd: Command, name: &str) -> std::io::Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let out = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let o = out.clone();
        let r1 = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                o.0.lock().unwrap().lines.push(line);
                o.1.notify_all();
            }
            o.0.lock().unwrap().eof = true;
            o.1.notify_all();
        });
        let o = out.clone();
        let r2 = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut s = o.0.lock().unwrap();
                // Keep the last lines for failure messages and the failover lines a
                // bench reads: a storm of 4,096 comms logs one per comm and side.
                if s.stderr.len() >= KEPT_STDERR_LINES {
                    s.stderr.pop_front();
                }
                s.stderr.push_back(line);
            }
        });
        Ok(Proc {
            name: name.to_string(),
            stdin: child.stdin.take(),
            child,
            out,
            readers: vec![r1, r2],
            status: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes one line to the child's stdin (ignored once it is gone).
    pub fn send(&mut self, line: &str) {
        if let Some(s) = self.stdin.as_mut() {
            let _ = writeln!(s, "{line}").and_then(|_| s.flush());
        }
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Waits until a line satisfies `pred` (returning it) or the deadline/EOF passes.
    pub fn wait_line(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let end = Instant::now() + timeout;
        let (m, cv) = &*self.out;
        let mut seen = 0;
        let mut g = m.lock().unwrap();
        loop {
            if let Some(l) = g.lines[seen..].iter().find(|l| pred(l)) {
                return Some(l.clone());
            }
            seen = g.lines.len();
            let now = Instant::now();
            if g.eof || now >= end {
                return None;
            }
            g = cv.wait_timeout(g, end - now).unwrap().0;
        }
    }

    /// Waits until at least `n` lines satisfy `pred`.
    pub fn wait_count(&self, timeout: Duration, n: usize, pred: impl Fn(&str) -> bool) -> bool {
        let end = Instant::now() + timeout;
        let (m, cv) = &*self.out;
        let mut g = m.lock().unwrap();
        loop {
            if g.lines.iter().filter(|l| pred(l)).count() >= n {
                return true;
            }
            let now = Instant::now();
            if g.eof || now >= end {
                return false;
            }
            g = cv.wait_timeout(g, end - now).unwrap().0;
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.out.0.lock().unwrap().lines.clone()
    }

    pub fn stderr_tail(&self, n: usize) -> String {
        let s = self.out.0.lock().unwrap();
        let from = s.stderr.len().saturating_sub(n);
        let tail: Vec<&str> = s.stderr.range(from..).map(String::as_str).collect();
        tail.join("\n")
    }

    /// Polls for the exit until the deadline; `None` means still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(st) = self.status {
                return Some(st);
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                self.status = Some(st);
                // Both pipes close with the process: collect the last lines.
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return Some(st);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL (the "peer process killed" fault, and cleanup).
    pub fn kill(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.wait_exit(Duration::from_secs(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
