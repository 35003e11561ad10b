//! Failover without root: two plugin processes on loopback, four NICs each
//! (`RAILOVER_LOOPBACK_NICS`), a cut injected into the sender's NIC 0 and then lifted.
//! The cut leaves the lanes open and silent, so the receiver must notice by itself.

use std::process::Command;
use std::time::Duration;

use railover_testkit::fault_line::{Command as Cmd, Event, Link, Summary};
use railover_testkit::testbed::proc::Proc;

/// Whether `line` is an event that `pred` accepts.
fn is(line: &str, pred: impl Fn(&Event) -> bool) -> bool {
    Event::parse(line).is_some_and(|e| pred(&e))
}

fn is_nic_bytes(line: &str) -> bool {
    is(line, |e| matches!(e, Event::NicBytes { .. }))
}

fn peer(role: &str) -> Proc {
    let mut c = Command::new(env!("CARGO_BIN_EXE_railover"));
    c.args([
        "fault-peer",
        role,
        "--per-dev",
        "2",
        "--size",
        "256k",
        "--seconds",
        "9",
    ])
    .env("RAILOVER_LOOPBACK_NICS", "4")
    .env_remove("RAILOVER_IFNAME")
    .env("RAILOVER_METRICS_PORT", "off");
    Proc::spawn(c, role).expect("spawn fault-peer")
}

#[test]
fn an_injected_cut_moves_traffic_and_lifting_it_brings_it_back() {
    let t = Duration::from_secs(30);
    let recv = peer("recv");
    assert!(
        recv.wait_line(t, |l| is(l, |e| matches!(e, Event::Listening { .. })))
            .is_some(),
        "{}",
        recv.stderr_tail(10)
    );
    let mut send = peer("send");
    for l in recv.lines() {
        if let Some(Event::Handle(h)) = Event::parse(&l) {
            send.send(&Cmd::Handle(h).to_line());
        }
    }
    send.send(&Cmd::Go.to_line());
    assert!(
        send.wait_line(t, |l| is(l, |e| matches!(e, Event::Connected { .. })))
            .is_some(),
        "{}",
        send.stderr_tail(10)
    );
    // Let traffic run on every NIC, then cut NIC 0 of the sender.
    assert!(send.wait_count(t, 10, is_nic_bytes));
    let cut = |link| Cmd::Link { link, dev: 0 }.to_line();
    send.send(&cut(Link::Down));
    assert!(send
        .wait_line(t, |l| is(l, |e| matches!(
            e,
            Event::Injected {
                link: Link::Down,
                dev: 0,
                ..
            }
        )))
        .is_some());
    let moved = |p: &Proc, what: &str| {
        p.stderr_tail(400)
            .lines()
            .filter(|l| l.contains(what))
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while moved(&send, " failover comm=") < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no failover:\n{}",
            send.stderr_tail(20)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // While cut, NIC 0 carries nothing new: sample its counter twice, 500 ms apart.
    let nic0 = |p: &Proc| -> u64 {
        p.lines()
            .iter()
            .rev()
            .find_map(|l| match Event::parse(l)? {
                Event::NicBytes { tx, .. } => tx.first().copied(),
                _ => None,
            })
            .unwrap_or(0)
    };
    let a = nic0(&send);
    assert!(send.wait_count(t, 5, is_nic_bytes));
    assert_eq!(nic0(&send), a, "the cut NIC still sends");
    send.send(&cut(Link::Up));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while moved(&send, " failback comm=") < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no fail-back:\n{}",
            send.stderr_tail(20)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The receiver stops by itself once every comm's END arrived; only then may the
    // sender close its comms.
    let mut recv = recv;
    assert!(recv.wait_exit(t).is_some(), "receiver did not stop");
    send.close_stdin();
    let mut send = send;
    assert!(send.wait_exit(t).is_some(), "sender did not stop");
    let summary: Summary =
        Event::last_summary(&recv.lines()).expect("the receiver printed its summary");
    assert_eq!(summary.bad, 0, "{summary:?}");
    assert_eq!(
        summary.req_errors,
        0,
        "{summary:?}\n{}",
        recv.stderr_tail(20)
    );
    assert_eq!(
        summary.ended, summary.comms,
        "every comm delivered its end: {summary:?}"
    );
    assert!(summary.comms > 0, "{summary:?}");
}
