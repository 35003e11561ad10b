//! A send no receive matches, as NCCL's IB transport treats it: `isend` answers "not now"
//! for as long as it takes, the comm stays open, and once sends have found no buffer for
//! their tags for `RAILOVER_UNMATCHED_WARN_MS`, one WARN per comm names the waiting tags
//! and the free ones, and `railover_unmatched_sends_total` counts the comm. In its own
//! test binary: it sets the bound for the process's one plugin.

use std::time::{Duration, Instant};

use railover::telemetry::log::{self, Severity};
use railover_testkit::driver::{connect_pair, Ctx, Request};

const BOUND_MS: u64 = 200;

fn warns() -> Vec<String> {
    log::captured()
        .into_iter()
        .filter(|(sev, line)| *sev == Severity::Warn && line.contains("found no matching receive"))
        .map(|(_, line)| line)
        .collect()
}

fn counted(ctx: &railover::plugin::Runtime) -> f64 {
    let text = ctx.telemetry.render();
    text.lines()
        .find(|l| l.starts_with("railover_unmatched_sends_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

fn done(req: &mut Request) -> Vec<usize> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(sizes) = req.test_all().unwrap() {
            return sizes;
        }
        assert!(Instant::now() < end, "request did not complete");
        std::thread::yield_now();
    }
}

#[test]
fn a_send_no_receive_matches_is_reported_once_and_the_comm_stays_open() {
    std::env::set_var("RAILOVER_IFNAME", "lo");
    std::env::set_var("RAILOVER_METRICS_PORT", "off");
    std::env::set_var("RAILOVER_UNMATCHED_WARN_MS", BOUND_MS.to_string());
    log::capture();
    let ctx = Ctx::init().unwrap();
    let rt = railover::plugin::runtime().unwrap();
    let (mut h, l) = ctx.listen(0).unwrap();
    let (s, r) = connect_pair(&ctx, 0, &mut h, &l, Duration::from_secs(30)).unwrap();
    let (mut a, mut b) = (r.register(64).unwrap(), r.register(64).unwrap());
    let mut rr = r
        .irecv_group(&mut [(&mut a, 64, 1), (&mut b, 64, 2)])
        .unwrap()
        .expect("slot");
    let (sb, stray) = (s.register(8).unwrap(), s.register(8).unwrap());
    let mut one = s.isend_patiently(&sb, 8, 1).unwrap().expect("taken");
    assert_eq!(done(&mut one), vec![8]);
    // The head group is known and has no free buffer with tag 3 (nor 4): "not now",
    // as often as asked, until the bound passes and one WARN names them.
    let start = Instant::now();
    while warns().is_empty() {
        assert!(s.isend_tagged(&stray, 8, 3).unwrap().is_none());
        assert!(s.isend_tagged(&stray, 8, 4).unwrap().is_none());
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no WARN after 30 s of sends no receive matches"
        );
        std::thread::yield_now();
    }
    assert!(
        start.elapsed() >= Duration::from_millis(BOUND_MS),
        "reported before the bound"
    );
    let w = warns();
    assert!(
        w[0].contains("tags [3, 4]") && w[0].contains("only for tags [2]"),
        "{}",
        w[0]
    );
    // Once per comm: more of the same is not logged again.
    let more = Instant::now();
    while more.elapsed() < Duration::from_millis(3 * BOUND_MS) {
        assert!(s.isend_tagged(&stray, 8, 3).unwrap().is_none());
        std::thread::yield_now();
    }
    assert_eq!(warns().len(), 1, "{:?}", warns());
    let end = Instant::now() + Duration::from_secs(30);
    while counted(&rt) < 1.0 {
        assert!(
            Instant::now() < end,
            "railover_unmatched_sends_total never counted it"
        );
        std::thread::yield_now();
    }
    // The comm was never failed: the tag-2 send completes the group, and a receive with
    // tag 3 takes the stray send.
    let sb2 = s.register(8).unwrap();
    let mut two = s.isend_patiently(&sb2, 8, 2).unwrap().expect("taken");
    assert_eq!(done(&mut rr), vec![8, 8]);
    assert_eq!(done(&mut two), vec![8]);
    let mut c = r.register(64).unwrap();
    let mut rr = r
        .irecv_group(&mut [(&mut c, 64, 3)])
        .unwrap()
        .expect("slot");
    let mut three = s.isend_patiently(&stray, 8, 3).unwrap().expect("taken");
    assert_eq!(done(&mut rr), vec![8]);
    assert_eq!(done(&mut three), vec![8]);
    drop((s, r, l));
    ctx.finalize().unwrap();
}
