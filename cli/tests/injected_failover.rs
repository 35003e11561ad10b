//! Failover without root: two plugin processes on loopback, four NICs each
//! (`RAILOVER_LOOPBACK_NICS`), a cut injected into the sender's NIC 0 and then lifted.
//! The cut leaves the lanes open and silent, so the receiver must notice by itself.

use std::process::Command;
use std::time::Duration;

use railover_testkit::testbed::proc::Proc;

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
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
        recv.wait_line(t, |l| l.starts_with("listening")).is_some(),
        "{}",
        recv.stderr_tail(10)
    );
    let mut send = peer("send");
    for h in recv.lines().iter().filter(|l| l.starts_with("handle ")) {
        send.send(h);
    }
    send.send("go");
    assert!(
        send.wait_line(t, |l| l.starts_with("connected")).is_some(),
        "{}",
        send.stderr_tail(10)
    );
    // Let traffic run on every NIC, then cut NIC 0 of the sender.
    assert!(send.wait_count(t, 10, |l| l.starts_with("nicbytes")));
    send.send("link-down 0");
    assert!(send
        .wait_line(t, |l| l.starts_with("injected link-down"))
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
        let l = p
            .lines()
            .into_iter()
            .rev()
            .find(|l| l.starts_with("nicbytes"))
            .unwrap_or_default();
        field(&l, "tx")
            .and_then(|v| v.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    let a = nic0(&send);
    assert!(send.wait_count(t, 5, |l| l.starts_with("nicbytes")));
    assert_eq!(nic0(&send), a, "the cut NIC still sends");
    send.send("link-up 0");
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
    let summary = recv
        .lines()
        .into_iter()
        .rev()
        .find(|l| l.starts_with("summary"))
        .unwrap_or_default();
    assert_eq!(field(&summary, "bad"), Some("0"), "{summary}");
    assert_eq!(
        field(&summary, "req_errors"),
        Some("0"),
        "{summary}\n{}",
        recv.stderr_tail(20)
    );
    assert_eq!(
        field(&summary, "ended"),
        field(&summary, "comms"),
        "every comm delivered its end: {summary}"
    );
}
