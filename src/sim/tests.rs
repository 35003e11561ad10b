//! The seeded runs. Seeds are split over several tests so the harness runs them in
//! parallel; `RAILOVER_SIM_SEED=<n>` replays one seed with a trace instead, and
//! `RAILOVER_SIM_SEEDS=<n>` changes how many seeds a run covers. The bigger families
//! (four nodes and a rail switch, 256 comms) cost far more per seed: a run covers few of
//! them, and the ignored `soak` test ten times as many more.

use std::time::Duration;

use super::schedule::{Action, CommPlan, Family, Fault, Matching, Scenario};
use super::{run_scenario, run_seed, run_seeds, Failure, Report};

/// Two-node seeds per `cargo test` run, over all the shards below.
const SEEDS: u64 = 10_000;
const SHARDS: u64 = 8;

/// Seeds of `family` a run covers: the two-node family's `RAILOVER_SIM_SEEDS` (10,000
/// unless set), and one seed of a bigger family per so many of those (at least one), so
/// that each bigger family takes about a sixth of a run: a rail-switch seed costs about
/// seven two-node seeds, a 256-comm seed about 170.
fn seeds_of(family: Family) -> u64 {
    let two_nodes = env_u64("RAILOVER_SIM_SEEDS").unwrap_or(SEEDS);
    match family {
        Family::TwoNodes => two_nodes,
        Family::RailSwitch => two_nodes.div_ceil(25),
        Family::ManyComms => two_nodes.div_ceil(625),
        Family::Drains => two_nodes.div_ceil(25),
    }
}

/// Defects of the plugin (not of the simulation) that the simulation found and that are
/// not fixed yet: a name and the texts its broken invariants contain. A seed whose every
/// broken invariant contains one of these texts is printed as a known failure and does
/// not fail the run; anything else does. Replay a printed seed to see the defect. Empty
/// now: the defects it found are fixed, and their seeds are in [`REGRESSION_SEEDS`].
const KNOWN_FAILURES: &[(&str, &[&str])] = &[];

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v:?}: expected a non-negative integer"),
    }
}

fn known(f: &Failure) -> Option<&'static str> {
    let matches = |b: &String| {
        KNOWN_FAILURES
            .iter()
            .find(|(_, signs)| signs.iter().any(|sign| b.contains(sign)))
            .map(|(name, _)| *name)
    };
    let names: Option<Vec<&str>> = f.broke.iter().map(matches).collect();
    names.and_then(|n| n.first().copied())
}

fn shard(k: u64) {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return; // the replay test runs alone
    }
    let total = seeds_of(Family::TwoNodes);
    let failures = run_seeds(
        (0..total)
            .filter(|s| s % SHARDS == k)
            .map(|n| Family::TwoNodes.seed(n)),
    );
    judge(&failures, &format!("shard {k}"));
}

/// Runs the bigger family's first seeds.
fn family(family: Family) {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let failures = run_seeds((0..seeds_of(family)).map(|n| family.seed(n)));
    judge(&failures, &format!("{family}"));
}

/// Fails on a failure that is not a known one.
fn judge(failures: &[Failure], what: &str) {
    let mut fresh = Vec::new();
    let mut counts: Vec<(&str, usize)> = KNOWN_FAILURES.iter().map(|(n, _)| (*n, 0)).collect();
    for f in failures {
        match known(f) {
            Some(name) => {
                eprintln!("seed {}: known failure {name}: {}", f.seed, f.broke[0]);
                if let Some(c) = counts.iter_mut().find(|(n, _)| *n == name) {
                    c.1 += 1;
                }
            }
            None => fresh.push(format!(
                "{}  broke:\n    {}",
                f.schedule,
                f.broke.join("\n    ")
            )),
        }
    }
    eprintln!("{what}: known failures by defect: {counts:?}");
    assert!(
        fresh.is_empty(),
        "{} seed(s) broke an invariant; replay one with RAILOVER_SIM_SEED=<seed> cargo test --lib sim -- --nocapture\n{}",
        fresh.len(),
        fresh.join("\n")
    );
}

#[test]
fn seeds_0() {
    shard(0);
}
#[test]
fn seeds_1() {
    shard(1);
}
#[test]
fn seeds_2() {
    shard(2);
}
#[test]
fn seeds_3() {
    shard(3);
}
#[test]
fn seeds_4() {
    shard(4);
}
#[test]
fn seeds_5() {
    shard(5);
}
#[test]
fn seeds_6() {
    shard(6);
}
#[test]
fn seeds_7() {
    shard(7);
}

/// Four nodes all-to-all, a rail's switch failing mid-run: NIC `i` of every node at once.
#[test]
fn rail_switch_seeds() {
    family(Family::RailSwitch);
}

/// 256 comms, one NIC cut.
#[test]
fn many_comms_seeds() {
    family(Family::ManyComms);
}

/// A NIC drained and undrained under traffic, sometimes with another NIC cut meanwhile.
#[test]
fn drain_seeds() {
    family(Family::Drains);
}

/// A rail's switch going dark takes NIC `i` of all four nodes at once, and every reactor
/// hears of it: every comm on that rail, in each of the twelve directions, leaves it
/// (the run checks that none fails while another rail lives, and that each is back
/// home once the switch is).
#[test]
fn a_dark_rail_switch_moves_every_comm_on_its_rail() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let quiet = tracing::subscriber::NoSubscriber::default();
    let (mut seeds, mut moved) = (0, 0);
    for n in 0..40 {
        let s = Scenario::generate(Family::RailSwitch.seed(n));
        let Some(Action::Switch {
            rail,
            silent: false,
            ..
        }) = s.faults.first().map(|f| f.action)
        else {
            continue;
        };
        let r = tracing::subscriber::with_default(quiet, || run_scenario(&s, false));
        assert!(
            r.violations.is_empty(),
            "seed {} broke: {:?}",
            s.seed,
            r.violations
        );
        let on_rail: Vec<usize> = (0..s.comms.len())
            .filter(|&c| s.comms[c].nic == rail)
            .collect();
        let stayed: Vec<usize> = (on_rail.iter().copied())
            .filter(|&c| !r.left_home[c] && !r.failed[c])
            .collect();
        assert!(
            stayed.is_empty(),
            "seed {}: comms {stayed:?} stayed on rail {rail} through its switch's failure\n{s}",
            s.seed
        );
        seeds += 1;
        moved += on_rail.iter().filter(|&&c| r.left_home[c]).count();
    }
    eprintln!("{seeds} of 40 seeds took a rail's switch dark; {moved} comms left it");
    assert!(seeds >= 15 && moved >= 60, "{seeds} seeds, {moved} comms");
}

/// An operator's drain, at either end, with any pair allowed: every comm on the drained
/// NIC leaves it and none fails (the run checks it is back home once undrained).
#[test]
fn a_drained_nic_is_left_by_every_comm_on_it_and_none_fails() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let quiet = tracing::subscriber::NoSubscriber::default();
    let (mut seeds, mut moved) = (0, 0);
    for n in 0..120 {
        let s = Scenario::generate(Family::Drains.seed(n));
        let Some((at, Action::Drain { node, nic, .. })) =
            s.faults.first().map(|f| (f.at, f.action))
        else {
            continue;
        };
        if !s.rail_any || s.faults.len() != 2 {
            continue;
        }
        let r = tracing::subscriber::with_default(quiet, || run_scenario(&s, false));
        assert!(
            r.violations.is_empty(),
            "seed {} broke: {:?}",
            s.seed,
            r.violations
        );
        assert!(
            !r.failed.iter().any(|&f| f),
            "seed {}: a drain failed a comm\n{s}",
            s.seed
        );
        // Comms the drained node sends on the NIC, still sending well after the drain
        // (one that ended first had nothing to move). The sim sees a sender's own NIC,
        // so a drain at the receiving end, which may keep it, is judged by the run's
        // invariants alone.
        let on_nic: Vec<usize> = (0..s.comms.len())
            .filter(|&c| s.comms[c].nic == nic && s.comms[c].from == node)
            .filter(|&c| {
                let plan = &s.comms[c];
                plan.gap * plan.sizes.len() as u32 > at + Duration::from_millis(500)
            })
            .collect();
        let stayed: Vec<usize> = (on_nic.iter().copied())
            .filter(|&c| !r.left_home[c])
            .collect();
        assert!(
            stayed.is_empty(),
            "seed {}: comms {stayed:?} stayed on drained NIC {nic}\n{s}",
            s.seed
        );
        seeds += 1;
        moved += on_nic.len();
    }
    eprintln!("{seeds} of 120 seeds drained a NIC alone; {moved} comms left it");
    assert!(seeds >= 40 && moved >= 15, "{seeds} seeds, {moved} comms");
}

/// The bigger families' next seeds, ten times as many as a run covers, on every core:
/// `cargo test --lib sim::tests::soak -- --ignored --nocapture`.
#[test]
#[ignore = "ten times a run's seeds of the bigger families: minutes on every core"]
fn soak() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    for family in [Family::RailSwitch, Family::ManyComms, Family::Drains] {
        let n = seeds_of(family);
        let started = std::time::Instant::now();
        let failures: Vec<Failure> = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        run_seeds(
                            (n..11 * n)
                                .filter(|i| i % threads == t)
                                .map(|i| family.seed(i)),
                        )
                    })
                })
                .collect();
            runs.into_iter()
                .flat_map(|r| r.join().expect("a soak thread ends"))
                .collect()
        });
        eprintln!(
            "{family}: {} seeds ({} to {}) in {:?}",
            10 * n,
            family.seed(n),
            family.seed(11 * n - 1),
            started.elapsed()
        );
        judge(&failures, &format!("{family} (soak)"));
    }
}

/// Seeds that broke an invariant when one of two fixed router bugs was put back (of
/// 10,000 seeds, 746 caught the first and 310 the second), and seeds that showed the
/// defects the simulation itself found. They run in every shard too;
/// here they run first and alone, so a regression names its bug. They depend on the
/// schedule generator: when it changes, pick new ones the same way.
const REGRESSION_SEEDS: &[(u64, &str)] = &[
    // The original pair under its fail-back watch was refused as a candidate, so a comm
    // whose backup failed was given up although the original had healed.
    (11, "watched original pair refused as a candidate"),
    (19, "watched original pair refused as a candidate"),
    (28, "watched original pair refused as a candidate"),
    // One failed probe of the last candidate ended the comm at once, instead of
    // re-probing within the give-up window.
    (5, "one missed probe ending a comm"),
    (57, "one missed probe ending a comm"),
    (306, "one missed probe ending a comm"),
    // Defects the simulation found, fixed since. A receiver that lost carrier closed its
    // lane without a word; after a flap shorter than the sender's timeout, the sender
    // read the close and took the comm for ended.
    (440, "receiver carrier flap ended the comm"),
    (6993, "receiver carrier flap ended the comm"),
    // A receive comm that had given up still welcomed replacement lanes with a bogus
    // replay point; the sender retried them for good.
    (2440, "sender hung after its receiver gave up"),
    // A refused replay point left the comm on a closed lane: a panic at its close.
    (2681, "stale lane key at close"),
    // Past the give-up window, re-probes (and the fail-back watch) kept a lane waiting.
    (7272, "re-probes held a lane past its give-up window"),
    (
        5134,
        "the fail-back watch held a lane past its give-up window",
    ),
    // A healthy candidate waited on a sick one's re-probes until the receiver gave up.
    (1536, "a healthy pair waited on another's re-probes"),
];

#[test]
fn regression_seeds() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    for &(seed, bug) in REGRESSION_SEEDS {
        for f in run_seeds(std::iter::once(seed)) {
            assert!(
                known(&f).is_some(),
                "seed {seed} ({bug}) broke:\n{}\n    {}",
                f.schedule,
                f.broke.join("\n    ")
            );
        }
    }
}

/// Striping happens: a failed NIC's comm is spread over more than one pair (over three
/// on four-NIC nodes), and the home check above brings every one back to a single pair.
/// With comms moved whole (`stripes: Some(1)`) every spread here would be 1.
#[test]
fn failed_comms_are_striped_over_several_pairs() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let quiet = tracing::subscriber::NoSubscriber::default();
    let spreads: Vec<usize> = tracing::subscriber::with_default(quiet, || {
        (0..200).map(|s| run_seed(s, false).1.max_spread).collect()
    });
    let striped = spreads.iter().filter(|&&m| m >= 2).count();
    let widest = spreads.iter().copied().max().unwrap_or(0);
    eprintln!("{striped} of 200 seeds striped a comm; widest spread {widest} pairs");
    assert!(striped >= 20, "only {striped} of 200 seeds striped a comm");
    assert!(widest >= 3, "no comm was spread over three pairs");
}

/// Writes in place happen on the verbs-like seeds and only there (the shards check that
/// none lands in a receive that had finished; the hand-made runs below put some on the
/// wire of a rail that goes). Without placing lanes no seed would write in place.
#[test]
fn payloads_are_written_in_place_on_verbs_like_seeds() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let quiet = tracing::subscriber::NoSubscriber::default();
    let runs: Vec<(bool, u64)> = tracing::subscriber::with_default(quiet, || {
        (0..200)
            .map(|seed| {
                let (s, r) = run_seed(seed, false);
                (s.reaping, r.landed)
            })
            .collect()
    });
    let placing = runs.iter().filter(|r| r.1 > 0).count();
    let landed: u64 = runs.iter().map(|r| r.1).sum();
    eprintln!("{placing} of 200 seeds wrote in place ({landed} writes)");
    assert!(placing >= 50, "only {placing} of 200 seeds wrote in place");
    assert!(
        runs.iter()
            .all(|&(verbs_like, landed)| verbs_like || landed == 0),
        "a TCP-like seed wrote in place"
    );
}

/// Grouped receives, tagged sends in any order, "not now" answers and sends cut to
/// their receive happen on the seeds that group (half of them), through their faults;
/// the shards check every match against NCCL's IB transport (`conn::ib_model`).
#[test]
fn grouped_receives_and_retried_sends_happen_on_half_the_seeds() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let quiet = tracing::subscriber::NoSubscriber::default();
    let runs: Vec<(bool, Report)> = tracing::subscriber::with_default(quiet, || {
        (0..200)
            .map(|seed| {
                let (s, r) = run_seed(seed, false);
                (
                    s.comms
                        .iter()
                        .any(|c| c.matching != Matching::singles(c.sizes.len())),
                    r,
                )
            })
            .collect()
    });
    let grouping = runs.iter().filter(|(g, _)| *g).count();
    let sum = |f: fn(&Report) -> u64| runs.iter().map(|(_, r)| f(r)).sum::<u64>();
    let (grouped, cut, not_now) = (sum(|r| r.grouped), sum(|r| r.cut), sum(|r| r.not_now));
    let faulted = (runs.iter())
        .filter(|(_, r)| r.grouped > 0 && !r.violations.is_empty())
        .count();
    eprintln!(
        "{grouping} of 200 seeds group receives: {grouped} grouped receives finished, {cut} sends cut, {not_now} times \"not now\""
    );
    assert_eq!(faulted, 0);
    assert!(
        (80..=120).contains(&grouping),
        "{grouping} of 200 seeds group"
    );
    assert!(grouped >= 100 && cut >= 20 && not_now >= 200);
    assert!(
        runs.iter().all(|(g, r)| *g || (r.grouped, r.cut) == (0, 0)),
        "a seed that does not group grouped or cut"
    );
}

/// One comm from node 0 on rail 0 of two, 60 messages of 256 KiB a millisecond apart
/// (four in flight), over a verbs-like fabric, under `faults` (times in microseconds
/// from the start of traffic).
fn dense(faults: Vec<(u64, Action)>) -> Scenario {
    Scenario {
        seed: 0,
        kind: "hand-made",
        nodes: 2,
        nics: 2,
        rail_any: false,
        comms: vec![CommPlan {
            from: 0,
            to: 1,
            nic: 0,
            sizes: vec![256 << 10; 60],
            slack: vec![0; 60],
            gap: Duration::from_millis(1),
            window: 4,
            matching: Matching::singles(60),
        }],
        faults: faults
            .into_iter()
            .map(|(us, action)| Fault {
                at: Duration::from_micros(us),
                action,
            })
            .collect(),
        reaping: true,
        speeds: Vec::new(),
    }
}

fn carrier(node: usize, up: bool) -> Action {
    Action::Carrier { node, nic: 0, up }
}

fn slow(node: usize, factor: Option<u32>) -> Action {
    Action::Slow {
        node,
        nic: 0,
        factor,
    }
}

fn hole(node: usize, tx: bool, rx: bool, on: bool) -> Action {
    Action::Hole {
        node,
        nic: 0,
        tx,
        rx,
        on,
    }
}

/// Rail 0 lost with writes in place on its wire, and back before (or after) the NIC
/// would stop retrying them: every message arrives once, and no write from the lane
/// given up lands in a receive that had finished (a reused buffer's corruption).
#[test]
fn writes_in_place_on_a_lost_rail_never_land_late() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    // 20.15 ms: message 20's write in place is on the wire (it starts about 60 us after
    // the message is posted, once the receiver's offer is in, and takes 210 us).
    const CUT: u64 = 20_150;
    let cases: Vec<(&str, Vec<(u64, Action)>)> = vec![
        (
            "sender's carrier, 150 ms",
            vec![(CUT, carrier(0, false)), (CUT + 150_000, carrier(0, true))],
        ),
        (
            "receiver's carrier, 150 ms",
            vec![(CUT, carrier(1, false)), (CUT + 150_000, carrier(1, true))],
        ),
        (
            "both carriers, 150 ms",
            vec![
                (CUT, carrier(0, false)),
                (CUT, carrier(1, false)),
                (CUT + 150_000, carrier(0, true)),
                (CUT + 150_000, carrier(1, true)),
            ],
        ),
        (
            "both carriers, 1500 ms",
            vec![
                (CUT, carrier(0, false)),
                (CUT, carrier(1, false)),
                (CUT + 1_500_000, carrier(0, true)),
                (CUT + 1_500_000, carrier(1, true)),
            ],
        ),
        (
            "sender's outbound black hole, 1500 ms",
            vec![
                (CUT, hole(0, true, false, true)),
                (CUT + 1_500_000, hole(0, true, false, false)),
            ],
        ),
        // The last 64 KiB of message 20's write crawl for 1.15 s: the receiver gives the
        // lane up (nothing arrived for a second) while they are on the wire, the replay
        // completes the receive, and they arrive while the closed lane's QP is still up:
        // unless the receiver sealed the lane, the write lands in the finished receive.
        (
            "rail 0 slowed 22000 times, 3 s",
            vec![(20_190, slow(0, Some(22_000))), (3_020_190, slow(0, None))],
        ),
        (
            "the receiver's rail 0 slowed 22000 times, 3 s",
            vec![(20_190, slow(1, Some(22_000))), (3_020_190, slow(1, None))],
        ),
        (
            "receiver's inbound black hole, 1500 ms",
            vec![
                (CUT, hole(1, false, true, true)),
                (CUT + 1_500_000, hole(1, false, true, false)),
            ],
        ),
    ];
    let quiet = tracing::subscriber::NoSubscriber::default();
    let mut broke = Vec::new();
    let mut stopped = 0;
    for (name, faults) in cases {
        let s = dense(faults);
        let r = tracing::subscriber::with_default(quiet, || run_scenario(&s, false));
        eprintln!(
            "{name}: {} writes landed, {} stopped, {} comm(s) failed",
            r.landed, r.dropped, r.failed_comms
        );
        stopped += r.dropped;
        assert!(r.landed > 0, "{name}: nothing was written in place");
        if !r.violations.is_empty() {
            broke.push(format!("{name}:\n    {}", r.violations.join("\n    ")));
        }
    }
    assert!(broke.is_empty(), "{}", broke.join("\n"));
    assert!(
        stopped > 0,
        "no stray write was on the wire when a rail went"
    );
}

/// `RAILOVER_SIM_SEED=<n>`: that seed alone, traced.
/// Weighted striping through the real reactors: four NICs a node whose links report 200,
/// 200, 100 and 100 Mbit/s, one comm on NIC 0 of node 0, NIC 0 down. The comm's stripes
/// go to the survivors by link speed (most to NIC 1); with every speed unknown they split
/// evenly, as `railover sim --lockstep` and the router's unit tests say.
#[test]
fn a_failed_nics_stripes_go_to_the_survivors_by_link_speed() {
    if env_u64("RAILOVER_SIM_SEED").is_some() {
        return;
    }
    let run = |speeds: Vec<u64>| {
        let mut s = dense(vec![(20_000, carrier(0, false))]);
        s.nics = 4;
        s.speeds = speeds;
        let quiet = tracing::subscriber::NoSubscriber::default();
        let r = tracing::subscriber::with_default(quiet, || run_scenario(&s, false));
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert_eq!(r.failed_comms, 0);
        // The placement once the comm had spread its widest.
        let widest = r.placements.iter().map(|p| p.spread).max().unwrap_or(0);
        let p = (r.placements.iter())
            .find(|p| p.spread == widest && p.comm == 0)
            .unwrap_or_else(|| panic!("the comm never moved: {:?}", r.placements));
        let on = |nic: u32| p.stripes.iter().find(|s| s.0 == nic).map_or(0, |s| s.1);
        (on(0), on(1), on(2), on(3))
    };
    let (gone, fast, slow_a, slow_b) = run(vec![200, 200, 100, 100]);
    assert_eq!(gone, 0);
    assert_eq!(fast + slow_a + slow_b, 6, "two stripes per other NIC");
    assert!(fast > slow_a && fast > slow_b, "{fast}/{slow_a}/{slow_b}");
    assert_eq!(run(Vec::new()), (0, 2, 2, 2));
}

#[test]
fn replay() {
    let Some(seed) = env_u64("RAILOVER_SIM_SEED") else {
        return;
    };
    // The reactors' own log lines, interleaved with the simulation's trace.
    let log = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let (s, r) = tracing::subscriber::with_default(log, || run_seed(seed, true));
    eprintln!(
        "{s}ran {} ms of virtual time, {} comm(s) failed",
        r.virtual_time.as_millis(),
        r.failed_comms
    );
    assert!(
        r.violations.is_empty(),
        "seed {seed} broke:\n{}",
        r.violations.join("\n")
    );
}
