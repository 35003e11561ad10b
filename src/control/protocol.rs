//! The control protocol, sans-IO: where a request line ends, what it asks, and the JSON
//! answer line (`docs/control.md` has the protocol for users).
//!
//! One request per connection: one line of text, at most [`MAX_REQUEST`] bytes before its
//! `\n` (a `\r` before it is dropped; a client that closes its side may leave the `\n`
//! out). Words are separated by blanks: `status`, `drain NIC`, `undrain NIC`. Whatever
//! follows the first line is ignored. The answer is one line of JSON, then the server
//! closes: `{"ok":true,"pid":P,"result":…}` or `{"ok":false,"pid":P,"error":"…"}`. A
//! drain or undrain answer also lists the NICs it named (`"nics"`), and a refusal part
//! way through a spec naming several NICs lists those already done (`"done"`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::nics::SPEC_ACCEPTED;
use super::{resolve, Handler, NicIdent, Request, Source, CONNECTION_DEADLINE, MAX_REQUEST};
use crate::config::shown_value;

/// The requests, for error messages.
pub const REQUESTS: &str = "status, drain NIC or undrain NIC";

/// A parsed request line; the NIC spec is resolved against the process's NICs later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    Status,
    Drain(String),
    Undrain(String),
}

/// How far a client's bytes make a request line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// No line end yet, and still short enough.
    Incomplete,
    /// The line, without its line end.
    Line(&'a [u8]),
    /// Longer than [`MAX_REQUEST`] before its line end.
    TooLong,
}

/// Frames `input`, all a client has sent; `eof` when it closed its side, which ends the
/// line too.
pub fn frame(input: &[u8], eof: bool) -> Frame<'_> {
    let end = match input.iter().position(|&b| b == b'\n') {
        Some(end) => end,
        None if input.len() > MAX_REQUEST => return Frame::TooLong,
        None if eof => input.len(),
        None => return Frame::Incomplete,
    };
    if end > MAX_REQUEST {
        return Frame::TooLong;
    }
    let line = &input[..end];
    Frame::Line(line.strip_suffix(b"\r").unwrap_or(line))
}

/// What `line` asks, or a refusal saying what is accepted.
pub fn parse(line: &[u8]) -> Result<Ask, String> {
    let Ok(text) = std::str::from_utf8(line) else {
        return Err(format!(
            "the request is not UTF-8 text: expected {REQUESTS}"
        ));
    };
    let words: Vec<&str> = text.split_ascii_whitespace().collect();
    match words.as_slice() {
        [] => Err(format!("empty request: expected {REQUESTS}")),
        ["status"] => Ok(Ask::Status),
        ["status", rest @ ..] => Err(format!(
            "status takes no argument, got {}: expected {REQUESTS}",
            shown_value(&rest.join(" "))
        )),
        [verb @ ("drain" | "undrain")] => Err(format!(
            "{verb} needs a NIC: expected {verb} NIC, NIC being {SPEC_ACCEPTED}"
        )),
        [verb @ ("drain" | "undrain"), nic] => Ok(if *verb == "drain" {
            Ask::Drain(nic.to_string())
        } else {
            Ask::Undrain(nic.to_string())
        }),
        [verb @ ("drain" | "undrain"), rest @ ..] => Err(format!(
            "{verb} takes one NIC, got {} ({}): expected {verb} NIC, NIC being {SPEC_ACCEPTED}",
            rest.len(),
            shown_value(&rest.join(" "))
        )),
        [verb, ..] => Err(format!(
            "unknown request {}: expected {REQUESTS}",
            shown_value(verb)
        )),
    }
}

/// The refusal for a line longer than [`MAX_REQUEST`].
pub fn too_long() -> String {
    format!(
        "the request is longer than {MAX_REQUEST} bytes: expected one line of at most \
         {MAX_REQUEST} bytes: {REQUESTS}"
    )
}

/// The refusal for a client that sent no complete line before its deadline.
pub fn too_slow() -> String {
    format!(
        "no complete request line within {} s: expected one line ending in a newline: \
         {REQUESTS}",
        CONNECTION_DEADLINE.as_secs()
    )
}

/// The refusal for a client whose uid may not control this process.
pub fn not_allowed(peer_uid: u32, own_uid: u32) -> String {
    format!(
        "uid {peer_uid} may not control this process: only uid {own_uid} (its own) and root \
         may"
    )
}

/// Whether a client of uid `peer` may control a process of uid `own`.
pub fn allowed(peer: u32, own: u32) -> bool {
    peer == own || peer == 0
}

/// One answer line's content. The CLI reads answers back with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub ok: bool,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The NICs a drain or undrain named, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics: Option<Vec<String>>,
    /// On a refusal part way through several NICs: those already done, not undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done: Option<Vec<String>>,
}

impl Answer {
    pub fn refusal(pid: u32, error: String) -> Answer {
        Answer {
            ok: false,
            pid,
            result: None,
            error: Some(error),
            nics: None,
            done: None,
        }
    }

    /// The answer line, `\n` included.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings, numbers and JSON values always serialises.
        let mut out = serde_json::to_vec(self).unwrap_or_else(|e| {
            format!(
                r#"{{"ok":false,"pid":{},"error":"cannot encode: {e}"}}"#,
                self.pid
            )
            .into_bytes()
        });
        out.push(b'\n');
        out
    }
}

/// Calls `handler`, turning a panic into a refusal: the control thread must outlive a
/// bug in one request.
pub fn call(handler: &dyn Handler, request: Request, source: Source) -> Result<Value, String> {
    let shown = format!("{request:?}");
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        handler.handle(request, source)
    })) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text panic".into());
            tracing::warn!("railover: handling the control request {shown} panicked: {msg}");
            Err(format!(
                "railover failed while handling it ({msg}); see the process's log"
            ))
        }
    }
}

/// Answers request line `line` of process `pid`, calling `handler` once per NIC named.
pub fn execute(line: &[u8], nics: &[NicIdent], handler: &dyn Handler, pid: u32) -> Answer {
    let ask = match parse(line) {
        Ok(ask) => ask,
        Err(e) => return Answer::refusal(pid, e),
    };
    let (spec, drain) = match ask {
        Ask::Status => {
            return match call(handler, Request::Status, Source::Socket) {
                Ok(v) => Answer {
                    result: Some(v),
                    ..ok(pid)
                },
                Err(e) => Answer::refusal(pid, e),
            }
        }
        Ask::Drain(spec) => (spec, true),
        Ask::Undrain(spec) => (spec, false),
    };
    let ids = match resolve(&spec, nics) {
        Ok(ids) => ids,
        Err(e) => return Answer::refusal(pid, e),
    };
    // A rail always answers with an array, even of one: its shape is the spec's, not
    // the node's.
    let many = ids.len() > 1 || spec.to_ascii_lowercase().starts_with("rail:");
    let mut results = Vec::with_capacity(ids.len());
    let mut done: Vec<String> = Vec::new();
    for &nic in &ids {
        let name = nics[nic].name.clone();
        let request = if drain {
            Request::Drain { nic }
        } else {
            Request::Undrain { nic }
        };
        match call(handler, request, Source::Socket) {
            Ok(v) => {
                results.push(v);
                done.push(name);
            }
            Err(e) => {
                let mut error = if many { format!("{name}: {e}") } else { e };
                if !done.is_empty() {
                    error.push_str(&format!(
                        " ({} {} before it, not undone)",
                        done.join(", "),
                        if drain { "drained" } else { "undrained" }
                    ));
                }
                return Answer {
                    done: (!done.is_empty()).then_some(done),
                    ..Answer::refusal(pid, error)
                };
            }
        }
    }
    Answer {
        result: Some(if many {
            Value::Array(results)
        } else {
            results.pop().unwrap_or(Value::Null)
        }),
        nics: Some(done),
        ..ok(pid)
    }
}

fn ok(pid: u32) -> Answer {
    Answer {
        ok: true,
        pid,
        result: None,
        error: None,
        nics: None,
        done: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::nics::tests::node;
    use parking_lot::Mutex;
    use serde_json::json;

    #[test]
    fn lines_end_at_a_newline_or_the_clients_close() {
        assert_eq!(frame(b"", false), Frame::Incomplete);
        assert_eq!(frame(b"stat", false), Frame::Incomplete);
        assert_eq!(frame(b"status\n", false), Frame::Line(b"status"));
        assert_eq!(frame(b"status\r\n", false), Frame::Line(b"status"));
        assert_eq!(frame(b"status\nstatus\n", false), Frame::Line(b"status"));
        assert_eq!(frame(b"status", true), Frame::Line(b"status"));
        assert_eq!(frame(b"", true), Frame::Line(b""));
        let longest = vec![b'a'; MAX_REQUEST];
        assert_eq!(frame(&longest, false), Frame::Incomplete);
        let mut line = longest.clone();
        line.push(b'\n');
        assert_eq!(frame(&line, false), Frame::Line(&longest[..]));
        let over = vec![b'a'; MAX_REQUEST + 1];
        assert_eq!(frame(&over, false), Frame::TooLong);
        assert_eq!(frame(&over, true), Frame::TooLong);
        let mut over_line = over.clone();
        over_line.push(b'\n');
        assert_eq!(frame(&over_line, false), Frame::TooLong);
        assert!(too_long().contains("1024"));
    }

    #[test]
    fn requests_parse() {
        assert_eq!(parse(b"status"), Ok(Ask::Status));
        assert_eq!(parse(b"  status\t"), Ok(Ask::Status));
        assert_eq!(parse(b"drain eth1"), Ok(Ask::Drain("eth1".into())));
        assert_eq!(
            parse(b"undrain  rail:2 "),
            Ok(Ask::Undrain("rail:2".into()))
        );
    }

    #[test]
    fn every_bad_request_is_refused_saying_what_is_accepted() {
        for (line, says) in [
            (&b""[..], "empty request"),
            (b"   ", "empty request"),
            (b"stats", "unknown request \"stats\""),
            (b"Status", "unknown request \"Status\""),
            (b"drian eth1", "unknown request \"drian\""),
            (b"status now", "status takes no argument, got \"now\""),
            (b"drain", "drain needs a NIC"),
            (b"undrain", "undrain needs a NIC"),
            (
                b"drain eth1 eth2",
                "drain takes one NIC, got 2 (\"eth1 eth2\")",
            ),
            (b"undrain a b c", "undrain takes one NIC, got 3"),
            (b"drain \xff\xfe", "not UTF-8"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(e.contains(says), "{line:?}: {e}");
            assert!(
                e.contains(REQUESTS) || e.contains(SPEC_ACCEPTED),
                "{line:?} does not say what is accepted: {e}"
            );
        }
    }

    #[test]
    fn answers_are_one_json_line_with_ok_first() {
        let a = Answer {
            result: Some(json!({"comms": 3})),
            ..ok(42)
        };
        assert_eq!(
            a.encode(),
            b"{\"ok\":true,\"pid\":42,\"result\":{\"comms\":3}}\n"
        );
        let r = Answer::refusal(42, "no \"x\"\nhere".into());
        let line = r.encode();
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(
            line,
            b"{\"ok\":false,\"pid\":42,\"error\":\"no \\\"x\\\"\\nhere\"}\n"
        );
        let back: Answer = serde_json::from_slice(&line).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn only_the_own_uid_and_root_are_served() {
        assert!(allowed(1000, 1000));
        assert!(allowed(0, 1000));
        assert!(!allowed(1001, 1000));
        assert!(!allowed(1000, 0));
        let e = not_allowed(1001, 1000);
        assert!(e.contains("uid 1001") && e.contains("uid 1000"), "{e}");
    }

    /// Records calls; refuses what `refuse` names.
    struct Fake {
        calls: Mutex<Vec<(Request, Source)>>,
        refuse: Option<usize>,
    }

    impl Handler for Fake {
        fn handle(&self, request: Request, source: Source) -> Result<Value, String> {
            self.calls.lock().push((request.clone(), source));
            match request {
                Request::Status => Ok(json!({"pid": 1})),
                Request::Drain { nic } | Request::Undrain { nic } if Some(nic) == self.refuse => {
                    Err(format!("NIC {nic} is the last one"))
                }
                Request::Drain { nic } => Ok(json!({"drained": nic})),
                Request::Undrain { nic } => Ok(json!({"undrained": nic})),
            }
        }
    }

    fn fake(refuse: Option<usize>) -> Fake {
        Fake {
            calls: Mutex::new(Vec::new()),
            refuse,
        }
    }

    #[test]
    fn one_nic_answers_its_result_several_an_array() {
        let n = node();
        let h = fake(None);
        let a = execute(b"drain eth1", &n, &h, 7);
        assert!(a.ok, "{a:?}");
        assert_eq!(a.result, Some(json!({"drained": 1})));
        assert_eq!(a.nics, Some(vec!["eth1".to_string()]));
        let a = execute(b"undrain rail:0", &n, &h, 7);
        assert_eq!(a.result, Some(json!([{"undrained": 0}, {"undrained": 2}])));
        assert_eq!(a.nics, Some(vec!["eth0".into(), "mlx5_0:1".into()]));
        // A rail of one NIC is still an array.
        let one = vec![n[0].clone()];
        let a = execute(b"drain rail:0", &one, &h, 7);
        assert_eq!(a.result, Some(json!([{"drained": 0}])));
        let a = execute(b"status", &n, &h, 7);
        assert_eq!(a.result, Some(json!({"pid": 1})));
        assert_eq!(
            *h.calls.lock(),
            [
                (Request::Drain { nic: 1 }, Source::Socket),
                (Request::Undrain { nic: 0 }, Source::Socket),
                (Request::Undrain { nic: 2 }, Source::Socket),
                (Request::Drain { nic: 0 }, Source::Socket),
                (Request::Status, Source::Socket),
            ]
        );
    }

    #[test]
    fn a_refusal_part_way_names_what_was_done_and_undoes_nothing() {
        let n = node();
        let h = fake(Some(2));
        let a = execute(b"drain rail:0", &n, &h, 7);
        assert!(!a.ok);
        let e = a.error.unwrap();
        assert_eq!(
            e,
            "mlx5_0:1: NIC 2 is the last one (eth0 drained before it, not undone)"
        );
        assert_eq!(a.done, Some(vec!["eth0".to_string()]));
        assert_eq!(h.calls.lock().len(), 2, "no undo call");
        // One NIC: the handler's text as it is.
        let a = execute(b"drain mlx5_0:1", &n, &h, 7);
        assert_eq!(a.error.as_deref(), Some("NIC 2 is the last one"));
        assert_eq!(a.done, None);
    }

    #[test]
    fn unknown_nics_and_bad_lines_never_reach_the_handler() {
        let n = node();
        let h = fake(None);
        let a = execute(b"drain eth9", &n, &h, 7);
        assert!(!a.ok);
        assert!(a.error.unwrap().contains("no NIC \"eth9\""));
        let a = execute(b"frob", &n, &h, 7);
        assert!(a.error.unwrap().contains("unknown request"));
        assert!(h.calls.lock().is_empty());
    }

    struct Panics;
    impl Handler for Panics {
        fn handle(&self, _: Request, _: Source) -> Result<Value, String> {
            panic!("boom")
        }
    }

    #[test]
    fn a_panicking_handler_is_a_refusal() {
        let a = execute(b"status", &node(), &Panics, 7);
        assert!(!a.ok);
        assert!(a.error.unwrap().contains("boom"));
    }
}
